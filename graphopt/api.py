"""``graphopt.optimize``: options -> capture -> verified passes -> the module handed back.

The user's model is deep-copied once, at entry, and never touched again. The returned
`OptimizedModule` shares the optimized graph's parameters and submodules directly (no
wrapper prefix), so ``state_dict()`` keys are the model's own where a parameter still
exists, and ``.to()``, ``.parameters()`` and hooks behave as on any module.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt import tuning
from graphopt.backends.fuse_compile import FUSE_BACKENDS, FusedRegion, compile_graph, compile_regions
from graphopt.capture import capture_graph, check_frontend, one_at_a_time
from graphopt.device import enable_cudnn_benchmark, resolve_device
from graphopt.checkpoint import StateChange, key_map, to_optimized, to_original
from graphopt.diff import snapshot
from graphopt.errors import CheckpointError, InvalidModelError, InvalidOptionError, ModeSwitchError, SideEffectWarning, UnknownPassError, VerificationWarning
from graphopt.inputs import InputSignature
from graphopt.ops import PRECISION_FAMILY_NAMES, get_attr
from graphopt.passes import MODES, REGISTRY, Mode, PassContext, PassInfo
from graphopt.passes.use_low_precision import DEFAULT_FP32_OPS, DEFAULT_LOW_PRECISION_OPS
from graphopt.passes.use_onednn_kernels import prepacked_modules
from graphopt.pipeline import Verifier, low_precision_position, resolve_passes, run_verified
from graphopt.report import Report
from graphopt.side_effects import preserved_user_objects, side_effects_message, watch_side_effects
from graphopt.validate import SecondInputs, check_inputs, check_model, reference_run
from graphopt import verify as verify_outputs
from graphopt.verify import Check, tolerance_for


class OptimizedModule(nn.Module):
    """The module `optimize` returns: the optimized graph, its report, and mode guards.

    - ``graphopt_report``: the `Report` of what was done.
    - ``graph_module``: the optimized ``torch.fx.GraphModule`` (also ``.graph``, ``.code``).
    - ``input_signature``: the calls it accepts (`graphopt.inputs.InputSignature`): the
      example's dtypes, devices, ranks and sizes, the batch size free where a second batch
      size was verified. Other calls raise `InputMismatchError` before the graph runs.
    - Inference: forward runs under ``torch.inference_mode()`` (``inference_mode`` is
      True), whose outputs are inference tensors: they cannot be saved for backward
      (e.g. as distillation targets) or updated in place later. Set
      ``module.inference_mode = False`` to run under ``torch.no_grad()`` instead; that is
      the default when the graph writes stored state.
    - ``fuse="graph"``: forward runs the torch.compile'd graph (``graph_module`` stays the
      eager graph, for export and inspection).
    - ``.train()`` on an inference module raises `ModeSwitchError` (folded BatchNorms and
      removed dropout would train wrongly); a graph captured by torch.export has its
      train/eval behaviour fixed, so switching its mode raises too.
    - Checkpoints: ``parameter_map`` says what became of each original key that a pass
      removed or rewrote; ``load_original_state_dict`` loads a checkpoint of the original
      model (re-applying the passes' changes); ``original_state_dict`` gives this
      module's state with the original model's keys (see `graphopt.checkpoint`).
    """

    graph_module: fx.GraphModule

    def __init__(
        self,
        graph_module: fx.GraphModule,
        report: Report,
        runner: FusedRegion | None = None,
        original_keys: Iterable[str] = (),
        signature: InputSignature | None = None,
    ) -> None:
        super().__init__()
        # Share, don't register: registering would prefix every state_dict key with "graph_module.".
        object.__setattr__(self, "graph_module", graph_module)
        object.__setattr__(self, "_runner", runner if runner is not None else graph_module)
        self._modules = graph_module._modules
        self._parameters = graph_module._parameters
        self._buffers = graph_module._buffers
        self._non_persistent_buffers_set = graph_module._non_persistent_buffers_set
        self.graphopt_report = report
        self.training = report.mode == "training"
        self.inference_mode = report.mode == "inference" and not _updates_state(graph_module)
        self.original_keys = tuple(original_keys)  # the original model's state_dict keys, in its order
        self.input_signature = signature  # the calls the graph accepts (None: not checked)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def code(self) -> str:
        return self.graph_module.code

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.input_signature is not None:
            args = self.input_signature.bind(args, kwargs)
            self.input_signature.check(args)
            kwargs = {}
        if self.graphopt_report.mode == "training":
            return self._runner(*args, **kwargs)
        with torch.inference_mode() if self.inference_mode else torch.no_grad():
            return self._runner(*args, **kwargs)

    def train(self, mode: bool = True) -> OptimizedModule:
        report = self.graphopt_report
        if mode and report.mode == "inference":
            raise ModeSwitchError(
                "this module was optimized for inference (BatchNorm folded into convs, dropout removed): training it "
                "would be wrong. Optimize the original model with graphopt.optimize(model, inputs, mode='training') "
                "to train, and keep this one for inference."
            )
        if report.frontend == "export" and mode != (report.mode == "training"):
            raise ModeSwitchError(
                f"this module was captured by torch.export in {report.mode} mode, which fixes train/eval behaviour in "
                "the graph: .train()/.eval() cannot change it. Optimize the original model again for the other mode, "
                "or use frontend='fx' when the model traces with it."
            )
        return super().train(mode)

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 values of the weights stored in low precision for inference (empty otherwise), by name."""
        return dict(self.graph_module.meta.get("graphopt_fp32_weights", {}))

    @property
    def state_changes(self) -> list[StateChange]:
        """The changes the passes made to stored tensors, in the order they made them."""
        return [change for report in self.graphopt_report.passes for change in report.state_changes]

    @property
    def parameter_map(self) -> dict[str, str]:
        """Each original state_dict key a pass removed or rewrote, with what became of it; other keys are unchanged."""
        mapping = key_map(self.state_changes)
        for name, value in self.graph_module.meta.get("graphopt_fp32_weights", {}).items():
            stored = f"stored in {str(get_attr(self.graph_module, name).dtype).removeprefix('torch.')} (fp32 value: fp32_weights())"
            mapping[name] = f"{mapping[name]}; {stored}" if name in mapping else stored
        return mapping

    def load_original_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a checkpoint of the original model, folding and dropping as the passes did.

        Keys are checked against the original model's: a missing or unexpected key raises
        `CheckpointError`. Tensors that forward never reads (not part of the graph) are ignored.
        """
        if self.original_keys and set(state_dict) != set(self.original_keys):
            missing, unexpected = sorted(set(self.original_keys) - set(state_dict)), sorted(set(state_dict) - set(self.original_keys))
            raise CheckpointError(
                f"this is not a state_dict of the model that was optimized: missing keys {missing[:5]}, unexpected keys "
                f"{unexpected[:5]}. Pass original_model.state_dict(); for this module's own keys use load_state_dict()."
            )
        own = self.state_dict()
        advice = "pass the state_dict of the model that was optimized, built with the same configuration"
        try:
            converted = to_optimized(state_dict, self.state_changes)
        except RuntimeError as error:  # shapes the folding math cannot combine
            raise CheckpointError(f"the checkpoint's tensors do not fit this model ({error}): {advice}") from error
        mismatched = [
            f"{key} {tuple(converted[key].shape)} instead of {tuple(value.shape)}"
            for key, value in own.items()
            if key in converted and converted[key].shape != value.shape
        ]
        if mismatched:  # checked before anything is loaded: a refused checkpoint leaves the module as it was
            raise CheckpointError(f"the checkpoint's tensors do not fit this model ({', '.join(mismatched[:3])}): {advice}")
        self.load_state_dict({key: value for key, value in converted.items() if key in own})
        fp32_weights = self.graph_module.meta.get("graphopt_fp32_weights", {})
        for name in fp32_weights.keys() & converted.keys():  # the fp32 values behind the low-precision copies just loaded
            fp32_weights[name] = converted[name].detach().clone()

    def original_state_dict(self) -> dict[str, torch.Tensor]:
        """This module's state with the original model's keys, for ``original_model.load_state_dict``.

        Exact for dropped biases (they come back as zeros, an equivalent model in train and
        eval mode); a folded BatchNorm comes back as an identity BatchNorm after the folded
        conv, equivalent in eval mode only. Weights stored in low precision come back in fp32.
        """
        state = {key: value.detach().clone() for key, value in self.state_dict().items()}
        for name, value in self.fp32_weights().items():
            if name not in state:
                continue  # a constant, not part of the state
            unchanged = torch.equal(value.to(state[name].dtype), state[name])
            state[name] = value.clone() if unchanged else state[name].to(value.dtype)
        original = to_original(state, self.state_changes)
        if not self.original_keys:
            return original
        return {key: original[key] for key in self.original_keys if key in original}

    def extra_repr(self) -> str:
        return f"mode={self.graphopt_report.mode}, frontend={self.graphopt_report.frontend}"


def _unwrap(model: nn.Module, mode: str | None) -> nn.Module:
    """The module to optimize: the one inside nn.DataParallel/DDP, or the graph of an already optimized module."""
    if isinstance(model, nn.DataParallel):
        warnings.warn(
            "graphopt optimizes the module inside nn.DataParallel and returns it unwrapped. DataParallel is slower "
            "than DistributedDataParallel even on one machine (one process scatters and gathers through GPU 0): run "
            "one process per GPU with torchrun and wrap the optimized module in "
            "torch.nn.parallel.DistributedDataParallel(module, device_ids=[local_rank]).",
            UserWarning,
            stacklevel=3,
        )
        return model.module
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    if isinstance(model, OptimizedModule):
        if model.graphopt_report.mode == "inference" and mode == "training":
            raise ModeSwitchError(
                "this module was optimized for inference (BatchNorm folded, dropout removed): it cannot be optimized "
                "for training. Optimize the original model with mode='training'."
            )
        return model.graph_module
    return model


def _updates_state(gm: fx.GraphModule) -> bool:
    """Whether running the graph writes to stored tensors (an in-place op on an attribute)."""
    for node in gm.graph.nodes:
        reads_attribute = any(arg.op == "get_attr" for arg in node.all_input_nodes)
        in_place_aten = isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
        in_place_method = node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_")
        if reads_attribute and (in_place_aten or in_place_method):
            return True
    return False


MEMORY_FORMATS = ("auto", "channels_last", "preserve")


def _resolve_mode(mode: str | None, model: nn.Module) -> Mode:
    if mode is None:
        return "training" if model.training else "inference"
    if mode not in MODES:
        raise InvalidOptionError(f"unknown mode {mode!r}: use 'inference', 'training', or None (inference when the model is in eval mode)")
    return mode  # type: ignore[return-value]


@one_at_a_time
def optimize(
    model: nn.Module,
    example_inputs: Any,
    *,
    mode: str | None = None,
    passes: Sequence[str] | None = None,
    disable: Iterable[str] = (),
    frontend: str = "auto",
    dynamic_batch: bool = True,
    verify: bool | str = True,
    memory_format: str = "auto",
    keep_channels_last_outputs: bool = False,
    precision: str = "fp32",
    low_precision_ops: Iterable[str] | None = None,
    fp32_ops: Iterable[str] | None = None,
    fuse: str | None = None,
    device: str | torch.device | None = None,
    tune: bool = False,
    accuracy: float | None = None,
    tune_budget_s: float = tuning.DEFAULT_BUDGET_S,
) -> OptimizedModule:
    """Return a faster, verified copy of ``model``; ``model`` itself is never modified.

    Args:
        model: the ``nn.Module`` to optimize.
        example_inputs: a tensor or a tuple of forward()'s positional arguments, with the
            shapes, dtypes and device the model will run on.
        mode: ``"inference"``, ``"training"``, or None: inference when ``model`` is in
            eval mode, training otherwise. The copy is put in that mode.
        passes: pass names to run, in order, instead of the mode's preset.
        disable: pass names to leave out.
        frontend: ``"fx"`` (symbolic_trace), ``"export"`` (torch.export) or ``"auto"``
            (fx, then export).
        dynamic_batch: let the captured graph accept other batch sizes (export frontend).
        verify: compare outputs with the original after every pass (dtype-aware
            tolerance); a mismatch raises `VerificationError`.
        memory_format: ``"auto"`` (channels_last only if it measures faster on the
            example inputs), ``"channels_last"`` (always, for models with 2-D/3-D convs)
            or ``"preserve"`` (keep the model's layout).
        keep_channels_last_outputs: leave 4-D outputs in channels_last instead of
            converting them back to the contiguous layout the model returned.
        precision: ``"fp32"`` (no change), ``"bf16"`` or ``"fp16"``: run conv, linear,
            matmul and attention in that dtype, sensitive ops in fp32 (opt-in: it changes
            numerics, verified with the low dtype's tolerance).
        low_precision_ops, fp32_ops: override the op families of the precision policy
            (names: see ``graphopt.passes.use_low_precision``).
        fuse: ``None`` (no fusion), ``"inductor"`` (regions of connected pointwise ops
            compiled by torch.compile), ``"torchscript"`` (the same regions scripted with
            torch.jit.script, deprecated by PyTorch) or ``"graph"`` (the whole optimized
            graph handed to torch.compile). Compiled during ``optimize``; a region whose
            backend fails stays eager, with the reason in ``report.fusion``.
        device: the device the model will run on (default: where its parameters are);
            the copy is moved there, and the example inputs must be on it. On CUDA,
            graphs with convolutions and static input shapes turn on cudnn.benchmark.
        tune: build candidate configurations (the graph with no passes; memory formats;
            each low precision ``accuracy`` admits; fusion when ``tune_budget_s`` allows),
            time them on the example inputs and return the fastest within ``accuracy``.
            Options given explicitly (``memory_format``, ``precision``, ``fuse``,
            ``passes``) are kept, not tuned. Choices are cached (see ``graphopt.tuning``).
        accuracy: with ``tune``, the largest error allowed, relative to the output's scale
            (default: the fp32 tolerance, 1e-4, so only exact candidates; 3e-2 admits bf16).
        tune_budget_s: with ``tune``, about how many seconds tuning may take.

    Returns:
        An `OptimizedModule` with ``.graphopt_report``.
    """
    check_model(model)
    model = _unwrap(model, mode)
    if prepacked_modules(model):
        raise InvalidModelError(
            f"{', '.join(prepacked_modules(model)[:3])} already run oneDNN kernels on prepacked weights (use_onednn_kernels), "
            "which cannot be captured again: optimize the original model with the options you want instead"
        )
    resolved_mode = _resolve_mode(mode, model)
    low_dtype = check_precision(precision, model)
    low_ops, kept_ops = _precision_policy(low_precision_ops, fp32_ops)
    if fuse is not None and fuse not in FUSE_BACKENDS:
        raise InvalidOptionError(f"unknown fuse {fuse!r}: use None or one of {', '.join(map(repr, FUSE_BACKENDS))}")
    infos = _select_passes(resolved_mode, passes, disable, memory_format, low_dtype, fuse)
    check_frontend(frontend)  # every option is checked before the costly steps below
    strict = _check_verify(verify)
    if tune:
        fixed = {
            name: value
            for name, value, default in (("memory_format", memory_format, "auto"), ("precision", precision, "fp32"), ("fuse", fuse, None), ("passes", passes, None))
            if value != default
        }
        common = dict(
            mode=mode, disable=disable, frontend=frontend, dynamic_batch=dynamic_batch, keep_channels_last_outputs=keep_channels_last_outputs,
            low_precision_ops=low_precision_ops, fp32_ops=fp32_ops, device=device, verify=verify,
        )  # fmt: skip
        return _tuned(model, example_inputs, common, fixed, accuracy, tune_budget_s)
    target = resolve_device(device, model, example_inputs)
    args = check_inputs(model, example_inputs, target if device is not None else None)
    training = resolved_mode == "training"

    def owned_copy() -> nn.Module:
        try:
            owned = copy.deepcopy(model)
        except Exception as error:
            raise InvalidModelError(
                f"could not copy {type(model).__name__} ({type(error).__name__}: {error}); graphopt works on a deep copy "
                "so that your model is never modified: make the model deep-copyable (copy.deepcopy)"
            ) from error
        if device is not None:
            owned.to(target)
        return owned.train(training)

    owned = owned_copy()
    # forward() runs many times below (reference, capture, checks): what it writes outside the call (globals,
    # closures) is put back; the copy's own attributes are graphopt's, and some passes change them (pad_channels)
    with preserved_user_objects(owned, module_attributes=False):
        with watch_side_effects(owned) as watch:
            example = Check(args, reference_run(owned, args, gradients=training), "the example inputs")
        others = SecondInputs(owned, args, vary_batch=dynamic_batch, gradients=training)
        captured = capture_graph(owned, example, frontend, dynamic_batch, others if verify else ())
        report = Report(
            mode=resolved_mode,
            frontend=captured.frontend,
            capture_attempts=captured.attempts,
            notes=captured.notes,
            verified=bool(verify),
            tolerance=_output_tolerance(example.expected.outputs, low_dtype),
            capture_seconds=captured.seconds,
        )
        context = PassContext(
            mode=resolved_mode,
            example_inputs=args,
            keep_channels_last_outputs=keep_channels_last_outputs,
            measure=memory_format == "auto",
            precision=low_dtype,
            low_precision_ops=low_ops,
            fp32_ops=kept_ops,
            device=target,
        )
        report.captured_nodes = snapshot(captured.graph_module.graph)
        side_effects = side_effects_message(watch.effects, type(model).__name__)
        if side_effects:
            warnings.warn(f"graphopt: {side_effects}", SideEffectWarning, stacklevel=3)
            report.warnings.append(side_effects)
        second = captured.second
        if verify:
            report.warnings += _unverifiable(example, second, others, low_dtype)
            report.second_input = second.differences if second is not None else ""
        verifier = Verifier(example, second, resolved_mode, strict, original=owned_copy) if verify else None
        recaptures = iter([captured.graph_module])

        def fresh_graph() -> fx.GraphModule:
            """The captured graph, then (a pass rolled back) the same capture of a new copy of the model."""
            graph = next(recaptures, None)
            if graph is not None:
                return graph
            return capture_graph(owned_copy(), example, captured.frontend, dynamic_batch).graph_module

        gm, report.passes, report.diffs, second_comparison = run_verified(fresh_graph, infos, context, verifier, captured.max_error)
        if second_comparison is not None:
            outputs, gradients = second_comparison
            report.second_input_error = outputs.max_error
            report.second_input_gradient_error = None if gradients is None else gradients.max_error
        report.warnings += [f"pass {p.name!r} was rolled back: it failed verification (see its entry below)" for p in report.passes if p.rolled_back]
        report.notes += filter(None, [enable_cudnn_benchmark(gm, target)])
        runner = None
        if fuse is not None:
            # compiled code is specific to the autograd mode: compile for the one forward will run in
            inference = resolved_mode == "inference" and not _updates_state(gm)
            run_context = torch.inference_mode if inference else torch.enable_grad if resolved_mode == "training" else torch.no_grad
            if fuse == "graph":
                runner, report.fusion = compile_graph(gm, args, context=run_context, dynamic_batch=dynamic_batch)
            else:
                report.fusion = compile_regions(gm, fuse, args, context=run_context, dynamic_batch=dynamic_batch)
        # the batch may vary in calls only where a second batch size was verified (or, unverified, where asked for)
        varies = second is not None and second.batch is not None if verify else dynamic_batch
        signature = InputSignature(model, args, dynamic_batch=varies, fixed_values=captured.frontend == "export")
        return OptimizedModule(gm, report, runner, original_keys=model.state_dict().keys(), signature=signature)


def _check_verify(verify: Any) -> bool:
    """Whether ``verify`` asks for strict verification; an unknown value raises `InvalidOptionError`."""
    if verify is not True and verify is not False and verify != "strict":
        raise InvalidOptionError(
            f"verify={verify!r}: use True (check every pass; roll back one that fails, with a warning), 'strict' "
            "(any mismatch raises VerificationError) or False (no checks)"
        )
    return verify == "strict"


def _unverifiable(example: Check, second: Check | None, others: SecondInputs, low_dtype: torch.dtype | None) -> list[str]:
    """What the user must know about the checks themselves: outputs too small to verify, no second input."""
    warnings_ = []
    # said once: on the example, else on the second input
    for check in filter(None, [example, second]):
        degenerate = verify_outputs.degenerate_outputs(check.expected.outputs, low_dtype)
        if degenerate:
            warnings_.append(
                f"on {check.description}, {'; '.join(degenerate)}: verification cannot tell a correct rewrite from a wrong "
                "one at that scale (the activations vanish with these weights, e.g. a random initialisation). Verify with "
                "trained weights, or example inputs that give outputs of normal magnitude."
            )
            break
    if second is None:
        refused = "; ".join(others.refused[:2])
        warnings_.append(
            "verified on the example inputs only: no second input (other batch size, values, strides) was accepted"
            + (f" ({refused})" if refused else "")
        )
    for warning in warnings_:
        warnings.warn(f"graphopt: {warning}", VerificationWarning, stacklevel=4)
    return warnings_


def _tuned(model: nn.Module, example_inputs: Any, common: dict[str, Any], fixed: dict[str, Any], accuracy: float | None, budget_s: float) -> OptimizedModule:
    """``optimize(tune=True)``: the fastest accurate candidate (see `graphopt.tuning`)."""
    if accuracy is None:
        accuracy = tolerance_for(PRECISIONS[fixed.get("precision", "fp32")] or torch.float32)
    if not (isinstance(accuracy, (int, float)) and accuracy > 0):
        raise InvalidOptionError(f"accuracy={accuracy!r}: give the largest error allowed relative to the output's scale, e.g. 1e-4 or 3e-2")
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise InvalidOptionError(f"tune_budget_s={budget_s!r}: give a number of seconds, e.g. 60")
    low_precisions = [name for name in ("bf16", "fp16") if _supported(name, model)]
    args = check_inputs(model, example_inputs)

    def build(**options: Any) -> OptimizedModule:
        return optimize(model, example_inputs, **{**common, **fixed, **options})

    resolved_mode = _resolve_mode(common["mode"], model)
    settings = {**common, "mode": resolved_mode, "budget_s": budget_s}  # a model in train mode is tuned apart from eval
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]} or {"cpu"}
    onednn = resolved_mode == "inference" and devices == {"cpu"} and torch.backends.mkldnn.is_available()
    return tuning.tune(
        build, model, args, fixed=fixed, accuracy=float(accuracy), budget_s=float(budget_s), low_precisions=low_precisions, settings=settings, onednn=onednn
    )


def _supported(precision: str, model: nn.Module) -> bool:
    """Whether ``precision`` runs on the model's device (bf16 on CPUs with bf16 kernels, fp16 on CUDA)."""
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]} or {"cpu"}
    if precision == "fp16" and devices == {"cpu"}:
        return False  # CPU fp16 kernels, where they exist, are slower than bf16: not worth a candidate
    try:
        check_precision(precision, model)
    except InvalidOptionError:
        return False
    return True


def _select_passes(
    mode: Mode, passes: Sequence[str] | None, disable: Iterable[str], memory_format: str, low_dtype: torch.dtype | None, fuse: str | None = None
) -> list[PassInfo]:
    """The passes to run: the preset (or ``passes``) shaped by the memory-format and precision options."""
    if memory_format not in MEMORY_FORMATS:
        raise InvalidOptionError(f"unknown memory_format {memory_format!r}: use one of {', '.join(map(repr, MEMORY_FORMATS))}")
    if isinstance(passes, str) or isinstance(disable, str):
        raise UnknownPassError("passes= and disable= take a list of pass names, e.g. passes=['fold_conv_bn']")
    requested = set(passes or ())
    disabled = list(disable)
    if memory_format == "preserve":
        if "to_channels_last" in requested:
            raise InvalidOptionError("passes= asks for to_channels_last but memory_format='preserve' forbids it: drop one of them")
        disabled.append("to_channels_last")
    if low_dtype is None:
        if "use_low_precision" in requested:
            raise InvalidOptionError("passes= asks for use_low_precision but precision='fp32': pass precision='bf16' or 'fp16'")
        disabled.append("use_low_precision")
    infos = resolve_passes(mode, passes, disabled)
    if passes is None and low_dtype is not None and "use_low_precision" not in disabled:
        # opt-in: lower precision after the exact rewrites, before the layout is chosen
        infos.insert(low_precision_position([info.name for info in infos]), REGISTRY["use_low_precision"])
    # in-place writes last, whatever the order asked: passes after it would not match a.add_(b) as an add; with
    # fuse= the compiler plans the buffers (and pointwise regions are made of out-of-place ops)
    in_place = [info for info in infos if info.name == "compute_in_place" and fuse is None]
    infos = [info for info in infos if info.name != "compute_in_place"] + in_place
    regions = [info for info in infos if info.name == "extract_pointwise_regions"]
    if fuse in ("inductor", "torchscript") and "extract_pointwise_regions" not in disabled:
        regions = regions or [REGISTRY["extract_pointwise_regions"]]
    # regions last: they are made of the final graph's ops, and other passes do not look inside them
    return [info for info in infos if info.name != "extract_pointwise_regions"] + regions


def _output_tolerance(expected: Any, compute_dtype: torch.dtype | None) -> float | None:
    tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(expected) if isinstance(leaf, torch.Tensor)]
    tolerances = [tolerance_for(t.dtype) for t in tensors if t.is_floating_point()]
    if compute_dtype is not None:
        tolerances = [max(t, tolerance_for(compute_dtype)) for t in tolerances]
    return min(tolerances) if tolerances else None


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, model: nn.Module) -> torch.dtype | None:
    """The low dtype for ``precision`` on the model's device, or an error naming what this device supports."""
    if precision not in PRECISIONS:
        raise InvalidOptionError(f"unknown precision {precision!r}: use one of {', '.join(map(repr, PRECISIONS))}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return None
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]} or {"cpu"}
    for device in devices:
        if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise InvalidOptionError("precision='bf16' needs a GPU with bfloat16 support (Ampere or newer): use precision='fp16'")
        if device not in ("cpu", "cuda"):
            raise InvalidOptionError(f"precision={precision!r} is supported on cpu and cuda, not {device}: use precision='fp32'")
        if device == "cpu" and not _cpu_runs(dtype):
            raise InvalidOptionError(f"this CPU has no {precision} convolution/matmul kernels: use precision='bf16' or 'fp32'")
    return dtype


def _cpu_runs(dtype: torch.dtype) -> bool:
    """Whether a small conv and matmul run in ``dtype`` on this CPU."""
    try:
        x = torch.ones(1, 2, 4, 4, dtype=dtype)
        torch.nn.functional.conv2d(x, torch.ones(2, 2, 1, 1, dtype=dtype))
        torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
    except RuntimeError:
        return False
    return True


def _precision_policy(low_precision_ops: Iterable[str] | None, fp32_ops: Iterable[str] | None) -> tuple[frozenset[str], frozenset[str]]:
    low = DEFAULT_LOW_PRECISION_OPS if low_precision_ops is None else frozenset(low_precision_ops)
    kept = DEFAULT_FP32_OPS if fp32_ops is None else frozenset(fp32_ops)
    unknown = sorted((low | kept) - set(PRECISION_FAMILY_NAMES))
    if unknown:
        raise InvalidOptionError(f"unknown op families {unknown} in low_precision_ops/fp32_ops: use names from {', '.join(PRECISION_FAMILY_NAMES)}")
    if low & kept:
        raise InvalidOptionError(f"op families {sorted(low & kept)} are in both low_precision_ops and fp32_ops: choose one")
    return low, kept

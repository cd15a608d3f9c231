"""``graphopt.optimize``: options -> capture -> verified passes -> backends -> the `OptimizedModule` handed back.

The user's model is deep-copied once, at entry, and never touched again. The returned
`OptimizedModule` shares the optimized graph's parameters and submodules directly (no
wrapper prefix), so ``state_dict()`` keys are the model's own where a parameter still
exists, and ``.to()``, ``.parameters()`` and hooks behave as on any module.
"""

from __future__ import annotations

import contextvars
import copy
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt import dynamic, progress, tuning
from graphopt.backends import DEFAULT_ENGINE, ENGINES, EngineInfo, EngineInput, EngineRunner, engine_info
from graphopt.backends.fuse_compile import FUSE_BACKENDS, compile_graph, compile_regions
from graphopt.capture import Captured, capture_graph, check_frontend, one_at_a_time
from graphopt.device import device_types, enable_cudnn_benchmark, resolve_device
from graphopt.diff import NodeInfo, snapshot
from graphopt.errors import InvalidModelError, InvalidOptionError, ModeSwitchError, SideEffectWarning, VerificationError, VerificationWarning
from graphopt.inputs import InputSignature, argument_names, copied_inputs, unread_arguments
from graphopt.passes import MODES, REGISTRY, Mode, PassContext
from graphopt.pipeline import Verifier, engine_left_out, run_verified, select_passes
from graphopt.precision import INT8, PRECISIONS, calibration_batches, check_int8, check_precision, emulated_on_cpu, precision_policy, runs_on
from graphopt.progress import shown as show_progress
from graphopt.runtime import OptimizedModule, int8_modules, prepacked_modules, updates_state
from graphopt.runtime.portable import to_aten
from graphopt.report import EngineReport, Report
from graphopt.side_effects import preserved_user_objects, side_effects_message, watch_side_effects
from graphopt.validate import SecondInputs, check_inputs, check_model, positional_inputs, reference_run, with_values_of
from graphopt import verify as verify_outputs
from graphopt.verify import Check, tolerance_for


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
        if mode is not None:  # a graph that fixed the other mode would go on computing in it
            model.check_mode_switch(mode == "training")
        # oneDNN kernels with prepacked weights cannot be captured: ATen's ops, which they compute, can
        return to_aten(model.graph_module) if prepacked_modules(model.graph_module) else model.graph_module
    return model


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
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    mode: str | None = None,
    passes: Sequence[str] | None = None,
    disable: Iterable[str] = (),
    frontend: str = "auto",
    dynamic_shapes: Any = dynamic.DEFAULT,
    dynamic_batch: bool = True,
    verify: bool | str = True,
    memory_format: str = "auto",
    keep_channels_last_outputs: bool = False,
    precision: str = "fp32",
    low_precision_ops: Iterable[str] | None = None,
    fp32_ops: Iterable[str] | None = None,
    calibration: Iterable[Any] | None = None,
    fuse: str | None = None,
    engine: str = DEFAULT_ENGINE,
    device: str | torch.device | None = None,
    tune: bool = False,
    accuracy: float | None = None,
    tune_budget_s: float = tuning.DEFAULT_BUDGET_S,
    remeasure: bool = False,
    progress: bool | None = None,
) -> OptimizedModule:
    """Return a faster, verified copy of ``model``; ``model`` itself is never modified.

    Args:
        model: the ``nn.Module`` to optimize.
        example_inputs: a tensor, a tuple of forward()'s positional arguments or a dict of
            its keyword arguments (``model(**batch)``), with the shapes, dtypes and device the
            model will run on.
        example_kwargs: keyword arguments of forward() beside ``example_inputs`` (as in
            ``torch.export.export(model, args, kwargs)``). Keyword inputs take their places in
            forward()'s signature; parameters skipped before them take their defaults (e.g.
            ``None``). The optimized module accepts the same calls, by position or by name.
        mode: ``"inference"``, ``"training"``, or None: inference when ``model`` is in
            eval mode, training otherwise. The copy is put in that mode.
        passes: pass names to run, in order, instead of the mode's preset.
        disable: pass names to leave out.
        frontend: ``"fx"`` (symbolic_trace), ``"export"`` (torch.export) or ``"auto"``
            (fx, then export).
        dynamic_shapes: the input dimensions the optimized module may be called with other
            sizes of, in torch.export's vocabulary: ``"batch+sequence"`` (default: the batch
            dimension, and the sequence dimensions of token inputs such as ``input_ids`` and
            ``attention_mask``), ``"batch"``, ``"auto"`` (every dimension the model allows),
            None (every size fixed) or a torch.export spec by parameter name or position, e.g.
            ``{"input_ids": {1: torch.export.Dim("seq", max=512)}}``. A dimension varies only
            where the captured graph keeps it dynamic and verification ran at a second size of it
            (see ``graphopt.dynamic``).
        dynamic_batch: False is ``dynamic_shapes=None`` (kept for older code).
        verify: compare outputs with the original after every pass (dtype-aware
            tolerance); a mismatch raises `VerificationError`.
        memory_format: ``"auto"`` (channels_last only if it measures faster on the
            example inputs; for CPU inference, oneDNN's fused kernels with prepacked weights
            (`use_onednn_kernels`) are tried next and kept only if they measure faster too),
            ``"channels_last"`` (always, for models with 2-D/3-D convs) or ``"preserve"``
            (keep the model's layout); with these two the oneDNN kernels are opt-in
            (``passes=``).
        keep_channels_last_outputs: leave 4-D outputs in channels_last instead of
            converting them back to the contiguous layout the model returned.
        precision: ``"fp32"`` (no change), ``"bf16"`` or ``"fp16"``: run conv, linear,
            matmul and attention in that dtype, sensitive ops in fp32 (opt-in: it changes
            numerics, verified with the low dtype's tolerance). ``"int8"`` (CPU inference,
            with ``calibration``): convs and linears on oneDNN's int8 kernels, each layer
            whose error would exceed ``accuracy`` kept in float32 (see `graphopt.passes.quantize_int8`);
            where none stays in int8 (over the budget, or not faster), a warning says so and the
            result is the default float32 call's.
        low_precision_ops, fp32_ops: override the op families of the precision policy
            (names: see ``graphopt.passes.use_low_precision``).
        calibration: with ``precision="int8"``, the batches each layer's input range is
            measured on: an iterable of batches shaped like ``example_inputs`` (a DataLoader
            of ``(inputs, labels)`` works: the first items of each batch are used). With
            ``tune=True``, int8 calibrated on them becomes one of the candidates.
        fuse: ``None`` (no fusion), ``"inductor"`` (regions of connected pointwise ops
            compiled by torch.compile), ``"torchscript"`` (the same regions scripted with
            torch.jit.script, deprecated by PyTorch) or ``"graph"`` (the whole optimized
            graph handed to torch.compile). Compiled during ``optimize``; a region whose
            backend fails stays eager, with the reason in ``report.fusion``.
        engine: the runtime the optimized graph runs on (``graphopt.backends.ENGINES``):
            ``"pytorch"`` (default: graphopt's own passes and kernels, any mode and device),
            ``"openvino"``, ``"onnxruntime"`` or ``"inductor"`` (inference; the graph after
            the portable passes, handed to that runtime, which chooses layouts and kernels
            itself; ``precision`` is the runtime's: see ``graphopt engines``). The engine's
            outputs are verified against the original model on the example and on the second
            input; ``report.engine`` says how. A runtime that is not installed raises
            `EngineError` naming the extra to install.
        device: the device the model will run on (default: where its parameters are);
            the copy is moved there, and the example inputs must be on it. On CUDA,
            graphs with convolutions and static input shapes turn on cudnn.benchmark.
        tune: build candidate configurations (the graph with no passes; memory formats;
            each low precision ``accuracy`` admits; int8 with ``calibration``; fusion when
            ``tune_budget_s`` allows),
            time them on the example inputs and return the fastest within ``accuracy``.
            Options given explicitly (``memory_format``, ``precision``, ``fuse``,
            ``passes``) are kept, not tuned. Choices are cached (see ``graphopt.tuning``); a cached
            choice is verified on this model and tuned again if over ``accuracy``. Not with
            ``verify=False`` (a candidate's error must be measured).
        accuracy: with ``tune``, the largest error allowed, relative to the output's scale
            (default: the fp32 tolerance, 1e-4, so only exact candidates; 3e-2 admits bf16).
            With ``precision="int8"``, the output error budget (default 5e-2), measured on the
            example inputs and verified on them and on a second input.
        tune_budget_s: with ``tune``, about how many seconds tuning may take.
        remeasure: time the measured passes again instead of reusing a clear decision this
            machine took before for the same graph and inputs (also ``GRAPHOPT_REMEASURE=1``;
            see ``graphopt.timing``).
        progress: show a status line on stderr while capturing, running the passes,
            tuning and compiling: None (default) on a terminal only, True always, False never.

    Returns:
        An `OptimizedModule` with ``.graphopt_report``.
    """
    if progress is not None and not isinstance(progress, bool):
        raise InvalidOptionError(f"progress={progress!r}: use True (always), False (never) or None (on a terminal only)")
    with show_progress(progress):
        check_model(model)
        if mode is None and isinstance(model, OptimizedModule):
            mode = model.graphopt_report.mode  # its graph module's training flag may not say (torch.export's does not)
        model = _unwrap(model, mode)
        if example_kwargs is not None:
            example_inputs = positional_inputs(model, example_inputs, example_kwargs)  # forward()'s positional arguments from here on
        if int8_modules(model):
            raise InvalidModelError(
                f"{', '.join(int8_modules(model)[:3])} already run oneDNN's int8 kernels, which cannot be captured again: "
                "optimize the original model with the options you want instead"
            )
        if prepacked_modules(model):
            raise InvalidModelError(
                f"{', '.join(prepacked_modules(model)[:3])} already run oneDNN kernels on prepacked weights, "
                "which cannot be captured again: optimize the original model with the options you want instead"
            )
        resolved_mode = _resolve_mode(mode, model)
        info = engine_info(engine)
        _check_engine(info, resolved_mode, precision, memory_format, fuse, passes)
        int8 = precision == INT8
        int8_accuracy = None  # the output error budget of precision="int8"
        if int8:
            if tune:
                raise InvalidOptionError("tune=True chooses the precision itself: leave precision out, and calibration= makes int8 one of its candidates")
            int8_accuracy = check_int8(model, resolved_mode, memory_format, fuse, accuracy, device)
        elif calibration is not None and not tune:
            raise InvalidOptionError("calibration= is for precision='int8' (or tune=True, which then tries int8): pass one of them, or leave calibration out")
        if accuracy is not None and not (tune or int8):  # it would be silently ignored
            raise InvalidOptionError(
                f"accuracy={accuracy!r} applies with tune=True (the largest error a candidate may have) or precision='int8' "
                "(the output error budget of the int8 layers): pass one of them, or leave accuracy out"
            )
        if tune and verify is False:  # tune keeps a candidate only if its error, measured by verification, is within accuracy
            raise InvalidOptionError(
                "tune=True returns the fastest candidate within accuracy, which it knows from each candidate's verified error: "
                "verify=False would leave every error unmeasured. Leave verify out (or use verify='strict'), "
                "or optimize without tune=True, passing the options you want"
            )
        low_dtype = None if int8 else check_precision(precision, model)
        graph_dtype = low_dtype if info.own_passes else None  # another engine computes in the low precision itself
        low_ops, kept_ops = precision_policy(low_precision_ops, fp32_ops)
        if fuse is not None and fuse not in FUSE_BACKENDS:
            raise InvalidOptionError(f"unknown fuse {fuse!r}: use None or one of {', '.join(map(repr, FUSE_BACKENDS))}")
        if memory_format not in MEMORY_FORMATS:
            raise InvalidOptionError(f"unknown memory_format {memory_format!r}: use one of {', '.join(map(repr, MEMORY_FORMATS))}")
        # int8 runs the oneDNN kernels it quantizes, unmeasured; another engine gets the portable passes only
        measure = memory_format == "auto" and not int8 and info.own_passes
        infos = select_passes(
            resolved_mode,
            passes,
            disable,
            preserve_layout=memory_format == "preserve" or not info.own_passes,
            low_precision=graph_dtype is not None,
            fuse=fuse,
            measure=measure,
            int8=int8 and info.own_passes,  # another engine quantizes itself
            portable=not info.own_passes,
        )
        check_frontend(frontend)  # every option is checked before the costly steps below
        dynamic_shapes = dynamic.resolve(dynamic_shapes, dynamic_batch)
        strict = _check_verify(verify)
        common = dict(
            mode=mode, disable=disable, frontend=frontend, dynamic_shapes=dynamic_shapes, keep_channels_last_outputs=keep_channels_last_outputs,
            low_precision_ops=low_precision_ops, fp32_ops=fp32_ops, device=device, verify=verify, remeasure=remeasure,
        )  # fmt: skip
        if tune:
            fixed = {
                name: value
                for name, value, default in (
                    ("memory_format", memory_format, "auto"), ("precision", precision, "fp32"), ("fuse", fuse, None), ("passes", passes, None), ("engine", engine, DEFAULT_ENGINE)
                )  # fmt: skip
                if value != default
            }
            return _tuned(model, example_inputs, common, fixed, accuracy, tune_budget_s, calibration)
        target = resolve_device(device, model, example_inputs)
        # every run below (references, capture checks, verification, measurements) is on this copy: never on the caller's tensors
        args = copied_inputs(check_inputs(model, example_inputs, target if device is not None else None))
        request = dynamic.request(dynamic_shapes, args, argument_names(model, len(args)))
        batches = calibration_batches(calibration, lambda batch: check_inputs(model, batch, target if device is not None else None), args, request.dims) if int8 else ()
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

            def capture() -> tuple[Check, SecondInputs, Captured, str, Collection[str], list[NodeInfo]]:
                with watch_side_effects(owned) as watch:
                    example = Check(args, reference_run(owned, args, gradients=training), "the example inputs")
                others = SecondInputs(owned, args, request.dims, gradients=training)
                captured = capture_graph(owned, example, frontend, request, others if verify else None)
                # read before the passes, which may leave an argument unread where any value computes the same (a removed dropout's p)
                fixed_arguments = unread_arguments(captured.graph_module, args, request.names) if captured.frontend == "fx" else ()
                effects = side_effects_message(watch.effects, type(model).__name__)
                return example, others, captured, effects, fixed_arguments, snapshot(captured.graph_module.graph)

            # the captured graph's nodes are read now: an engine candidate sharing this capture gets it after the passes
            example, others, captured, side_effects, fixed_arguments, captured_nodes = _shared_by_engines("capture", capture, info)
            kept = captured.dims
            report = Report(
                mode=resolved_mode,
                frontend=captured.frontend,
                capture_attempts=captured.attempts,
                notes=captured.notes,
                verified=bool(verify),
                tolerance=int8_accuracy or _output_tolerance(example.expected.outputs, low_dtype),
                capture_seconds=captured.seconds,
            )
            context = PassContext(
                mode=resolved_mode,
                example_inputs=args,
                keep_channels_last_outputs=keep_channels_last_outputs,
                measure=measure,
                precision=graph_dtype,
                low_precision_ops=low_ops,
                fp32_ops=kept_ops,
                device=target,
                calibration=batches,
                accuracy=int8_accuracy,
                remeasure=remeasure,
            )
            report.captured_nodes = captured_nodes
            if side_effects:
                warnings.warn(f"graphopt: {side_effects}", SideEffectWarning, stacklevel=3)
                report.warnings.append(side_effects)
            second = captured.second
            if int8 and second is not None:  # resampled example values say nothing of a calibrated model: real ones do
                second = with_values_of(second, batches[-1], owned) or second
            if verify:
                report.warnings += _unverifiable(example, second, others, low_dtype)
                report.second_input = second.differences if second is not None else ""
            verifier = Verifier(example, second, resolved_mode, strict, original=owned_copy, int8_accuracy=int8_accuracy) if verify else None
            recaptures = iter([captured.graph_module])

            def fresh_graph() -> fx.GraphModule:
                """The captured graph, then (a pass rolled back) the same capture of a new copy of the model."""
                graph = next(recaptures, None)
                if graph is not None:
                    return graph
                return capture_graph(owned_copy(), example, captured.frontend, request).graph_module

            gm, passes_run, diffs, second_comparison = _shared_by_engines("passes", lambda: run_verified(fresh_graph, infos, context, verifier, captured.max_error), info)
            report.passes, report.diffs = list(passes_run), dict(diffs)
            if second_comparison is not None:
                outputs, gradients = second_comparison
                report.second_input_error = outputs.max_error
                report.second_input_gradient_error = None if gradients is None else gradients.max_error
            report.warnings += [f"pass {p.name!r} was rolled back: it failed verification (see its entry below)" for p in report.passes if p.rolled_back]
            report.notes += filter(None, [enable_cudnn_benchmark(gm, target)])
            # sizes may vary in calls only where a second size was verified (or, unverified, where the graph keeps them dynamic)
            free = kept
            if verify:
                free = dynamic.varied(args, second.args) if second is not None else tuple(frozenset() for _ in kept)
            report.dynamic = dynamic.describe(free, request.names)
            report.notes += filter(None, [_unverified_dims(kept, free, request.names, others)])
            runner = None
            if fuse is not None:
                # compiled code is specific to the autograd mode: compile for the one forward will run in
                inference = resolved_mode == "inference" and not updates_state(gm)
                run_context = torch.inference_mode if inference else torch.enable_grad if resolved_mode == "training" else torch.no_grad
                if fuse == "graph":
                    runner, report.fusion = compile_graph(gm, args, context=run_context, dynamic=free)
                else:
                    report.fusion = compile_regions(gm, fuse, args, context=run_context, dynamic_batch=any(0 in dims for dims in free))
            # an engine's program fixes arguments without tensors at the example's values, as torch.export does
            signature = InputSignature(model, args, free, fixed_values=captured.frontend == "export" or not info.own_passes, fixed_arguments=fixed_arguments)
            if not info.own_passes:
                checks = [check for check in (example, second) if check is not None] if verify else []
                conversions = _shared_by_engines("conversions", dict, info)
                int8_budget = (batches, int8_accuracy) if int8 else None
                runner, report.engine = _on_engine(info, gm, args, free, precision, torch.int8 if int8 else low_dtype, checks, conversions, verifier, int8_budget)
                if int8 and runner.int8_fell_back:
                    message = (
                        f"precision='int8': no conv or linear stayed in int8 within accuracy={int8_accuracy:g} on engine={info.name!r}, "
                        f"so this is its float32 result; the engine's notes say why each layer is not in int8"
                    )
                    warnings.warn(f"graphopt: {message}", UserWarning, stacklevel=3)
                    report.warnings.append(message)
            if verifier is not None and low_dtype is not None and (example.description, low_dtype) in verifier.autocast:
                report.tolerance = verifier.low_precision_tolerances(example, low_dtype)[0]  # what the precision was held to
                report.notes += _autocast_notes(verifier)
            optimized = OptimizedModule(gm, report, runner, original_keys=model.state_dict().keys(), signature=signature)
        if int8 and info.own_passes and passes is None and not int8_modules(optimized):
            return _float_instead_of_int8(model, example_inputs, dict(common, memory_format=memory_format), report)
        return optimized


# Within one tune=True call, every engine candidate (each engine other than PyTorch, in each precision) is built
# from the same graph: the same capture, the same portable passes. `_tuned` sets this to a dict, and the first
# engine candidate's capture, passes and conversions (`EngineInput.reused`) serve the others.
_ENGINE_GRAPH: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("graphopt_engine_graph", default=None)


def _shared_by_engines(step: str, make: Callable[[], Any], info: EngineInfo) -> Any:
    """``make()``; within `_tuned`, for an engine other than PyTorch, what the first engine candidate made at ``step``."""
    shared = _ENGINE_GRAPH.get()
    if shared is None or info.own_passes:
        return make()
    if step not in shared:
        shared[step] = make()
    return shared[step]


def _check_engine(info: EngineInfo, mode: Mode, precision: str, memory_format: str, fuse: str | None, passes: Sequence[str] | None) -> None:
    """Refuse, before anything costly, what engine ``info`` cannot do; the PyTorch engine takes every option."""
    if info.own_passes:
        return
    info.check_installed()
    name = info.name
    if mode == "training":
        raise InvalidOptionError(
            f"engine={name!r} serves inference only: its compiled graph has no autograd. Train with engine='pytorch' (the default), "
            f"and optimize the trained model with mode='inference', engine={name!r} to serve it"
        )
    if precision not in info.precisions:
        raise InvalidOptionError(f"engine={name!r} computes in {', '.join(map(repr, info.precisions))}, not precision={precision!r}: choose one of those, or engine='pytorch'")
    if fuse is not None:
        raise InvalidOptionError(f"engine={name!r} compiles the whole graph itself: leave fuse= out (it is for engine='pytorch')")
    if memory_format == "channels_last":
        raise InvalidOptionError(f"engine={name!r} chooses its own memory layouts: leave memory_format= out (it is for engine='pytorch')")
    pytorch_only = [pass_name for pass_name in passes or () if pass_name in engine_left_out()]
    if pytorch_only:
        raise InvalidOptionError(
            f"passes= asks for {', '.join(pytorch_only)}, whose result only PyTorch runs: engine={name!r} gets the portable passes, leave them out"
        )


def _on_engine(
    info: EngineInfo,
    gm: fx.GraphModule,
    args: tuple[Any, ...],
    free: dynamic.Dims,
    precision: str,
    compute_dtype: torch.dtype | None,
    checks: list[Check],
    conversions: dict[str, Any],
    verifier: Verifier | None,
    int8_budget: tuple[tuple[tuple[Any, ...], ...], float] | None = None,
) -> tuple[EngineRunner, EngineReport]:
    """The runner engine ``info`` builds from the optimized graph, verified on ``checks`` like a pass (else `VerificationError`).

    ``conversions``: what the engines made from this same graph before (`EngineInput.reused`). The runner is
    held to what a graph computing in ``compute_dtype`` is held to (`Verifier.output_tolerance`): in bf16/fp16
    torch.autocast's own error, in int8 (``int8_budget``: the calibration batches and the budget) the budget."""
    info.check_graph(gm, copied_inputs(args))
    started = time.perf_counter()
    calibration, accuracy = int8_budget or ((), None)
    for _ in progress.steps([info.name], "engine"):  # a status line while it builds (compilers take minutes on large models)
        runner = info.make(EngineInput(gm, copied_inputs(args), free, precision, conversions, calibration, accuracy))
    report = EngineReport(info.name, precision, build_seconds=time.perf_counter() - started, notes=list(runner.notes))
    errors = []
    for check in checks:
        with torch.inference_mode():
            actual = runner(*copied_inputs(check.args))
        tolerance = verifier.output_tolerance(check, compute_dtype) if verifier is not None else None
        comparison = verify_outputs.compare(check.expected.outputs, actual, compute_dtype, tolerance)
        if not comparison.ok:
            size = "" if comparison.max_error == float("inf") else f" by {comparison.max_error:.3e} relative to the output's scale (tolerance {comparison.tolerance:.0e})"
            reason = f"engine={info.name!r} ({precision}) computes {comparison.where} differently from the original model on {check.description}{size}: {comparison.detail}."
            raise VerificationError(
                f"{reason} Your model is unchanged; use engine='pytorch' (the default) or another engine, and please report the model.",
                max_error=comparison.max_error,
                reason=reason,
            )
        errors.append(comparison.max_error)
    report.max_error = errors[0] if errors else None
    report.second_input_error = errors[1] if len(errors) > 1 else None
    return runner, report


def _autocast_notes(verifier: Verifier) -> list[str]:
    """How the low precision was judged: torch.autocast's own errors in it, and the multiple a graph may reach."""
    notes = []
    for (description, dtype), (outputs, gradients) in verifier.autocast.items():
        name = str(dtype).removeprefix("torch.")
        own = f"{outputs:.1e} of the output's scale" + (f", gradients {gradients:.1e}" if gradients is not None else "")
        notes.append(
            f"{name} judged against torch.autocast({name}) on {description}: autocast's own error {own}; "
            f"accepted up to {verify_outputs.AUTOCAST_FACTOR:g}x that, and at least one {name} rounding ({verify_outputs.low_precision_floor(dtype):.1e})"
        )
    return notes


def _float_instead_of_int8(model: nn.Module, example_inputs: Any, options: dict[str, Any], attempt: Report) -> OptimizedModule:
    """The default float32 call's result, for ``precision="int8"`` where no layer stayed in int8.

    The int8 pipeline leaves its layers on oneDNN's float32 kernels, chosen without timing (int8 needs them);
    the default call keeps them only where they time faster. The int8 attempt's quantizing pass entry goes
    into the report, so that ``report.why(layer)`` still says why the layer is not in int8.
    """
    quantize = next((p for p in attempt.passes if REGISTRY[p.name].quantizes), None)
    reason = quantize.notes[0] if quantize is not None and quantize.notes else "the quantizing pass did not run"
    message = (
        f"precision='int8': no conv or linear stayed in int8 ({reason}), so this is the default "
        "float32 call's result (precision='fp32'); report.why(<layer>) says why each layer is not in int8"
    )
    warnings.warn(f"graphopt: {message}", UserWarning, stacklevel=4)
    optimized = optimize(model, example_inputs, **options)
    report = optimized.graphopt_report
    report.notes.insert(0, message)
    report.warnings.append(message)
    if quantize is not None:
        report.passes.append(quantize)
    return optimized


def _check_verify(verify: Any) -> bool:
    """Whether ``verify`` asks for strict verification; an unknown value raises `InvalidOptionError`."""
    if verify is not True and verify is not False and verify != "strict":
        raise InvalidOptionError(
            f"verify={verify!r}: use True (check every pass; roll back one that fails, with a warning), 'strict' "
            "(any mismatch raises VerificationError) or False (no checks)"
        )
    return verify == "strict"


def _unverified_dims(kept: dynamic.Dims, free: dynamic.Dims, names: Sequence[str], others: SecondInputs) -> str:
    """Why dimensions the graph could vary stay fixed: no second size of them was verified ('' when none)."""
    fixed = tuple(mine - verified for mine, verified in zip(kept, free, strict=True))
    if not any(fixed):
        return ""
    refused = f" (the model refused one: {others.refused[0]})" if others.refused else ""
    return f"{dynamic.describe(fixed, names)} kept at the example's size: no second size could be verified{refused}"


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


def _tuned(
    model: nn.Module, example_inputs: Any, common: dict[str, Any], fixed: dict[str, Any], accuracy: float | None, budget_s: float, calibration: Iterable[Any] | None
) -> OptimizedModule:
    """``optimize(tune=True)``: the fastest accurate candidate (see `graphopt.tuning`); with ``calibration``, int8 is one."""
    if accuracy is None:
        accuracy = tolerance_for(PRECISIONS[fixed.get("precision", "fp32")] or torch.float32)
    if not (isinstance(accuracy, (int, float)) and accuracy > 0):
        raise InvalidOptionError(f"accuracy={accuracy!r}: give the largest error allowed relative to the output's scale, e.g. 1e-4 or 3e-2")
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise InvalidOptionError(f"tune_budget_s={budget_s!r}: give a number of seconds, e.g. 60")
    low_precisions = [name for name in ("bf16", "fp16") if runs_on(name, model)]
    emulated = {name: reason for name in low_precisions if (reason := emulated_on_cpu(name, model))}
    args = copied_inputs(check_inputs(model, example_inputs))  # the candidates are timed on it, not on the caller's tensors
    batches = None if calibration is None else list(calibration)  # iterated once: each int8 build reads the same batches

    def build(**options: Any) -> OptimizedModule:
        int8 = {"calibration": batches} if options.get("precision") == INT8 else {}
        return optimize(model, example_inputs, **{**common, **fixed, **options, **int8})

    resolved_mode = _resolve_mode(common["mode"], model)
    settings = {**common, "mode": resolved_mode, "budget_s": budget_s}  # a model in train mode is tuned apart from eval
    if batches is not None:
        settings["calibration"] = f"{len(batches)} batches"
    onednn = resolved_mode == "inference" and device_types(model) == {"cpu"} and torch.backends.mkldnn.is_available()
    shared = _ENGINE_GRAPH.set({})
    try:
        return tuning.tune(
            build,
            model,
            args,
            fixed=fixed,
            accuracy=float(accuracy),
            budget_s=float(budget_s),
            low_precisions=low_precisions,
            settings=settings,
            onednn=onednn,
            emulated=emulated,
            int8=batches is not None,
            # the engines other than PyTorch serve CPU inference
            engines=[info for info in ENGINES.values() if not info.own_passes] if resolved_mode == "inference" and device_types(model) == {"cpu"} else [],
        )
    finally:
        _ENGINE_GRAPH.reset(shared)


def _output_tolerance(expected: Any, compute_dtype: torch.dtype | None) -> float | None:
    tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(expected) if isinstance(leaf, torch.Tensor)]
    tolerances = [tolerance_for(t.dtype) for t in tensors if t.is_floating_point()]
    if compute_dtype is not None:
        tolerances = [max(t, tolerance_for(compute_dtype)) for t in tolerances]
    return min(tolerances) if tolerances else None

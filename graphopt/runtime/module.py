"""`OptimizedModule`: what `graphopt.optimize` hands back, and how it behaves at run time.

It owns the run-time side of an optimized model: the input guard (`InputSignature`),
the autograd mode forward runs in (``torch.inference_mode`` unless the graph writes
stored state), refusing mode switches and dtype casts that would compute wrongly, and checkpoints in the
original model's keys (`graphopt.checkpoint`). It shares the graph's parameters and
submodules directly, so ``state_dict()`` keys are the model's own.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.checkpoint import StateChange, key_map, to_optimized, to_original
from graphopt.errors import CheckpointError, InputMismatchError, InvalidOptionError, ModeSwitchError
from graphopt.inputs import InputSignature
from graphopt.ops import get_attr, writes_in_place
from graphopt.report import Report


def updates_state(gm: fx.GraphModule) -> bool:
    """Whether running the graph writes to stored tensors (an in-place op on an input read from an attribute)."""
    return any(writes_in_place(gm, node) and any(arg.op == "get_attr" for arg in node.all_input_nodes) for node in gm.graph.nodes)


def _training_flag(module: nn.Module, path: str) -> bool | None:
    """The train/eval flag of ``module``'s submodule at ``path`` (``""``: ``module`` itself); None where there is none."""
    try:
        return module.get_submodule(path).training
    except AttributeError:  # a container fx did not copy, or a module a pass removed: nothing a user can switch
        return None


def _module_names(paths: list[str]) -> str:
    names = [repr(path) if path else "the model itself" for path in paths]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _fixed_modes_advice(paths: list[str], training: bool) -> str:
    """Why the train/eval flags at ``paths`` (traced with ``training``) cannot change, and what to do instead."""
    mode = "train" if training else "eval"
    return (
        f"forward() reads the train/eval flag (self.training) of {_module_names(paths)}, e.g. "
        f"F.dropout(x, training=self.training) or `(out, aux) if self.training else out`, and symbolic_trace fixed its "
        f"{mode}-mode value in the graph, so this module keeps computing in {mode} mode. For the other mode, load this "
        "module's weights into the original model (model.load_state_dict(module.original_state_dict())) and run it or "
        "optimize it with that mode (mode='inference' to evaluate); or make the model use nn.Dropout modules, which "
        "follow .train()/.eval()."
    )


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
      train/eval behaviour fixed, so switching its mode raises too. So does switching a
      module whose forward() reads ``self.training``, which symbolic_trace fixes in the
      graph (``graph_module.meta["graphopt_fixed_modes"]``): ``.train()/.eval()`` of the
      whole module raises, and a call after ``module.<submodule>.eval()`` does.
    - ``.double()``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.to(dtype)`` and ``.type()`` raise
      `ModeSwitchError` where they would change a stored tensor's dtype (the graph was optimized
      and verified in its dtypes); ``.to(device)`` and casts that change nothing work as on any module.
    - ``engine=`` other than PyTorch (``graphopt_report.engine``): forward runs the engine's compiled
      model (``runner``), which holds its own copy of the weights; ``graph_module`` stays the verified graph it
      was built from, for inspection and saving. Loading weights, ``.to(another device)`` and ``.train()``
      raise `ModeSwitchError` (the engine would go on computing with the old ones): optimize again.
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
        runner: nn.Module | None = None,
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
        self.inference_mode = report.mode == "inference" and not updates_state(graph_module)
        self.original_keys = tuple(original_keys)  # the original model's state_dict keys, in its order
        self.input_signature = signature  # the calls the graph accepts (None: not checked)
        self.generator: Any = None  # a causal language model's generate() (graphopt.generation.Generator), else None

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def code(self) -> str:
        return self.graph_module.code

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_fixed_modes()
        if self.input_signature is not None:
            args = self.input_signature.bind(args, kwargs)
            self.input_signature.check(args)
            kwargs = {}
        try:
            guards = self.graph_module._modules.get("_guards_fn")
            if guards is not None and self._runner is not self.graph_module:
                # the limits torch.export found in the model's code (a maximum sequence length), which the graph checks
                # when it runs: checked here for a runner with its own program (an engine), which may not
                guards(*pytree.tree_leaves(args))
            if self.graphopt_report.mode == "training":
                return self._runner(*args, **kwargs)
            with torch.inference_mode() if self.inference_mode else torch.no_grad():
                return self._runner(*args, **kwargs)
        except AssertionError as error:
            if not str(error).startswith("Guard failed"):
                raise
            raise InputMismatchError(
                f"this call is outside the sizes the captured graph allows ({str(error).removeprefix('Guard failed: ')}): torch.export "
                "found that the model's code limits them (e.g. a maximum sequence length). Call it with sizes in that range."
            ) from error

    def generate(self, input_ids: Any = None, attention_mask: Any = None, **options: Any) -> Any:
        """Token ids, prompt included, as the original model's ``generate()`` returns them: for a causal language model
        optimized with its key/value cache on (see `graphopt.generation`, whose ``OPTIONS`` lists what it takes)."""
        if self.generator is None:
            raise InvalidOptionError(
                "generate() is for a causal language model optimized with its key/value cache on (config.use_cache = True); "
                "this module computes its model's forward: call it instead"
            )
        return self.generator.generate(input_ids, attention_mask, **options)

    def train(self, mode: bool = True) -> OptimizedModule:
        self.check_mode_switch(mode)
        return super().train(mode)

    # Casts of the stored tensors: the graph's kernels, constants and verification are for the dtypes it was
    # optimized in, so a cast would break later calls (or compute unverified). A move to another device, and a
    # cast to the dtypes the module already has, go through.
    @property
    def runner(self) -> nn.Module:
        """What forward calls: the graph module, its torch.compile'd form (``fuse="graph"``) or an engine's runner."""
        return self._runner

    def to(self, *args: Any, **kwargs: Any) -> OptimizedModule:
        device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]  # how nn.Module.to reads its arguments
        if device is not None and any(t.device != device for t in [*self.parameters(), *self.buffers()]):
            self._check_engine_weights(f".to({device})")
        if dtype is not None and (dtype.is_floating_point or dtype.is_complex):  # others: nn.Module.to says it takes none
            self._check_cast(dtype, f".to({str(dtype)})", complex_too=True)
        return super().to(*args, **kwargs)

    def double(self) -> OptimizedModule:
        self._check_cast(torch.float64, ".double()")
        return super().double()

    def float(self) -> OptimizedModule:
        self._check_cast(torch.float32, ".float()")
        return super().float()

    def half(self) -> OptimizedModule:
        self._check_cast(torch.float16, ".half()")
        return super().half()

    def bfloat16(self) -> OptimizedModule:
        self._check_cast(torch.bfloat16, ".bfloat16()")
        return super().bfloat16()

    def type(self, dst_type: torch.dtype | str) -> OptimizedModule:
        self._check_cast(torch.empty(0).type(dst_type).dtype, f".type({dst_type})", every_tensor=True)
        return super().type(dst_type)

    def _check_cast(self, dtype: torch.dtype, call: str, complex_too: bool = False, every_tensor: bool = False) -> None:
        """Raise `ModeSwitchError` where ``call`` would cast a parameter or buffer to ``dtype`` (floating-point ones, as
        nn.Module's casts do; ``complex_too``: complex ones too, as ``.to`` does; ``every_tensor``: all, as ``.type`` does)."""
        tensors = [*self.parameters(), *self.buffers()]
        cast = [t for t in tensors if every_tensor or t.is_floating_point() or (complex_too and t.is_complex())]
        changed = sorted({str(t.dtype).removeprefix("torch.") for t in cast if t.dtype != dtype})
        if not changed:
            return
        name = str(dtype).removeprefix("torch.")
        instead = {torch.bfloat16: "precision='bf16'", torch.float16: "precision='fp16'"}.get(dtype)
        how = (
            f"optimize the original model with graphopt.optimize(model, inputs, {instead}) (convs, linears and attention in {name}, verified)"
            if instead
            else f"optimize the original model in {name}: graphopt.optimize(model.to({dtype}), inputs in {name})"
        )
        raise ModeSwitchError(
            f"{call} would cast this optimized module's {', '.join(changed)} parameters and buffers to {name}, but its graph "
            f"was optimized and verified for them as they are: later calls would fail or compute unverified. To run in {name}, "
            f"{how}; keep this module as it is."
        )

    def check_mode_switch(self, mode: bool) -> None:
        """Raise `ModeSwitchError` where this graph cannot compute in train mode ``mode`` (False: eval), and why."""
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
        fixed = [path for path, training in self.graph_module.meta.get("graphopt_fixed_modes", {}).items() if training != mode]
        if fixed:
            raise ModeSwitchError(f"this module cannot switch to {'train' if mode else 'eval'} mode: {_fixed_modes_advice(fixed, not mode)}")

    def _check_fixed_modes(self) -> None:
        """Refuse a call after a submodule whose train/eval flag the graph fixed was switched (``fast.block.eval()``,
        which does not go through `train` here): the graph would silently compute in the mode it was traced in."""
        fixed = self.graph_module.meta.get("graphopt_fixed_modes", {})
        switched = [path for path, training in fixed.items() if _training_flag(self, path) not in (None, training)]
        if switched:
            raise ModeSwitchError(
                f"{_module_names(switched)} switched to {'eval' if fixed[switched[0]] else 'train'} mode: "
                f"{_fixed_modes_advice(switched, fixed[switched[0]])} Switch {'it' if len(switched) == 1 else 'them'} back to call this module."
            )

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
        self._check_engine_weights("load_original_state_dict()")
        self.load_state_dict({key: value for key, value in converted.items() if key in own})
        fp32_weights = self.graph_module.meta.get("graphopt_fp32_weights", {})
        for name in fp32_weights.keys() & converted.keys():  # the fp32 values behind the low-precision copies just loaded
            fp32_weights[name] = converted[name].detach().clone()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        self._check_engine_weights("load_state_dict()")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _check_engine_weights(self, call: str) -> None:
        """Refuse ``call`` (new weights, another device) where an engine compiled the weights in: it would ignore them."""
        engine = self.graphopt_report.engine
        if engine is not None:
            raise ModeSwitchError(
                f"{call}: this module runs on engine={engine.name!r}, which compiled its own copy of the weights and runs on the "
                "CPU: the change would not reach it. Load the weights into the original model and optimize it again."
            )
        if self.generator is not None:
            raise ModeSwitchError(
                f"{call}: this module's generate() runs graphs with their own copy of the weights: the change would not reach "
                "them. Load the weights into the original model (or move it) and optimize it again."
            )

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

    def __copy__(self) -> OptimizedModule:
        """A shallow copy sharing the graph, as for any module (not by pickling, which `graphopt.saving` turns into writing a file)."""
        copied = self.__class__.__new__(self.__class__)
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizedModule:
        """A copy of the module and its graph, sharing the copied graph's submodules and tensors (not by pickling, which
        `graphopt.saving` turns into writing a file)."""
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        shared = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set")
        copied.__dict__.update(copy.deepcopy({key: value for key, value in self.__dict__.items() if key not in shared}, memo))
        for key in shared:
            copied.__dict__[key] = getattr(copied.graph_module, key)
        return copied

    def extra_repr(self) -> str:
        return f"mode={self.graphopt_report.mode}, frontend={self.graphopt_report.frontend}"

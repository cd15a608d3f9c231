"""The Inductor engine: graphopt's graph compiled by ``torch.compile`` with freezing, for CPU inference.

The graph is the one graphopt captured and verified, after the portable passes. It is
compiled with Inductor's recommended CPU inference setting, ``freezing`` (weights folded in
as constants, conv-BN folded, oneDNN weights prepacked, post-ops fused; see `_compile` for
how it is set), ``fullgraph``, under ``torch.inference_mode``. Where some dimensions were
verified dynamic, it is compiled twice, as the other engines build two models: for the
example's shapes, which calls of those shapes run on, and with those dimensions marked dynamic
(``torch._dynamo.mark_dynamic``, every other size the example's) for the other sizes. Compiled
for fixed sizes, Inductor specializes its kernels as ``torch.compile`` used directly does
(EfficientNet-B0, batch 8, AMD EPYC Zen 2: with the batch dynamic 0.92-0.95x the speed of
torch.compile freezing used directly, compiled for the example's shapes 0.99x). Each holds its
own frozen copy of the weights.
Both are compiled inside `build` by running the example, so the first call is as fast as the
next.

``precision="bf16"`` runs the compiled call under CPU ``torch.autocast`` to bfloat16 (as the
peer "torch.compile freezing bf16 autocast + CL" of ``graphopt bench``; freezing folds the
weights' casts), the outputs cast back to the graph's dtypes. fp16 is not offered: CPUs without native fp16
arithmetic emulate it.

Layout: the engine converts nothing to channels_last. Under freezing, Inductor's own layout
optimisation (``torch._inductor.config.layout_optimization``, on by default) turns the
weights of a graph with convolutions on a oneDNN CPU to channels_last and prepacks them,
and converts the activations at the first convolution, so converting them here as well
would only move that copy. The graph is compiled for the example's memory format
(channels_last or contiguous).

Compiled code is specific to the machine and the process, and loading a compiled library
runs code from the file: saving writes none, and `load` compiles the graph saved beside it
again (a build's time on every load).

Each call's inputs are made what the graph was compiled for (`_as_compiled`), or Dynamo's guards
would compile it again. They still do (once each, then cached, without freezing) where a
dynamic dimension has size 1 in a call but not in the example: Dynamo specializes sizes 0 and 1.

A language model's generation steps (`program_runner`, `graphopt.generation`) are torch.export
programs whose shapes change with every call: each program's module is compiled the same way
(freezing, fullgraph, inference mode), and with Inductor's C++ wrapper (a step is a few hundred
small ops, whose Python calls cost more than their work at one token), with torch.export's dynamic
dimensions marked dynamic, for every batch size and prompt and cache length (`InductorStepRunner`).
The PyTorch engine compiles its decode graph, after graphopt's passes, with the same runner
(`compiled_step`).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from graphopt.backends.engine import EngineInfo, EngineInput, EngineRunner, tensor_leaves
from graphopt.dynamic import Dims
from graphopt.errors import EngineError, error_summary
from graphopt.ops import layout_of
from graphopt.runtime.portable import LINEAR_ADD

PRECISIONS = ("fp32", "bf16")


class InductorRunner(EngineRunner):
    """graphopt's graph compiled by Inductor with freezing, called at the engine's precision."""

    engine = "inductor"

    def __init__(
        self,
        graph_module: fx.GraphModule,
        precision: str,
        dims: Dims,
        input_formats: list[torch.memory_format | None],
        outputs: pytree.TreeSpec,
        output_dtypes: list[torch.dtype | None],
        example_shapes: list[tuple[int, ...] | None],
    ) -> None:
        super().__init__()
        self.precision = precision
        self.dims = dims
        self.input_formats = input_formats  # per input leaf, None where it is not a tensor
        self.outputs = outputs
        self.output_dtypes = output_dtypes  # per output leaf, None where it is not a tensor
        self.example_shapes = example_shapes  # per input leaf, None where it is not a tensor
        # held, not registered: the runner's module tree (state_dict, train()) stays out of the compiled graph's guards
        object.__setattr__(self, "compiled", torch.compile(graph_module, fullgraph=True))
        # the example's shapes: another GraphModule on the same modules and weights, so that Dynamo, which keeps compiled
        # code per code object, compiles it apart (a call of those shapes would otherwise match the dynamic code)
        static = torch.compile(fx.GraphModule(graph_module, copy.deepcopy(graph_module.graph)), fullgraph=True) if any(dims) else self.compiled
        object.__setattr__(self, "example_compiled", static)

    def run(self, args: tuple[Any, ...]) -> Any:
        leaves, spec = pytree.tree_flatten(args)
        with torch.inference_mode(False), torch.no_grad():  # copies made here are normal tensors, as the compiled ones were
            leaves = [leaf if memory_format is None else _as_compiled(leaf, memory_format) for leaf, memory_format in zip(leaves, self.input_formats, strict=True)]
        return self.call(self._compiled_for(leaves), pytree.tree_unflatten(leaves, spec))

    def run_compiled(self, args: tuple[Any, ...]) -> Any:
        """Call the graph compiled for ``args``' shapes (the example's, or the dynamic one) on them as they are (the
        first call of each compiles it)."""
        return self.call(self._compiled_for(pytree.tree_leaves(args)), args)

    def _compiled_for(self, leaves: list[Any]) -> Any:
        """`example_compiled` for input leaves of the example's shapes, else `compiled`."""
        shapes = [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        return self.example_compiled if shapes == self.example_shapes else self.compiled

    def call(self, compiled: Any, args: tuple[Any, ...]) -> Any:
        """``compiled`` (`compiled` or `example_compiled`) on ``args`` as they are, at the engine's precision."""
        # the same autograd mode and autocast state whatever the caller's: Dynamo guards on both, and would recompile
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            outputs = pytree.tree_leaves(compiled(*args))
        # autocast returns its own dtype: the graph's outputs keep theirs
        restored = [leaf if dtype is None else leaf.to(dtype) for leaf, dtype in zip(outputs, self.output_dtypes, strict=True)]
        return pytree.tree_unflatten(restored, self.outputs)

    def save(self, folder: Path) -> dict[str, Any]:
        """Write nothing (compiled code is specific to this machine and process); the settings to compile again."""
        return {"precision": self.precision, "dims": [sorted(mine) for mine in self.dims]}


def _memory_format(tensor: torch.Tensor) -> torch.memory_format:
    """The memory format the graph is compiled for, for an input like ``tensor``: channels_last if it is, else contiguous."""
    if layout_of(tensor) == "channels_last":
        return torch.channels_last if tensor.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def _as_compiled(tensor: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``tensor`` as the graph was compiled for: in ``memory_format``, no autograd, not an inference tensor.

    Dynamo guards on strides, ``requires_grad`` and dispatch keys, and would compile again (without
    freezing, see `_compile`) for a call that differs: graphopt's second input has other strides,
    and tensors made under ``torch.inference_mode`` lack the autograd keys. Free for a tensor that
    is already so, a copy otherwise.
    """
    tensor = tensor.detach()
    return tensor if not tensor.is_inference() and _has_compiled_strides(tensor, memory_format) else tensor.clone(memory_format=memory_format)


def _has_compiled_strides(tensor: torch.Tensor, memory_format: torch.memory_format = torch.contiguous_format) -> bool:
    """Whether ``tensor`` has exactly the strides a copy in ``memory_format`` has, those of dimensions of size one
    included: Dynamo guards on them, where ``is_contiguous`` ignores them (a batch of one sliced from a larger tensor)."""
    if memory_format == torch.contiguous_format:  # torch._prims_common.make_contiguous_strides_for's, without its checks
        stride = 1  # (they cost more than a generation step's twenty inputs may: this is on every step's path)
        for size, actual in zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True):
            if actual != stride:
                return False
            stride *= max(size, 1)
        return True
    from torch._prims_common import make_channels_last_strides_for

    return tensor.stride() == tuple(make_channels_last_strides_for(tensor.shape))


def _compile(graph_module: fx.GraphModule, example_inputs: tuple[Any, ...], dims: Dims, precision: str) -> InductorRunner:
    """The runner, compiled now with freezing by running a copy of the example, its dimensions in ``dims`` marked dynamic.

    Freezing is set process-wide while compiling, as torchao's recipe sets it: Dynamo reads it too,
    to hand the weights over as constants (as ``torch.compile(options={"freezing": True})``, only
    Inductor sees it and, the weights being graph inputs, freezes nothing). A later recompile (see
    the module docstring) is therefore not frozen.
    """
    if precision not in PRECISIONS:
        raise EngineError(f"engine='inductor' computes in {' or '.join(PRECISIONS)}, not {precision!r}")
    if any(tensor.device.type != "cpu" for tensor in tensor_leaves(example_inputs)):
        raise EngineError("engine='inductor' runs on the CPU here: give example inputs on the CPU (device='cpu')")
    with torch.inference_mode():
        outputs, structure = pytree.tree_flatten(graph_module(*example_inputs))
    leaves, spec = pytree.tree_flatten(example_inputs)
    formats = [_memory_format(leaf) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    shapes = [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    runner = InductorRunner(
        graph_module, precision, dims, formats, structure, [leaf.dtype if isinstance(leaf, torch.Tensor) else None for leaf in outputs], shapes
    )

    def copies() -> list[Any]:  # the marks stay off the caller's tensors
        with torch.inference_mode(False), torch.no_grad():
            return [leaf if memory_format is None else leaf.detach().clone(memory_format=memory_format) for leaf, memory_format in zip(leaves, formats, strict=True)]

    with _compiling("graphopt's graph"):
        runner.run_compiled(pytree.tree_unflatten(copies(), spec))  # for the example's shapes (all of them where none is dynamic)
        if any(dims):
            marked = copies()
            for leaf, mine in zip(marked, dims, strict=True):
                if isinstance(leaf, torch.Tensor) and mine:
                    torch._dynamo.mark_dynamic(leaf, sorted(mine))
            runner.call(runner.compiled, pytree.tree_unflatten(marked, spec))  # for the other sizes
    return runner


@contextlib.contextmanager
def _compiling(what: str, **settings: Any) -> Iterator[None]:
    """Freezing (and Inductor's other ``settings``) on while the first call compiles (see `_compile`); Inductor's own error
    (no C++ compiler, an unsupported op, a graph break) becomes `EngineError`, quoted, saying what to do."""
    from torch._inductor import config, exc  # here, not at the top: Inductor takes seconds to import, and only a build needs it

    try:
        with config.patch(freezing=True, **settings):
            yield
    except Exception as error:
        cause = getattr(error, "inner_exception", None) or error  # Dynamo's wrapper around the backend's own error
        advice = "install a C++ compiler (g++ or clang) or use another engine" if isinstance(cause, exc.InvalidCxxCompiler) else "use another engine"
        raise EngineError(f"engine='inductor' could not compile {what} ({error_summary(cause)}): {advice}") from error


class InductorStepRunner(EngineRunner):
    """A language model's generation step (`graphopt.generation`: its shapes change with every call, the cache growing
    a token per step) compiled by Inductor with freezing and its C++ wrapper, for every batch size and prompt and cache
    length: ``program``'s module, or ``graph`` (the PyTorch engine's decode graph after graphopt's passes, which takes
    the program's arguments).

    Compiled with the dimensions torch.export made dynamic marked dynamic, and without duck shaping (dimensions of one
    size in the example, e.g. batch 2 and a prompt of 2 tokens, are not assumed equal), so that no later length compiles
    again. Generation runs under ``torch.inference_mode`` and the decode step takes the cache the step before returned:
    the compiled graph takes inference tensors, contiguous (Dynamo guards on both), and each call's inputs are made so
    (free for the cache the compiled step returned; a copy of the prompt and of the prefill's strided cache).
    Dynamo specializes sizes 0 and 1: a batch of one prompt is compiled once more, here too. Calls run the code compiled
    here and compile nothing more (``torch._dynamo.run``): a call no compile's guards admit (none is expected) runs the
    graph as ops, rather than compiling for seconds in the middle of a generation, and without the settings of these
    compiles (freezing, `STEP_SETTINGS`; for ``graph``, `PASSES_STEP_SETTINGS`, which keep the kernels graphopt's passes
    chose), which are the process's and would be set around every call (a step's arguments, settings and guards checked
    in Python cost 0.45 ms of the small Llama's 11 ms step).
    """

    engine = "inductor"

    def __init__(self, program: torch.export.ExportedProgram, outputs: pytree.TreeSpec, graph: fx.GraphModule | None = None) -> None:
        super().__init__()
        self.outputs = outputs
        # held, not registered: the runner's module tree stays out of the compiled graph's guards
        object.__setattr__(self, "graph", graph)
        object.__setattr__(self, "compiled", torch.compile(_with_linear_adds_split(graph) if graph is not None else program.module(), fullgraph=True))
        settings = STEP_SETTINGS if graph is None else PASSES_STEP_SETTINGS
        args, _ = program.example_inputs
        with torch.inference_mode():  # copies: the marks stay off the program's example
            leaves, spec = pytree.tree_flatten(pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.clone(memory_format=torch.contiguous_format), args))
        placeholders = [node.meta["val"] for node in program.graph.find_nodes(op="placeholder") if node.name in set(program.graph_signature.user_inputs)]
        dims = [[dim for dim, size in enumerate(value.shape) if not is_concrete_int(size)] for value in placeholders]
        with torch.inference_mode():  # the example's first sequence: a batch of one compiles apart (see above)
            first = [leaf[:1].clone() if 0 in mine else leaf for leaf, mine in zip(leaves, dims, strict=True)]
        for example in (leaves, first):
            for leaf, dynamic in zip(example, dims, strict=True):
                if dynamic:
                    torch._dynamo.mark_dynamic(leaf, dynamic)
            with _SETTINGS_LOCK, _compiling("the generation step", **settings), _step_shapes(), torch.inference_mode():
                self.compiled(*pytree.tree_unflatten(example, spec))  # compiled now: the first call is as fast as the next
        object.__setattr__(self, "compiled_only", torch._dynamo.run(self.compiled))  # the code compiled above, nothing more

    @staticmethod
    def inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` as the compiled step takes them: inference tensors with a contiguous tensor's strides, those of
        dimensions of size one included (Dynamo guards on them: the decode step's position, sliced from a mask one token
        longer at each step, would compile it again at every step)."""
        with torch.inference_mode():
            return pytree.tree_map_only(
                torch.Tensor, lambda tensor: tensor if tensor.is_inference() and _has_compiled_strides(tensor) else tensor.clone(memory_format=torch.contiguous_format), args
            )

    def run(self, args: tuple[Any, ...]) -> Any:
        inputs = self.inputs(args)
        with torch.inference_mode():
            return pytree.tree_unflatten(pytree.tree_leaves(self.compiled_only(*inputs)), self.outputs)


def _with_linear_adds_split(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` (sharing its weights) with each ``graphopt.linear_add`` (`graphopt.runtime.onednn`: a Python custom op,
    which compiled code calls back through Python at about 40 us a call, a millisecond of GPT-2's step) as the oneDNN
    linear and the add it computes, which Inductor calls from C++ and fuses into its next kernel.

    The add takes the linear's result second: Inductor's freezing matches ``add(linear, bias)`` and asserts that the
    linear's weight is one it packed itself (here it is graphopt's), and oneDNN's fused ``linear + add`` has no fake
    kernel for Dynamo to trace (torch 2.13). Addition commutes: the values are the same."""
    split, nodes = fx.Graph(), {}
    split.set_codegen(graph.graph._codegen)  # torch.export's: the step's arguments as a tree (the cache's lists)
    for node in graph.graph.nodes:
        nodes[node] = split.node_copy(node, lambda old: nodes[old])
    for node in split.find_nodes(op="call_function", target=LINEAR_ADD):
        x, other, weight, bias = node.args
        with split.inserting_before(node):
            linear = split.call_function(torch.ops.mkldnn._linear_pointwise.default, (x, weight, bias, "none", [], ""))
            node.replace_all_uses_with(split.call_function(torch.ops.aten.add.Tensor, (other, linear)))
        split.erase_node(node)
    return fx.GraphModule(graph, split)


def _step_shapes() -> contextlib.AbstractContextManager[None]:
    """Dynamo's shape setting for a generation step: no duck shaping (see `InductorStepRunner`)."""
    from torch.fx.experimental import _config as shapes

    return shapes.patch(use_duck_shape=False)


_SETTINGS_LOCK = threading.Lock()  # InductorStepRunner's compiles set process-wide settings: one at a time


# Inductor's settings for a generation step, beside freezing: the C++ wrapper calls the step's kernels without Python
# (the small Llama's decode step 9.9 against 11.1 ms with Python's wrapper; AMD EPYC Zen 2, 2 threads)
STEP_SETTINGS = {"cpp_wrapper": True}
# and for the PyTorch engine's decode graph, which holds the kernels graphopt's passes measured for each linear (oneDNN's,
# or ATen's where not clearly slower): Inductor keeps them, rather than packing ATen's linears for its own GEMM (slower
# at a token's rows: the small Llama's step 12.9 against 11.8 ms with ATen's linears, 12.0 with oneDNN's; AMD EPYC Zen 2)
PASSES_STEP_SETTINGS = {**STEP_SETTINGS, "cpp.weight_prepack": False}


def program_runner(program: torch.export.ExportedProgram, precision: str, outputs: pytree.TreeSpec) -> InductorStepRunner:
    """A torch.export program whose shapes change with every call (a language model's prefill or decode step), compiled
    now for its dynamic shapes (called through `EngineInfo.make_program_runner`)."""
    if precision != "fp32":
        raise EngineError(f"engine='inductor' runs a generation step in fp32, not {precision!r}")
    return InductorStepRunner(program, outputs)


def compiled_step(program: torch.export.ExportedProgram, graph: fx.GraphModule, outputs: pytree.TreeSpec) -> InductorStepRunner:
    """``graph`` (a generation step's graph after graphopt's passes, taking ``program``'s arguments) compiled now for
    ``program``'s dynamic shapes; `EngineError` where Inductor cannot (no C++ compiler, an op it cannot lower)."""
    try:
        return InductorStepRunner(program, outputs, graph)
    except EngineError:
        raise
    except Exception as error:
        raise EngineError(f"Inductor could not compile the generation step ({error_summary(error)})") from error


def build(request: EngineInput) -> InductorRunner:
    """Compile graphopt's graph with Inductor and freezing, now, on the example inputs."""
    return _compile(request.graph_module, request.example_inputs, request.dims, request.precision)


def load(folder: Path, settings: Mapping[str, Any], graph_module: fx.GraphModule, example_inputs: tuple[Any, ...]) -> InductorRunner:
    """Compile again the graph saved beside ``folder`` (``graph_module``): `InductorRunner.save` writes no compiled code."""
    return _compile(graph_module, example_inputs, tuple(frozenset(mine) for mine in settings["dims"]), settings["precision"])


ENGINE = EngineInfo(
    "inductor",
    "torch.compile (Inductor) with freezing on graphopt's graph, bf16 under CPU autocast (inference, CPU; no fp16: CPUs emulate it)",
    precisions=PRECISIONS,
    compiles=True,
    build=build,
    load=load,
    run_program=program_runner,
    costs="seconds to minutes of C++ compilation at every build and every load, twice where an input dimension is dynamic "
    "(the example's shapes, other sizes: twice the weights' memory; needs a C++ compiler); "
    "saves no compiled code, only the graph; no autograd, CPU only",
)

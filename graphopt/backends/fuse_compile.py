"""Fusion backends: compile the pointwise regions of an optimized graph, or the whole graph.

``optimize(..., fuse=...)`` ends here, after the passes:

- ``"inductor"``: each region that `extract_pointwise_regions` made is compiled with
  ``torch.compile`` (fullgraph, Inductor), its batch dimension marked dynamic so that
  other batch sizes reuse the same kernel, as inference tensors and ordinary ones do;
- ``"torchscript"``: each region is scripted with ``torch.jit.script``. PyTorch has
  deprecated TorchScript: graphopt says so once per process and keeps it working. On CPU
  its fuser needs an LLVM-enabled build of torch; without one the scripted region runs
  op by op (the report says which);
- ``"graph"``: the whole optimized GraphModule goes to ``torch.compile``: the baseline a
  region-by-region fusion is compared with.

Regions with the same structure, input dtypes, shapes and layouts share one compiled
artifact. Compilation is eager: `compile_regions` runs the model once on the example
inputs, so every region is compiled (and timed) inside ``optimize`` and the first user
call is as fast as the next. Each compiled region is checked against its eager version
on the example inputs; a region whose backend fails (no C++ compiler, an unsupported
op, a numeric mismatch) stays eager and the report says why. A compiled callable that
fails later (e.g. recompiling for a new shape without a compiler) falls back to eager
with a warning: the model never breaks.

A `FusedRegion` keeps its eager region: tracing and export (``graphopt.export_onnx``,
``torch.export``, ``torch.compile`` of the whole model) see plain ops. Copies
(``copy.deepcopy``, pickling) drop the compiled callables and run the regions eagerly:
optimize the copy again to compile it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import operator
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from graphopt import progress, verify
from graphopt.errors import error_summary, warn_at_caller
from graphopt.dynamic import Dims
from graphopt.ops import layout_of, record
from graphopt.ops.record import RunContext
from graphopt.passes.extract_pointwise_regions import REGION_PREFIX, extract_pointwise_regions
from graphopt.report import FusionReport, RegionReport, target_name

FUSE_BACKENDS = ("inductor", "torchscript", "graph")

_torchscript_warned = False


class _CompileCounter:
    """A torch.compile backend that counts its compilations and hands the graph to Inductor."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        self.count += 1
        return compile_fx(gm, example_inputs)


# the dispatch keys an inference tensor (made under torch.inference_mode) lacks and an ordinary tensor has
_AUTOGRAD_KEYS = functools.reduce(
    operator.or_, (torch._C.DispatchKeySet(key) for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradNestedTensor))
)


def _same_keys_for_both_kinds(backend: str) -> contextlib.AbstractContextManager[Any]:
    """Where autograd is off, a context in which Dynamo's guards read an inference tensor and an ordinary one alike.

    Dynamo guards each tensor input on its dispatch keys as the thread's included and excluded keys leave them, and an
    inference tensor has no ADInplaceOrView or autograd keys: a region fed the caller's tensor (ordinary, or an inference
    tensor the caller made) shares its artifact with one fed an intermediate (an inference tensor under inference mode,
    ordinary under no_grad), so the first call of the other kind compiled again, with the batch size static, and the
    next batch size compiled a third time. With ADInplaceOrView included and the autograd keys excluded, both kinds have
    the same keys: one compilation serves them. Without autograd this changes nothing else: inference mode excludes
    those keys already and runs ADInplaceOrView's kernels on ordinary tensors; no_grad includes ADInplaceOrView and
    records no graph. Training keeps the keys as they are (the regions' autograd needs them)."""
    if backend == "torchscript" or torch.is_grad_enabled():
        return contextlib.nullcontext()
    both = contextlib.ExitStack()
    both.enter_context(torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView))
    both.enter_context(torch._C._ExcludeDispatchKeyGuard(_AUTOGRAD_KEYS))
    return both


def _tracing() -> bool:
    """Whether a tracer (torch.export, torch.compile, fx, jit.trace) is running this code."""
    return (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch.fx._symbolic_trace.is_fx_symbolic_tracing()
        or torch.jit.is_tracing()
    )


class FusedRegion(nn.Module):
    """A pointwise region run by its compiled form; the eager ``region`` serves tracers, export and fallback."""

    def __init__(self, region: fx.GraphModule, backend: str) -> None:
        super().__init__()
        self.region = region  # parameter-free: registering it adds no state_dict keys
        self.backend = backend
        self.fallback_reason = ""
        self._compiled: Callable[..., Any] | None = None
        self._counter: _CompileCounter | None = None

    @property
    def compiled(self) -> Callable[..., Any] | None:
        return self._compiled

    @property
    def compilations(self) -> int:
        """How many times the backend compiled this region's artifact (recompilations included)."""
        if self._counter is not None:
            return self._counter.count
        return int(self._compiled is not None)

    def use(self, compiled: Callable[..., Any] | None, counter: _CompileCounter | None = None) -> None:
        # not an attribute nn.Module registers: a compiled module would otherwise appear in named_modules()
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_counter", counter)

    def forward(self, *args: Any) -> Any:
        if self._compiled is None or _tracing():
            return self.region(*args)
        try:
            with _same_keys_for_both_kinds(self.backend):
                return self._compiled(*args)
        except Exception as error:  # noqa: BLE001 - eager decides whether the inputs or the backend are at fault
            outputs = self.region(*args)  # raises the user's own error when the inputs are wrong
            self.fallback_reason = error_summary(error)
            warnings.warn(f"graphopt: the {self.backend} kernel of a pointwise region failed ({self.fallback_reason}); it runs eagerly from now on", RuntimeWarning, stacklevel=2)
            self.use(None)
            return outputs

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_compiled"], state["_counter"] = None, None  # compiled code does not copy or pickle
        return state


def _record(gm: fx.GraphModule, regions: set[str], args: tuple[Any, ...], context: RunContext) -> dict[str, tuple[Any, ...]]:
    """Run the graph and record the arguments each region is called with."""
    arguments: dict[str, tuple[Any, ...]] = {}

    def keep_arguments(node: fx.Node, result: Any, values: Mapping[fx.Node, Any]) -> None:
        if node.op == "call_module" and node.target in regions:
            arguments[str(node.target)] = fx.node.map_arg(node.args, values.__getitem__)

    record(gm, args, keep_arguments, context)
    return arguments


def _grown_batch(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with one more sample: every tensor with a first dimension gets its first row repeated."""
    return pytree.tree_map(lambda t: torch.cat([t, t[:1]]) if isinstance(t, torch.Tensor) and t.dim() > 0 else t, args)


def _batch_positions(gm: fx.GraphModule, regions: set[str], args: tuple[Any, ...], recorded: dict[str, tuple[Any, ...]]) -> tuple[dict[str, set[int]], str]:
    """For each region, which inputs have a batch dimension (their first size follows the model's batch size)."""
    try:
        grown = _record(gm, regions, _grown_batch(args), torch.no_grad)
    except Exception as error:  # noqa: BLE001 - a model that needs its example batch size: compile static shapes
        return {}, f"the model did not run with another batch size ({type(error).__name__}), so regions are compiled for the example shapes only"
    positions = {}
    for name, values in recorded.items():
        positions[name] = {
            i
            for i, (value, other) in enumerate(zip(values, grown.get(name, ()), strict=False))
            if isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(other, torch.Tensor) and other.shape[0] != value.shape[0]
        }
    return positions, ""


def _structure(region: fx.GraphModule) -> tuple[Any, ...]:
    """The region's ops and wiring, independent of node names."""
    index = {node: i for i, node in enumerate(region.graph.nodes)}
    rename = lambda arg: ("node", index[arg]) if isinstance(arg, fx.Node) else arg
    return tuple(
        (node.op, "" if node.op == "placeholder" else str(node.target), repr(fx.node.map_aggregate(node.args, rename)), repr(fx.node.map_aggregate(node.kwargs, rename)))
        for node in region.graph.nodes
    )


def _signature(region: fx.GraphModule, args: tuple[Any, ...], batch: set[int]) -> tuple[Any, ...]:
    inputs = tuple(
        (a.dtype, tuple(None if i in batch and d == 0 else size for d, size in enumerate(a.shape)), layout_of(a), a.requires_grad)
        if isinstance(a, torch.Tensor)
        else repr(a)
        for i, a in enumerate(args)
    )
    return _structure(region), inputs


def _warn_torchscript_deprecated() -> None:
    global _torchscript_warned
    if not _torchscript_warned:
        _torchscript_warned = True
        warn_at_caller(
            "fuse='torchscript' uses torch.jit.script, which PyTorch has deprecated; graphopt keeps it working, "
            "but prefer fuse='inductor' (torch.compile)",
            FutureWarning,
        )


def _scriptable(region: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``region`` that TorchScript can compile: it calls ``aten.add``, not the overload ``aten.add.Tensor``."""
    copied = copy.deepcopy(region)
    for node in copied.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload):
            node.target = node.target.overloadpacket
    copied.recompile()
    return copied


def _make_compiled(backend: str, module: fx.GraphModule) -> tuple[Callable[..., Any], _CompileCounter | None]:
    if backend == "torchscript":
        _warn_torchscript_deprecated()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own deprecation and type-annotation notes: said once above
            return torch.jit.script(_scriptable(module)), None
    counter = _CompileCounter()
    return torch.compile(module, backend=counter, fullgraph=True), counter


def _warm_up(compiled: Callable[..., Any], args: tuple[Any, ...], dynamic: Mapping[int, Collection[int]], backend: str, context: RunContext) -> float:
    """Compile by calling, in the autograd mode the model runs in (a compiled graph is specific to it); the seconds it took.

    ``dynamic``: argument index -> the dimensions compiled as dynamic."""
    for i, dims in dynamic.items():
        torch._dynamo.maybe_mark_dynamic(args[i], list(dims))
    started = time.perf_counter()
    with context(), _same_keys_for_both_kinds(backend):
        for _ in range(2 if backend == "torchscript" else 1):  # TorchScript's profiling executor optimizes on the second run
            compiled(*args)
    return time.perf_counter() - started


def _check(compiled: Callable[..., Any], region: fx.GraphModule, args: tuple[Any, ...], backend: str, context: RunContext) -> str:
    """Why the compiled region cannot be used ('' when it matches the eager one on ``args``)."""
    with context():
        expected = region(*args)
        with _same_keys_for_both_kinds(backend):
            actual = compiled(*args)
    dtypes = [t.dtype for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    comparison = verify.compare(expected, actual, min(dtypes, key=verify.tolerance_for, default=None) if dtypes else None)
    return "" if comparison.ok else f"compiled output differs from eager by {comparison.max_error:.1e} ({comparison.detail})"


def _region_ops(region: fx.GraphModule) -> list[str]:
    return [target_name(node.target) for node in region.graph.nodes if node.op in ("call_function", "call_method")]


def compile_regions(gm: fx.GraphModule, backend: str, example_inputs: tuple[Any, ...], *, context: RunContext, dynamic_batch: bool) -> FusionReport:
    """Replace every ``pointwise_region_*`` submodule of ``gm`` by a `FusedRegion` compiled with ``backend``.

    ``context`` is the autograd mode forward runs in (``torch.inference_mode``, ``torch.no_grad``
    or ``torch.enable_grad`` for training): regions are compiled for it.
    """
    report = FusionReport(backend)
    names = {str(node.target) for node in gm.graph.nodes if node.op == "call_module" and REGION_PREFIX in str(node.target)}
    names = {name for name in names if isinstance(gm.get_submodule(name), fx.GraphModule)}
    if not names:
        report.notes.append(f"no pointwise regions to compile (see {extract_pointwise_regions.__name__}' skips)")
        return report
    recorded = _record(gm, names, example_inputs, context)
    batch, note = _batch_positions(gm, names, example_inputs, recorded) if dynamic_batch else ({}, "")
    if note:
        report.notes.append(note)
    artifacts: dict[tuple[Any, ...], tuple[str, FusedRegion]] = {}
    for name in progress.steps(sorted(names, key=lambda n: int(n.rsplit("_", 1)[1])), f"compile ({backend})"):
        region = gm.get_submodule(name)
        fused = FusedRegion(region, backend)
        entry = RegionReport(name, _region_ops(region), backend, "compiled")
        args = recorded[name]
        key = _signature(region, args, batch.get(name, set()))
        if key in artifacts:
            entry.shares_with, owner = artifacts[key]
            fused.use(owner.compiled, owner._counter)
            entry.status = "shared"
        else:
            try:
                compiled, counter = _make_compiled(backend, region)
                entry.compile_seconds = _warm_up(compiled, args, dict.fromkeys(batch.get(name, ()), (0,)), backend, context)
                entry.reason = _check(compiled, region, args, backend, context)
            except Exception as error:  # noqa: BLE001 - any backend failure leaves the region eager, with the reason
                entry.reason = f"{backend} failed: {error_summary(error)}"
            if entry.reason:
                entry.status = "eager"
            else:
                fused.use(compiled, counter)
                artifacts[key] = (name, fused)
        entry.compilations = fused.compilations
        gm.add_submodule(name, fused)
        report.regions.append(entry)
    if backend == "torchscript" and not torch._C._llvm_enabled():
        report.notes.append("this torch build has no LLVM: TorchScript cannot fuse on CPU, so scripted regions run op by op")
    return report


def compile_graph(gm: fx.GraphModule, example_inputs: tuple[Any, ...], *, context: RunContext, dynamic: Dims) -> tuple[FusedRegion, FusionReport]:
    """The whole graph compiled with torch.compile (Inductor), compiled now on the example inputs, with the
    dimensions of ``dynamic`` (per leaf of the inputs) dynamic."""
    report = FusionReport("graph")
    runner = FusedRegion(gm, "graph")
    entry = RegionReport("graph", [f"{sum(n.op not in ('placeholder', 'output', 'get_attr') for n in gm.graph.nodes)} nodes"], "graph", "compiled")
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs)  # marking leaves the user's tensors alone
    first_leaf = itertools.accumulate((len(pytree.tree_leaves(a)) for a in args), initial=0)
    marks = {i: dynamic[leaf] for i, (a, leaf) in enumerate(zip(args, first_leaf)) if isinstance(a, torch.Tensor) and dynamic[leaf]}
    try:
        compiled, counter = _make_compiled("inductor", gm)
        with verify.isolated(gm):
            entry.compile_seconds = _warm_up(compiled, args, marks, "inductor", context)
        runner.use(compiled, counter)
    except Exception as error:  # noqa: BLE001 - the graph stays eager, with the reason
        entry.status, entry.reason = "eager", f"torch.compile failed: {error_summary(error)}"
    entry.compilations = runner.compilations
    report.regions.append(entry)
    return runner, report


__all__ = ["FUSE_BACKENDS", "FusedRegion", "FusionReport", "RegionReport", "compile_graph", "compile_regions"]

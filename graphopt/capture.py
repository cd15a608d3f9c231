"""Capture: turn an ``nn.Module`` into the ``fx.GraphModule`` every pass works on.

Frontends:

- ``"fx"``: ``torch.fx.symbolic_trace``. Keeps the model's own module hierarchy
  (``call_module`` nodes, original parameter names) and follows ``.train()/.eval()``
  where the graph calls modules that read their own flag (``nn.Dropout``, ``nn.BatchNorm2d``);
  where forward() reads ``self.training`` itself, the trace fixes that mode, and the graph
  records which flags it fixed (``gm.meta["graphopt_fixed_modes"]``, see `_fixed_modes`).
  Fails on Python control flow that depends on tensor shapes or values.
- ``"export"``: ``torch.export.export(...).module()``, non-strict, with the dimensions
  `graphopt.dynamic` asks for dynamic (``Dim.AUTO``, or the user's own ``dynamic_shapes``).
  Handles shape-dependent control flow (Hugging Face models), and produces ATen ops; the
  train/eval mode at capture time is baked into the graph.
- ``"auto"``: fx first, then export.

Every captured graph runs on the example inputs and on a second input (other sizes of
the dimensions it keeps dynamic, fresh values, other strides) and must reproduce the
eager outputs, buffer updates and, in training mode, gradients before any pass touches
it; a graph that traces but computes something else counts as a failed frontend (fx
silently specialises Python values, and drops ``torch.no_grad()``/``torch.autocast``
blocks and in-place updates of buffers that do not involve its inputs). Where forward()
writes state, the graph must also match eager over consecutive calls, each from the state
the one before left (`_consecutive_mismatch`): an update fx ran once while tracing can hide
on the first call.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from graphopt import dynamic, progress, verify
from graphopt.dynamic import Request
from graphopt.errors import CaptureError, InvalidOptionError, UnknownOptionError
from graphopt.inputs import argument_names, did_you_mean, keyword_names, other_inputs, positional_parameters
from graphopt.ops import remove_dead_code
from graphopt.passes.values import TORCH_DIR
from graphopt.quiet import foreign_notices_silenced
from graphopt.runtime import updates_state
from graphopt.side_effects import preserved_user_objects
from graphopt.validate import SecondInputs, check_inputs, check_model, reference_run

FRONTENDS = ("auto", "fx", "export")

# torch.fx.symbolic_trace patches nn.Module.__call__ for every thread while it traces, so a
# model running eagerly in another thread meanwhile fails: graphopt's public calls take turns.
_LOCK = threading.RLock()
_Function = TypeVar("_Function", bound=Callable[..., Any])


def one_at_a_time(function: _Function) -> _Function:
    """Run ``function`` under graphopt's process-wide lock (concurrent calls are serialised), without torch's
    notices about its own internals (`graphopt.quiet`): every public call of graphopt is wrapped in this.

    A keyword ``function`` does not take raises `UnknownOptionError` naming the close one (``precison=``: did you
    mean ``precision``?), where Python's own `TypeError` names none. One wrapper, so that the warnings graphopt
    raises point at the caller's line with the same ``stacklevel`` everywhere.
    """
    signature = inspect.signature(function)
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in signature.parameters.values())
    names = None if takes_any else keyword_names(signature)  # export_onnx passes **optimize_options on: optimize checks them

    @functools.wraps(function)
    def serialised(*args: Any, **kwargs: Any) -> Any:
        unknown = [] if names is None else [name for name in kwargs if name not in names]
        if unknown:
            raise UnknownOptionError(
                f"{function.__name__}() takes no option {', '.join(map(repr, unknown))}{did_you_mean(unknown, names or [])}"
                f" (help(graphopt.{function.__name__}) lists every option)"
            )
        with _LOCK, foreign_notices_silenced():
            return function(*args, **kwargs)

    return serialised  # type: ignore[return-value]


@dataclass
class Captured:
    """A captured graph and how it was obtained."""

    graph_module: fx.GraphModule
    frontend: str
    attempts: dict[str, str] = field(default_factory=dict)  # frontend -> why it was not used
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    max_error: float = 0.0  # error of the captured graph vs eager on the example inputs
    second: verify.Check | None = None  # the second input the graph was checked on (None: it accepts none of them)
    dims: dynamic.Dims = ()  # the requested dimensions the graph keeps dynamic (`dynamic.graph_dims`)


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _concrete_arguments(model: nn.Module, args: tuple[Any, ...]) -> dict[str, Any] | None:
    """forward()'s parameters that are not tensors in this call: None ones, and keyword-only ones at their defaults.

    symbolic_trace would otherwise trace them as tensors (``if mask is not None`` taken,
    ``if return_dict`` an error); as concrete arguments they are traced as the values they
    have (None ones with a guard in the graph). The optimized module takes positional
    arguments only, so a keyword-only parameter keeps its default.
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    positional = positional_parameters(signature)
    values = [*args, *(parameter.default for parameter in positional[len(args) :])]
    concrete: dict[str, Any] = {parameter.name: None for parameter, value in zip(positional, values) if value is None}
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is not inspect.Parameter.empty:
            concrete[parameter.name] = parameter.default
    return concrete or None


class _SourceLineTracer(fx.Tracer):
    """``fx.Tracer`` recording each node's stack in the model's code (``node.stack_trace``), for the report's
    source lines (e.g. sync points).

    torch's own ``record_stack_traces`` symbolizes native frames too, which costs about 2 s on the
    first trace of a process; Python's traceback of the frames from the first ``forward`` on,
    outside torch, is what the report reads.
    """

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        frames = traceback.extract_stack()[:-1]  # not this frame
        first = next((i for i, frame in enumerate(frames) if frame.name == "forward"), None)
        if first is not None and not node.stack_trace:
            mine = [frame for frame in frames[first:] if not frame.filename.startswith(TORCH_DIR)]
            node.stack_trace = "".join(traceback.StackSummary.from_list(mine).format()).strip() or None
        return node


@contextlib.contextmanager
def _recording_mode_reads() -> Iterator[list[nn.Module]]:
    """Collect the modules whose ``training`` flag is read meanwhile (any module: the flag is an instance attribute,
    which only ``__getattribute__`` sees). Tracing runs the forward() of every module it inlines, so their reads of
    ``self.training`` happen here; leaf modules (``nn.Dropout``) do not run and read their own flag at run time."""
    read: list[nn.Module] = []
    previous = nn.Module.__dict__.get("__getattribute__")
    getattribute = nn.Module.__getattribute__

    def recording(module: nn.Module, name: str) -> Any:
        if name == "training":
            read.append(module)
        return getattribute(module, name)

    nn.Module.__getattribute__ = recording  # type: ignore[method-assign]
    try:
        yield read
    finally:
        if previous is None:
            del nn.Module.__getattribute__
        else:
            nn.Module.__getattribute__ = previous  # type: ignore[method-assign]


def _fixed_modes(model: nn.Module, graph: fx.Graph, read: list[nn.Module], concrete: dict[str, Any] | None) -> dict[str, bool]:
    """The train/eval flags ``graph`` fixed, by module path: those of the modules in ``read`` when tracing with
    them flipped gives another graph (``F.dropout(x, training=self.training)``, ``out if self.training else ...``).

    A flag that is read without changing the graph (``if not self.training or self.p == 0``) fixes nothing. A
    graph of an optimized module being captured again keeps the flags its own capture fixed.
    """
    fixed: dict[str, bool] = dict(model.meta.get("graphopt_fixed_modes", {})) if isinstance(model, fx.GraphModule) else {}
    paths = {id(module): path for path, module in model.named_modules()}
    modules = {paths[id(module)]: module for module in read if id(module) in paths}
    if not modules:
        return fixed
    for module in modules.values():
        module.training = not module.training
    try:
        with _undone(model):
            flipped: fx.Graph | None = fx.Tracer().trace(model, concrete_args=concrete)
    except Exception:  # the other mode does not trace: this graph holds only the traced one
        flipped = None
    finally:
        for module in modules.values():
            module.training = not module.training
    if flipped is None or str(flipped) != str(graph):
        fixed.update({path: module.training for path, module in modules.items()})
    return fixed


@contextlib.contextmanager
def _undone(model: nn.Module) -> Iterator[None]:
    """Undo what symbolic_trace does to ``model``'s state while tracing: `verify.isolated`, and each module's buffer objects put back.

    symbolic_trace runs forward() with real buffers (only parameters become Proxies), so what forward() does to a buffer
    happens for real: ``self.mean.mul_(0.9)`` changes its values, and ``self.n += x.sum()`` (``self.n = self.n + ...``)
    binds a Proxy as the buffer, which every later run and torch.export would read.
    """
    buffers = [(module, dict(module._buffers)) for module in model.modules()]
    with verify.isolated(model):  # outside: it puts the values back into the buffers put back first
        try:
            yield
        finally:
            for module, kept in buffers:
                module._buffers.clear()
                module._buffers.update(kept)


def _trace_fx(model: nn.Module, args: tuple[Any, ...], request: Request, gradients: bool) -> tuple[fx.GraphModule, verify.Reference, list[str]]:
    concrete = _concrete_arguments(model, args)
    with _undone(model):
        with _recording_mode_reads() as read:
            graph = _SourceLineTracer().trace(model, concrete_args=concrete)
        gm = fx.GraphModule(model, graph, model.__class__.__name__)
    # fx creates the containers of inlined modules afresh, in train mode: give them the model's flags, so that each
    # module says the mode the graph computes in (OptimizedModule checks the fixed ones before every call)
    for path, module in gm.named_modules():
        module.training = model.get_submodule(path).training
    gm.meta["graphopt_fixed_modes"] = _fixed_modes(model, graph, read, concrete)
    _remove_dead_code(gm)
    # ShapeProp records shapes/dtypes for the passes' guards while producing the outputs to check
    state: dict[str, torch.Tensor] = {}
    with verify.isolated(gm, state_after=state):
        outputs = ShapeProp(gm).propagate(*args)
    # gradients need a run with autograd; without them the shape run is the reference run
    reference = verify.run_reference(gm, args, gradients=True) if gradients else verify.Reference(outputs, state)
    return gm, reference, []  # fx graphs take any batch size unless the code fixes one


def _trace_export(model: nn.Module, args: tuple[Any, ...], request: Request, gradients: bool) -> tuple[fx.GraphModule, verify.Reference, list[str]]:
    exported = torch.export.export(model, args, dynamic_shapes=request.export, strict=False)
    gm = exported.module()
    _remove_self_copies(gm)
    _remove_dead_code(gm)
    return gm, verify.run_reference(gm, args, gradients=gradients), []


def _remove_dead_code(gm: fx.GraphModule) -> None:
    """Drop what the frontend left unused (export reads every buffer, keeps dead shape computations), so each pass's
    node changes in the report are its own: before the checks, which must see the graph that is kept (fx keeps
    ``self.last[:] = x`` on a buffer as a ``__setitem__`` call nothing uses)."""
    remove_dead_code(gm)
    gm.recompile()


def _remove_self_copies(gm: fx.GraphModule) -> None:
    """Drop export's ``copy_(buffer, value)`` where ``value`` already is ``buffer``, updated in place.

    ``self.steps += 1`` in forward exports as ``add_(steps, 1)`` and, at the end,
    ``copy_(steps, add_)``: a copy of the buffer onto itself, which bumps its version
    counter after other ops saved it for backward, so ``backward()`` raised "modified by
    an inplace operation". The values are the same without the copy.
    """
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or len(node.args) < 2:
            continue
        destination, source = node.args[0], node.args[1]
        if _same_memory(source, destination):
            node.replace_all_uses_with(destination)
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()


def _same_memory(value: Any, target: Any) -> bool:
    """Whether ``value`` is ``target`` or the result of in-place ops on it (``add_(target, 1)``, chained)."""
    while isinstance(value, fx.Node) and value is not target:
        op = value.target
        if value.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not value.args:
            return False
        written = [a for a, arg in zip(value.args, op._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]
        returns = op._schema.returns
        if written != [value.args[0]] or len(returns) != 1 or returns[0].alias_info is None:
            return False
        value = value.args[0]
    return value is target


_TRACERS = {"fx": _trace_fx, "export": _trace_export}


def _specialised(request: Request, kept: dynamic.Dims, args: tuple[Any, ...]) -> str:
    """What torch.export fixed of the dimensions asked to vary ('' when nothing; fx graphs keep them all)."""
    fixed = tuple(asked - mine for asked, mine in zip(request.dims, kept, strict=True))
    if not any(fixed):
        return ""
    one = " (a batch of 1 always is: give example inputs with a batch of 2 or more)" if dynamic.batch_size(args) == 1 else ""
    return (
        f"torch.export fixed {dynamic.describe(fixed, request.names)} to the example's size{one}: the model's code ties "
        "it to that size (e.g. a hard-coded batch or length), so the optimized model accepts only that size there"
    )


def check_frontend(frontend: str) -> None:
    if frontend not in FRONTENDS:
        raise InvalidOptionError(f"unknown frontend {frontend!r}: use one of {', '.join(map(repr, FRONTENDS))}")


def _first_accepted(gm: fx.GraphModule, checks: Iterable[verify.Check], gradients: bool) -> tuple[verify.Check | None, verify.Reference | None]:
    """The first of ``checks`` the graph runs on (an exported graph may refuse another batch size), with its run."""
    for check in checks:
        try:
            return check, verify.run_reference(gm, check.args, gradients=gradients)
        except Exception:
            continue
    return None, None


def _mismatch(frontend: str, model: nn.Module, gm: fx.GraphModule, actual: verify.Reference, check: verify.Check) -> str | None:
    """Why the captured graph does not compute what eager did on ``check`` (state first: it explains the outputs)."""
    expected = check.expected
    state = verify.compare_state(expected.state, actual.state)
    if not state.ok:
        why = "; symbolic_trace drops in-place updates of buffers" if frontend == "fx" else ""
        return f"the captured graph does not update {state.where} as forward() does on {check.description} ({state.detail}{why})"
    outputs = verify.compare(expected.outputs, actual.outputs)
    if not outputs.ok:
        why = "; symbolic_trace drops torch.autocast blocks in forward()" if frontend == "fx" and "dtype" in outputs.detail else ""
        return (
            f"the captured graph computes something else than eager on {check.description}: {outputs.where} differs by "
            f"{outputs.max_error:.2e} (tolerance {outputs.tolerance:.0e}) {outputs.detail}{why}"
        ).strip()
    if expected.gradients is not None and actual.gradients is not None:
        gradients = verify.compare_gradients(expected.gradients, actual.gradients, verify.tolerance_for(torch.float32))
        gradients = verify.confirm_gradients(gradients, model, gm, check.args)
        if not gradients.ok:
            why = (
                "; symbolic_trace drops `with torch.no_grad()`, torch.set_grad_enabled() and torch.autocast blocks in forward() "
                "(pytorch issue 62043): parameters frozen that way would train"
            ) if frontend == "fx" else ""
            return f"the captured graph's gradients differ from eager on {check.description}: {gradients.where} {gradients.detail}{why}"
    return None


def _buffer_values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def _changed(module: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module``'s buffers whose values differ from ``before`` (name -> value), as `verify.isolated` records them."""
    return {name: buffer for name, buffer in module.named_buffers() if name not in before or not torch.equal(buffer, before[name])}


def _consecutive_mismatch(frontend: str, model: nn.Module, gm: fx.GraphModule, example: verify.Check, second: verify.Check | None) -> str | None:
    """Why ``gm`` does not compute what ``model`` computes over consecutive calls, each from the state the one before
    left (None: it does): for a forward() that writes state.

    Every other check starts from the model's state, where a wrong update can go unseen: symbolic_trace runs an op
    on a buffer that reads none of forward()'s inputs (``self.mean.mul_(0.9)``) once, while tracing, and replays only
    the rest, which a zero buffer hides on the first call. The calls: the example, the second input (else fresh values
    of the example's sizes), fresh values; outputs and changed buffers are compared after each. Both run on fresh
    copies, with the same seed for each call, so ``model`` and ``gm`` are left as they were.
    """
    fresh = other_inputs(example.args, tuple(frozenset() for _ in pytree.tree_leaves(example.args)), strided=False)
    fresh_call = (fresh.args, fresh.description)
    calls = [(example.args, example.description), (second.args, second.description) if second is not None else fresh_call, fresh_call]
    original, graph = copy.deepcopy(model), copy.deepcopy(gm)
    original_before, graph_before = _buffer_values(original), _buffer_values(graph)
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(example.expected.gradients is not None):
        for number, (args, description) in enumerate(calls, 1):
            torch.manual_seed(verify.SEED + number)
            expected = original(*args)
            torch.manual_seed(verify.SEED + number)
            actual = graph(*args)
            written = _changed(original, original_before)
            state = verify.compare_state(written, _changed(graph, graph_before))
            outputs = verify.compare(pytree.tree_map(_detached, expected), pytree.tree_map(_detached, actual))
            worst = state if not state.ok else outputs
            if worst.ok:
                continue
            names = ", ".join(f"buffer['{name}']" for name in sorted(written)) or "state"
            why = (
                "; symbolic_trace runs the ops on a buffer that read none of forward()'s inputs (e.g. self.mean.mul_(0.9)) "
                "once, while tracing, and the graph repeats only the rest"
            ) if frontend == "fx" else ""
            return (
                f"forward() writes {names}, and the captured graph does not compute what forward() computes over {len(calls)} "
                f"consecutive calls, each from the state the one before left: on call {number} ({description}), {worst.where} "
                f"differs by {worst.max_error:.2e} (tolerance {worst.tolerance:.0e}){why}"
            )
    return None


def _detached(leaf: Any) -> Any:
    return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf


_STATE_ADVICE = (
    "forward() writes state that the captured graph cannot reproduce on every call: make each update of a buffer one "
    "in-place op that reads forward()'s inputs (self.mean.lerp_(x.mean(0), 0.1) instead of "
    "self.mean.mul_(0.9).add_(0.1 * x.mean(0))), or move the update out of forward() (into the loop that calls the "
    "model, or a forward hook on the optimized module); or keep the original model."
)


def capture_graph(
    model: nn.Module,
    example: verify.Check,
    frontend: str = "auto",
    request: Request | None = None,
    others: SecondInputs | None = None,
) -> Captured:
    """Capture ``model`` (which the caller owns: fx shares its submodules) and check it against eager.

    ``example.expected`` holds the eager outputs, state updates and, in training mode,
    gradients on the example (`verify.run_reference`). ``others`` are second inputs the
    eager model accepts, most different first: the graph must match eager on the first
    one it accepts (`Captured.second`), so a frontend that specialised a value of the
    example fails here. Where forward() or the graph writes state, the graph must also match
    eager over consecutive calls (`_consecutive_mismatch`). ``request``: the dimensions to keep dynamic (default: `graphopt.dynamic`'s).
    """
    check_frontend(frontend)
    if request is None:
        request = dynamic.request(dynamic.DEFAULT, example.args, argument_names(model, len(example.args)))
    started = time.perf_counter()
    attempts: dict[str, str] = {}
    gradients = example.expected.gradients is not None
    writes_state_wrongly = False  # a frontend's graph failed `_consecutive_mismatch`
    for name in progress.steps(("fx", "export") if frontend == "auto" else (frontend,), "capture"):
        try:
            gm, actual, notes = _TRACERS[name](model, example.args, request, gradients)
            kept = dynamic.graph_dims(gm, example.args, request.dims)
            notes += filter(None, [_specialised(request, kept, example.args)])
            reason = _mismatch(name, model, gm, actual, example)
            checks = others.varying(kept) if others is not None else ()
            second, second_actual = _first_accepted(gm, checks, gradients) if reason is None else (None, None)
            if second is not None and second_actual is not None:
                reason = _mismatch(name, model, gm, second_actual, second)
            # a graph that writes state is cheap to spot (`updates_state` may flag a write of an intermediate value too:
            # that costs only this check)
            if reason is None and (example.expected.state or updates_state(gm)):
                reason = _consecutive_mismatch(name, model, gm, example, second)
                writes_state_wrongly = writes_state_wrongly or reason is not None
        except Exception as error:  # any failure of a frontend is a reason to try the next one
            attempts[name] = _first_line(error)
            continue
        if reason is not None:
            attempts[name] = reason
            continue
        comparison = verify.compare(example.expected.outputs, actual.outputs)
        return Captured(gm, name, attempts, notes, time.perf_counter() - started, comparison.max_error, second, kept)
    reasons = "\n".join(f"  - {name}: {reason}" for name, reason in attempts.items())
    hint = (
        "Hint: frontend='fx' needs forward() free of Python control flow on tensor shapes or values; "
        "frontend='export' handles shape-dependent branches but not data-dependent ones (use torch.where or "
        "torch.cond). Check that forward() runs under torch.export.export(model, example_inputs)."
        if frontend == "auto"
        else "Hint: try frontend='auto', which falls back to the other frontend."
    )
    if writes_state_wrongly:
        hint += f"\n{_STATE_ADVICE}"
    raise CaptureError(f"could not capture {type(model).__name__} as a graph:\n{reasons}\n{hint}", attempts)


@one_at_a_time
def capture(
    model: nn.Module,
    example_inputs: Any,
    frontend: str = "auto",
    *,
    dynamic_shapes: Any = dynamic.DEFAULT,
    dynamic_batch: bool = True,
) -> fx.GraphModule:
    """Capture ``model`` as an ``fx.GraphModule`` checked against eager execution.

    ``model`` is not modified: a deep copy is captured. ``example_inputs`` is a tensor
    or a tuple of positional arguments. ``frontend`` is ``"fx"``, ``"export"`` or
    ``"auto"`` (fx, then export). ``dynamic_shapes``: the dimensions to keep dynamic, as in
    `graphopt.optimize` (``dynamic_batch=False`` is ``dynamic_shapes=None``). The frontend used is in
    ``gm.meta["graphopt_frontend"]``.
    Raises `CaptureError` listing each frontend's reason when none succeeds.
    """
    check_model(model)
    args = check_inputs(model, example_inputs)
    request = dynamic.request(dynamic.resolve(dynamic_shapes, dynamic_batch), args, argument_names(model, len(args)))
    owned = copy.deepcopy(model)
    with preserved_user_objects(owned, module_attributes=False):  # tracing must not leave symbolic values in the user's objects
        captured = capture_graph(owned, verify.Check(args, reference_run(owned, args), "the example inputs"), frontend, request)
    captured.graph_module.meta["graphopt_frontend"] = captured.frontend
    return captured.graph_module

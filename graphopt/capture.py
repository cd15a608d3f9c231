"""Capture: turn an ``nn.Module`` into the ``fx.GraphModule`` every pass works on.

Frontends:

- ``"fx"``: ``torch.fx.symbolic_trace``. Keeps the model's own module hierarchy
  (``call_module`` nodes, original parameter names) and follows ``.train()/.eval()``.
  Fails on Python control flow that depends on tensor shapes or values.
- ``"export"``: ``torch.export.export(...).module()``, non-strict, with the batch
  dimension of every tensor input dynamic (``Dim.AUTO``) unless
  ``dynamic_batch=False``. Handles shape-dependent control flow (Hugging Face models),
  and produces ATen ops; the train/eval mode at capture time is baked into the graph.
- ``"auto"``: fx first, then export.

Every captured graph runs on the example inputs and must reproduce the eager outputs
before any pass touches it; a graph that traces but computes something else (fx
silently specialises Python values) counts as a failed frontend.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from graphopt import verify
from graphopt.errors import CaptureError, InvalidOptionError
from graphopt.ops import remove_dead_code
from graphopt.validate import check_inputs, check_model, reference_run

FRONTENDS = ("auto", "fx", "export")

# torch.fx.symbolic_trace patches nn.Module.__call__ for every thread while it traces, so a
# model running eagerly in another thread meanwhile fails: graphopt's public calls take turns.
_LOCK = threading.RLock()
_Function = TypeVar("_Function", bound=Callable[..., Any])


def one_at_a_time(function: _Function) -> _Function:
    """Run ``function`` under graphopt's process-wide lock (concurrent calls are serialised)."""

    @functools.wraps(function)
    def serialised(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
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


def _first_line(error: BaseException, limit: int = 300) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _trace_fx(model: nn.Module, args: tuple[Any, ...], dynamic_batch: bool) -> tuple[fx.GraphModule, verify.Reference, list[str]]:
    tracer = fx.Tracer()
    tracer.record_stack_traces = True  # source lines for the report (e.g. sync points)
    with verify.isolated(model):  # tracing runs in-place buffer updates for real: undo them
        gm = fx.GraphModule(model, tracer.trace(model), model.__class__.__name__)
    # ShapeProp records shapes/dtypes for the passes' guards while producing the outputs to check.
    state: dict[str, torch.Tensor] = {}
    with verify.isolated(gm, state_after=state):
        outputs = ShapeProp(gm).propagate(*args)
    return gm, verify.Reference(outputs, state), []  # fx graphs take any batch size unless the code fixes one


def _batch_dynamic_shapes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    def spec(leaf: Any) -> Any:
        return {0: torch.export.Dim.AUTO} if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None

    return tuple(pytree.tree_map(spec, arg) for arg in args)


def _trace_export(model: nn.Module, args: tuple[Any, ...], dynamic_batch: bool) -> tuple[fx.GraphModule, verify.Reference, list[str]]:
    dynamic_shapes = _batch_dynamic_shapes(args) if dynamic_batch else None
    exported = torch.export.export(model, args, dynamic_shapes=dynamic_shapes, strict=False)
    gm = exported.module()
    notes = []
    if dynamic_batch:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        static = [n.name for n in placeholders if n.meta["val"].dim() > 0 and isinstance(n.meta["val"].shape[0], int)]
        if static:
            notes.append(
                f"torch.export fixed the batch dimension of {', '.join(static)} to the example's size "
                "(a batch of 1, or a model that hard-codes its batch size): the optimized model accepts only that "
                "batch size. Give example inputs with a batch of 2 or more to keep it dynamic."
            )
    return gm, verify.run_reference(gm, args), notes


_TRACERS = {"fx": _trace_fx, "export": _trace_export}


def check_frontend(frontend: str) -> None:
    if frontend not in FRONTENDS:
        raise InvalidOptionError(f"unknown frontend {frontend!r}: use one of {', '.join(map(repr, FRONTENDS))}")


def capture_graph(
    model: nn.Module,
    args: tuple[Any, ...],
    expected: verify.Reference,
    frontend: str = "auto",
    dynamic_batch: bool = True,
) -> Captured:
    """Capture ``model`` (which the caller owns: fx shares its submodules) and check it against ``expected``.

    ``expected`` holds the eager outputs and state updates on ``args`` (`verify.run_reference`).
    """
    check_frontend(frontend)
    started = time.perf_counter()
    attempts: dict[str, str] = {}
    for name in ("fx", "export") if frontend == "auto" else (frontend,):
        try:
            gm, actual, notes = _TRACERS[name](model, args, dynamic_batch)
            comparison = verify.compare(expected.outputs, actual.outputs)
            state_comparison = verify.compare_state(expected.state, actual.state)
        except Exception as error:  # any failure of a frontend is a reason to try the next one
            attempts[name] = _first_line(error)
            continue
        if not comparison.ok:
            attempts[name] = (
                f"the captured graph computes something else than eager: {comparison.where} differs by "
                f"{comparison.max_error:.2e} (tolerance {comparison.tolerance:.0e}) {comparison.detail}".strip()
            )
            continue
        if not state_comparison.ok:
            why = "; symbolic_trace drops in-place updates of buffers" if name == "fx" else ""
            attempts[name] = (
                f"the captured graph does not update {state_comparison.where} as forward() does "
                f"({state_comparison.detail}{why})"
            )
            continue
        # Drop what the frontend left unused (export reads every buffer, keeps dead shape
        # computations), so each pass's node changes in the report are its own.
        remove_dead_code(gm)
        gm.recompile()
        return Captured(gm, name, attempts, notes, time.perf_counter() - started, comparison.max_error)
    reasons = "\n".join(f"  - {name}: {reason}" for name, reason in attempts.items())
    hint = (
        "Hint: frontend='fx' needs forward() free of Python control flow on tensor shapes or values; "
        "frontend='export' handles shape-dependent branches but not data-dependent ones (use torch.where or "
        "torch.cond). Check that forward() runs under torch.export.export(model, example_inputs)."
        if frontend == "auto"
        else "Hint: try frontend='auto', which falls back to the other frontend."
    )
    raise CaptureError(f"could not capture {type(model).__name__} as a graph:\n{reasons}\n{hint}", attempts)


@one_at_a_time
def capture(
    model: nn.Module,
    example_inputs: Any,
    frontend: str = "auto",
    *,
    dynamic_batch: bool = True,
) -> fx.GraphModule:
    """Capture ``model`` as an ``fx.GraphModule`` checked against eager execution.

    ``model`` is not modified: a deep copy is captured. ``example_inputs`` is a tensor
    or a tuple of positional arguments. ``frontend`` is ``"fx"``, ``"export"`` or
    ``"auto"`` (fx, then export). The frontend used is in ``gm.meta["graphopt_frontend"]``.
    Raises `CaptureError` listing each frontend's reason when none succeeds.
    """
    check_model(model)
    args = check_inputs(model, example_inputs)
    owned = copy.deepcopy(model)
    captured = capture_graph(owned, args, reference_run(owned, args), frontend, dynamic_batch)
    captured.graph_module.meta["graphopt_frontend"] = captured.frontend
    return captured.graph_module

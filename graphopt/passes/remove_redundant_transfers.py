"""remove_redundant_transfers: drop moves and casts that change nothing; let host-to-device copies overlap.

1. No-op moves and casts: ``.to()``, ``.cpu()``, ``.cuda()``, ``.float()``, ... (method
   and ATen forms) whose tensor already has the target device and dtype on the example
   inputs. ``Tensor.to`` returns its input unchanged then, so removing the call is exact.
2. Round trips: ``x.cpu().to(x.device)``, ``x.double().float()``: a chain of moves and
   casts that ends where it started is replaced by its start, when every dtype on the
   way holds the start's values exactly (``float -> half -> float`` rounds: kept).
3. Host-to-device copies of values the forward computed on the host get
   ``non_blocking=True``: the copy overlaps with host work, and device ops that read the
   copy are queued after it on the same stream.

Guards, each a recorded skip:
- ``copy=True`` (the model asks for a copy) or a memory-format change;
- a round trip whose result (or a view of it) is written in place or returned: without
  the copy it would share memory with the start;
- a move of a value with a fixed device (a torch.export constant) to the device of a
  tensor read at run time (``c.to(x.device)``): it is kept so that the module still runs
  after ``module.to(other_device)``;
- ``non_blocking`` is not set on copies of graph inputs, parameters or buffers (the
  caller or the optimizer may overwrite pinned host memory while the copy is in flight)
  nor of values written in place afterwards;
- a move whose target is a dtype or device passed to forward() (fx keeps it a graph
  input): the example's target says nothing of other calls'.

Devices and dtypes are the ones seen on the example inputs, on the device the model is
optimized for (``optimize(device=...)``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt.ops import TransferView, transfer_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.passes.values import TensorValue, drop_unread_metadata_checks, example_values, fixed_devices, written_or_returned
from graphopt.report import PassReport


def _holds(dtype: torch.dtype, other: torch.dtype) -> bool:
    """Whether ``other`` represents every value of ``dtype`` exactly."""
    if dtype == other:
        return True
    if dtype.is_floating_point != other.is_floating_point or dtype.is_complex or other.is_complex:
        return False
    return torch.promote_types(dtype, other) == other


def _chain(gm: fx.GraphModule, move: TransferView) -> list[TransferView]:
    """``move`` and the moves and casts feeding it, nearest first."""
    chain = [move]
    while (before := transfer_view(gm, chain[-1].input)) is not None and before.unsupported is None:
        chain.append(before)
    return chain


def remove_redundant_transfers(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Remove no-op moves/casts and round trips; mark host-to-device copies non_blocking."""
    report = PassReport("remove_redundant_transfers")
    if not any(transfer_view(gm, node) is not None for node in gm.graph.nodes):
        return finish(gm, False, report)  # nothing is moved: spare the forward run below
    values = example_values(gm, ctx.example_inputs)
    fixed = fixed_devices(gm)
    for node in list(gm.graph.nodes):
        move = transfer_view(gm, node)
        if move is None or node not in values:
            continue
        if move.unsupported is not None:  # the example's target says nothing of other calls' targets
            report.skip(node, move.unsupported)
            continue
        start, reason = _redundant_from(gm, move, values, fixed)
        if reason is not None:
            report.skip(node, reason)
        elif start is not None:
            round_trip = start is not move.input
            report.rewrite(node, f"removed {'round trip' if round_trip else 'no-op move/cast'}: {start.name} already is {_where(values[node])}")
            node.replace_all_uses_with(start)
            gm.graph.erase_node(node)
            continue
        _overlap_host_copy(gm, move, values, report)
    if report.rewrites:
        drop_unread_metadata_checks(gm)
    return finish(gm, bool(report.rewrites), report)


def _where(value: TensorValue) -> str:
    return f"{str(value.dtype).removeprefix('torch.')} on {value.device}"


def _redundant_from(
    gm: fx.GraphModule, move: TransferView, values: dict[fx.Node, TensorValue], fixed: set[fx.Node]
) -> tuple[fx.Node | None, str | None]:
    """The value ``move`` can be replaced by (the farthest start of its chain with its device and dtype), or why not."""
    target = values[move.node]
    candidate = None
    passed_dtypes = []
    for link in _chain(gm, move):
        start = values.get(link.input)
        if start is None:
            break
        passed_dtypes.append(values[link.node].dtype)
        if start == target and all(_holds(start.dtype, dtype) for dtype in passed_dtypes):
            candidate = link
    if candidate is None:
        return None, None
    start = candidate.input
    chain = _chain(gm, move)
    links = chain[: chain.index(candidate) + 1]
    if any(link.memory_format not in (None, torch.preserve_format) for link in links):
        return None, "changes the memory format"
    if len(links) == 1 and move.copy:
        return None, "copy=True: the model asks for a copy"
    if isinstance(move.device, fx.Node) and start in fixed and move.device not in fixed:
        return None, (
            f"moves {start.name}, whose device is fixed in the graph, to the device of {move.device.name} read at run "
            "time: kept so that the module still runs after .to(device)"
        )
    copies = move.copy or any(values.get(link.input) != values.get(link.node) for link in links)
    if copies and len(links) > 1:
        hazard = written_or_returned(gm, move.node) or written_or_returned(gm, start)
        if hazard is not None:
            return None, f"round trip makes a copy, and {hazard}: removing it would share memory"
    return start, None


def _overlap_host_copy(gm: fx.GraphModule, move: TransferView, values: dict[fx.Node, TensorValue], report: PassReport) -> None:
    source, target = values.get(move.input), values[move.node]
    if source is None or move.non_blocking or source.device.type != "cpu" or target.device.type == "cpu":
        return
    if move.input.op in ("placeholder", "get_attr"):
        report.skip(move.node, f"host-to-device copy of {move.input.name}, which the caller or the optimizer may overwrite while the copy runs: left blocking")
        return
    hazard = written_or_returned(gm, move.input)
    if hazard is not None and "written" in hazard:
        report.skip(move.node, f"host-to-device copy left blocking: {hazard}")
        return
    move.set_non_blocking()
    report.rewrite(move.node, f"host-to-device copy of {move.input.name} ({source.device} -> {target.device}) made non_blocking")

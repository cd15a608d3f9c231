"""report_sync_points: list where forward() makes the host wait for the device (report only, no rewrite).

On an accelerator, kernels run asynchronously: the host queues work and moves on. These
ops make it wait until everything queued has finished, then copy a value back:

- ``.item()``, ``.tolist()``, ``.numpy()``, ``bool/int/float(tensor)``: a value read on the host;
- ``.cpu()`` / ``.to("cpu")`` of a value: a device-to-host copy (in torch.export graphs of a
  CPU model, ``.to(x.device)`` reads as ``.to("cpu")`` too: there only copies from
  another device are listed);
- ops whose output shape depends on the data (``nonzero``, ``masked_select``, ``unique``,
  boolean-mask indexing ``x[mask]``, ``torch.where(cond)``, ...): the host must read
  the size before it can allocate the result. torch.export marks every such op with a
  new data-dependent size symbol, so for its graphs any op of that kind is found.

Each sync point is a note with the node and the line of the model's code it came from.
Nothing is rewritten: whether a sync can be avoided depends on what the value is for.
On a CPU every op is synchronous, so the list says what will cost on a GPU.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from graphopt.ops import transfer_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.passes.values import TensorValue, example_values, source_line
from graphopt.report import PassReport, describe

aten = torch.ops.aten

_HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__"}
_HOST_READ_TARGETS = {aten.item.default, aten._local_scalar_dense.default}
_DATA_DEPENDENT_METHODS = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "bincount", "repeat_interleave"}
_DATA_DEPENDENT_FUNCTIONS = {
    torch.nonzero, torch.masked_select, torch.unique, torch.unique_consecutive, torch.argwhere, torch.bincount,
    torch.repeat_interleave,
}


def _new_data_dependent_sizes(node: fx.Node) -> bool:
    """Whether torch.export gave ``node``'s output a size (or value) symbol its inputs do not have: it read the data."""
    val = node.meta.get("val")
    if val is None:
        return False
    introduced = free_unbacked_symbols(val)
    for arg in node.all_input_nodes:
        if arg.meta.get("val") is not None:
            introduced -= free_unbacked_symbols(arg.meta["val"])
    return bool(introduced)


def _sync_kind(gm: fx.GraphModule, node: fx.Node, values: dict[fx.Node, TensorValue]) -> str | None:
    if (node.op == "call_method" and node.target in _HOST_READS) or node.target in _HOST_READ_TARGETS:
        return f"reads a value on the host (.{getattr(node.target, '_opname', node.target)}())"
    move = transfer_view(gm, node)
    source = values.get(move.input) if move is not None else None
    # torch.export writes .to(x.device) of a CPU model as .to("cpu"): only the method form names the host for sure
    if move is not None and move.device == torch.device("cpu") and (move.form == "function" or (source and source.device.type != "cpu")):
        return "copies to the host (.cpu() / .to('cpu'))"
    if node.op == "call_method" and node.target in _DATA_DEPENDENT_METHODS:
        return f"output shape depends on the data ({node.target})"
    if node.op == "call_function" and node.target in _DATA_DEPENDENT_FUNCTIONS:
        return f"output shape depends on the data ({node.target.__name__})"  # type: ignore[union-attr]
    if node.op == "call_function" and node.target is torch.where and len(node.args) == 1:
        return "output shape depends on the data (torch.where(condition))"
    if node.op == "call_function" and node.target is operator.getitem and _boolean_index(node):
        return "output shape depends on the data (boolean-mask indexing)"
    if _new_data_dependent_sizes(node):
        return f"output shape or value depends on the data ({node.target})"
    return None


def _boolean_index(node: fx.Node) -> bool:
    index = node.args[1]
    meta = index.meta.get("tensor_meta") if isinstance(index, fx.Node) else None
    return meta is not None and getattr(meta, "dtype", None) == torch.bool


def report_sync_points(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """List host synchronisation points in forward with their source lines."""
    report = PassReport("report_sync_points")
    has_moves = any(transfer_view(gm, node) is not None for node in gm.graph.nodes)
    values = example_values(gm, ctx.example_inputs) if has_moves else {}  # a forward run, only when needed
    for node in gm.graph.nodes:
        kind = _sync_kind(gm, node, values)
        if kind is None:
            continue
        line = source_line(node)
        report.notes.append(f"sync point {describe(node)}: {kind}" + (f" at {line}" if line else ""))
    if report.notes and ctx.device.type == "cpu":
        report.notes.append(f"{len(report.notes)} sync point(s): free on the CPU, each one stalls the pipeline on a GPU")
    return finish(gm, False, report)

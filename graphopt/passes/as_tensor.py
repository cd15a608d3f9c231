"""as_tensor: ``torch.tensor(x)`` of a tensor or array already in the graph becomes ``torch.as_tensor(x)``.

``torch.tensor`` always copies its data; ``torch.as_tensor`` shares it when the dtype and
device already match (and converts otherwise), like ``torch.from_numpy``.

Forms:
- ``torch.tensor(x, dtype=..., device=...)`` as a call in the graph: the call becomes
  ``torch.as_tensor(x, dtype=..., device=...)``;
- torch.export spells ``torch.tensor(x)`` as ``detach(x) -> to(..., copy=True) -> detach_``
  (for a stored array or tensor constant: ``lift_fresh_copy(c) -> to(copy=True) -> detach_``,
  which copies twice): the ``to`` loses ``copy=True``, after which it is a no-op when
  nothing changes (remove_redundant_transfers then removes it).

Exact: the values are the same. Guards, each a recorded skip: the result (or a view of
it) is written in place or returned, or ``x`` is written in place: sharing memory would
make the change visible on the other side; ``requires_grad=``/``pin_memory=`` arguments
(``as_tensor`` has none).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt.ops import is_metadata_check, transfer_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.passes.values import written_or_returned
from graphopt.report import PassReport

aten = torch.ops.aten


def _exported_tensor_call(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(source, result) when ``node`` is the copying ``to`` of torch.export's spelling of ``torch.tensor(source)``."""
    move = transfer_view(gm, node)
    if move is None or move.form != "aten" or not move.copy or node.target is aten._to_copy.default:
        return None
    if move.input.target not in (aten.detach.default, aten.lift_fresh_copy.default):
        return None
    users = [user for user in node.users if not is_metadata_check(user)]
    if len(users) != 1 or users[0].target is not aten.detach_.default:
        return None
    return move.input, users[0]


def as_tensor(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace copying torch.tensor(x) of graph values with torch.as_tensor(x)."""
    report = PassReport("as_tensor")
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.tensor and isinstance(node.args[0], fx.Node):
            source, result = node.args[0], node
            extra = sorted(set(node.kwargs) - {"dtype", "device"})
            if extra:
                report.skip(node, f"torch.tensor(..., {', '.join(extra)}=...) has no torch.as_tensor equivalent")
                continue
        else:
            exported = _exported_tensor_call(gm, node)
            if exported is None:
                continue
            source, result = exported
        # a copy of a stored constant is fresh already: nothing else sees its memory
        if source.target is not aten.lift_fresh_copy.default:
            data = source.args[0] if source.target is aten.detach.default else source
            hazard = written_or_returned(gm, result) or written_or_returned(gm, data)  # type: ignore[arg-type]
            if hazard is not None:
                report.skip(node, f"{hazard}: without the copy the two would share memory")
                continue
        if node.target is torch.tensor:
            node.target = torch.as_tensor
        else:
            transfer_view(gm, node).set_copy(False)  # type: ignore[union-attr]
        report.rewrite(node, f"torch.tensor({source.name}) no longer copies (torch.as_tensor)")
    return finish(gm, bool(report.rewrites), report)

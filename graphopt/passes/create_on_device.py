"""create_on_device: create tensors on the device and in the dtype they are moved to, instead of copying.

Patterns, each followed by a move or cast (``.to(device)``, ``.to(x)``, ``.cuda()``,
``.float()``, ATen ``to``):

- a factory (``zeros``, ``ones``, ``full``, ``empty``, ``eye``, ``arange``, ``linspace``,
  ``*_like``, ``x.new_*``, ``rand*``): the move's device and dtype become the factory's
  ``device=``/``dtype=`` arguments and the move disappears, so nothing is allocated on
  one device and copied to another (``torch.zeros(n).to(x.device)`` becomes
  ``torch.zeros(n, device=x.device)``; a device read from a tensor at run time stays so);
- a tensor constant (``torch.tensor([...])``, ``torch.zeros(2, 2)`` with constant
  arguments: symbolic_trace and torch.export store it on the module): it is stored once,
  at optimize time, on the device and in the dtype it is moved to; the move is then a
  no-op (and removed when its target is fixed in the graph).

Exact: the values are the ones the move produced. Guards, each a recorded skip:
- the created tensor is also used before the move (it must exist where it was made);
- the move also changes the memory format;
- random factories when the device or dtype changes (another generator, or another
  number format, draws other values), and ``arange``/``linspace`` when the dtype changes
  (they compute their values in the dtype), unless their arguments are integers the
  dtype holds exactly (``torch.arange(n).float()``);
- parameters and buffers (``module.to(device)`` moves those);
- a move whose target is a dtype or device passed to forward(): known only at run time.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt.ops import factory_view, get_attr, is_metadata_check, set_attr, transfer_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.passes.values import TensorValue, example_values, is_model_state
from graphopt.report import PassReport, describe

aten = torch.ops.aten


def _describe_change(before: TensorValue | None, after: TensorValue | None) -> str:
    if before is None or after is None:
        return ""
    changes = [f"{before.device} -> {after.device}"] if before.device != after.device else []
    changes += [f"{before.dtype} -> {after.dtype}"] if before.dtype != after.dtype else []
    return f" ({', '.join(changes)})" if changes else ""


def create_on_device(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Turn factory-then-move into one factory call with device=/dtype=, and store moved constants where they are used."""
    report = PassReport("create_on_device")
    if not any(transfer_view(gm, node) is not None for node in gm.graph.nodes):
        return finish(gm, False, report)  # nothing is moved: spare the forward run below
    values = example_values(gm, ctx.example_inputs)
    for node in list(gm.graph.nodes):
        move = transfer_view(gm, node)
        if move is None or (move.device is None and move.dtype is None):
            continue
        source = move.input
        factory = factory_view(gm, source)
        constant = _constant_read_by(source)
        is_constant = constant is not None
        before, after = values.get(source), values.get(node)
        if factory is None and (not is_constant or after is None or before == after):
            continue  # a constant already where it is used is not copied: a no-op move is remove_redundant_transfers' job
        # a target passed to forward() (move.unsupported): the example's says nothing of other calls'
        reason = move.unsupported or _guard(gm, node, source, constant, factory.kind if factory else None, before, after)
        if reason is not None:
            report.skip(node, reason)
            continue
        chain = _chain(source, constant)
        for check in [user for link in chain for user in link.users if is_metadata_check(user)]:
            gm.graph.erase_node(check)  # it checked the dtype and device the tensor had before
        change = _describe_change(before, after)
        if factory is not None:
            factory.create_on(move.device, move.dtype)
            report.rewrite(source, f"{describe(source)} created directly with the move's device and dtype{change}")
        else:
            assert isinstance(constant, fx.Node) and after is not None
            stored = get_attr(gm, str(constant.target)).to(device=after.device, dtype=after.dtype)
            set_attr(gm, str(constant.target), stored)
            report.rewrite(node, f"constant '{constant.target}' stored on {after.device} as {after.dtype}{change}: the move no longer copies")
            if not (isinstance(move.device, torch.device | None) and isinstance(move.dtype, torch.dtype | None)) or move.copy:
                continue  # the target is read from a tensor at run time: keep the (now no-op) move
        for link in chain:
            link.meta.update({key: node.meta[key] for key in ("val", "tensor_meta") if key in node.meta})
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
    return finish(gm, bool(report.rewrites), report)


def _guard(
    gm: fx.GraphModule, node: fx.Node, source: fx.Node, constant: object, kind: str | None,
    before: TensorValue | None, after: TensorValue | None,
) -> str | None:
    """Why the move at ``node`` cannot be folded into what created ``source``, or None."""
    move = transfer_view(gm, node)
    assert move is not None
    if move.memory_format not in (None, torch.preserve_format):
        return "the move also changes the memory format"
    others = [user for link in _chain(source, constant) for user in link.users if user is not node and user not in _chain(source, constant) and not is_metadata_check(user)]
    if others:
        return f"the created tensor is also used before the move (by {', '.join(u.name for u in others)})"
    if kind is not None:
        return _factory_guard(source, kind, before, after)
    assert isinstance(constant, fx.Node)
    if is_model_state(gm, constant):
        return f"'{constant.target}' is a parameter or buffer: move the model with .to(device) instead"
    if len(constant.users) > 1 or len(gm.graph.find_nodes(op="get_attr", target=constant.target)) > 1:
        return f"constant '{constant.target}' is also read elsewhere"
    return None


# what torch.export puts between a stored constant and its use (torch.tensor([...]) copies the constant, then detaches it)
_CONSTANT_COPIES = (aten.lift_fresh_copy.default, aten.detach.default, aten.detach_.default)


def _constant_read_by(source: fx.Node) -> fx.Node | None:
    """The get_attr node of the tensor constant ``source`` is (or copies), else None."""
    while source.target in _CONSTANT_COPIES:
        source = source.args[0]  # type: ignore[assignment]
    return source if source.op == "get_attr" else None


def _chain(source: fx.Node, constant: fx.Node | None) -> list[fx.Node]:
    """``source`` and the nodes between it and ``constant`` (only ``source`` for a factory)."""
    chain = [source]
    while constant is not None and chain[-1] is not constant:
        chain.append(chain[-1].args[0])  # type: ignore[arg-type]
    return chain


def _exact_integers(factory: fx.Node, dtype: torch.dtype) -> bool:
    """Whether ``factory``'s arguments are integers that ``dtype`` represents exactly (arange(n) cast to a float)."""
    numbers = [arg for arg in factory.args if not isinstance(arg, list | tuple)]
    if not numbers or not all(type(arg) is int for arg in numbers) or dtype.is_complex or dtype == torch.bool:
        return False
    limit = int(2 / torch.finfo(dtype).eps) if dtype.is_floating_point else torch.iinfo(dtype).max
    return all(abs(arg) <= limit for arg in numbers)


def _factory_guard(factory: fx.Node, kind: str, before: TensorValue | None, after: TensorValue | None) -> str | None:
    if kind == "fill":
        return None
    if before is None or after is None:
        return f"{kind} factory whose device and dtype on the example inputs are unknown"
    if kind == "random" and before != after:
        return (
            f"random factory moved{_describe_change(before, after)}: drawing on the target device or in the target dtype "
            "gives other numbers (same distribution); create it there yourself if that is acceptable"
        )
    if kind == "sequence" and before.dtype != after.dtype and not _exact_integers(factory, after.dtype):
        return f"arange/linspace cast{_describe_change(before, after)}: computing it in the target dtype may round differently"
    return None

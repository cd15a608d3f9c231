"""What the device and data-movement passes need to know about a graph's values.

- `example_values`: the dtype and device of every tensor value when the graph runs on
  the example inputs (the device the model is optimized for);
- `fixed_devices`: which values stay on one device whatever the inputs' device
  (constants, factories without a reference tensor, moves to a named device), as
  opposed to values that follow the inputs and parameters when the module is moved;
- `written_or_returned`: whether a value, or a view of it, is written in place or
  leaves the graph (removing a copy would then let two tensors share memory);
- `source_line`: the line of the model's code a node came from.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt.ops import called_module, factory_view, get_attr, is_metadata_check, record, transfer_view, writes_in_place


@dataclass(frozen=True)
class TensorValue:
    dtype: torch.dtype
    device: torch.device


def example_values(gm: fx.GraphModule, args: tuple[Any, ...]) -> dict[fx.Node, TensorValue]:
    """Dtype and device of each tensor-valued node when ``gm`` runs on ``args`` (empty when it cannot run)."""
    values: dict[fx.Node, TensorValue] = {}

    def keep_tensor_value(node: fx.Node, result: Any, _: Mapping[fx.Node, Any]) -> None:
        if isinstance(result, torch.Tensor):
            values[node] = TensorValue(result.dtype, result.device)

    if args:
        record(gm, args, keep_tensor_value)
    return values


def _is_parameter_or_buffer(gm: fx.GraphModule, target: str) -> bool:
    return id(get_attr(gm, target)) in {id(t) for t in [*gm.parameters(), *gm.buffers()]}


def is_model_state(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` reads one of the model's parameters or buffers, not a constant the capture made.

    symbolic_trace stores the tensors forward() creates from constants as buffers named
    ``_tensor_constant<i>``; torch.export stores them as plain attributes.
    """
    if node.op != "get_attr":
        return False
    target = str(node.target)
    return _is_parameter_or_buffer(gm, target) and not target.rpartition(".")[2].startswith("_tensor_constant")


def fixed_devices(gm: fx.GraphModule) -> set[fx.Node]:
    """The values whose device does not follow the graph's inputs and parameters."""
    fixed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        move = transfer_view(gm, node)
        factory = factory_view(gm, node)
        if node.op == "get_attr":
            # buffers (symbolic_trace's constants too) follow module.to(); torch.export's constants do not
            is_fixed = isinstance(get_attr(gm, str(node.target)), torch.Tensor) and not _is_parameter_or_buffer(gm, str(node.target))
        elif move is not None and move.device is not None:
            is_fixed = isinstance(move.device, torch.device) or move.device in fixed
        elif factory is not None:
            device = node.kwargs.get("device")
            reference = next(iter(node.all_input_nodes), None)
            if isinstance(device, fx.Node):
                is_fixed = device.args[0] in fixed if device.target is getattr else True
            else:
                is_fixed = device is not None or reference is None or reference in fixed
        elif node.op in ("placeholder", "call_module", "output"):
            is_fixed = False
        else:
            inputs = node.all_input_nodes
            is_fixed = bool(inputs) and all(i in fixed for i in inputs)
        if is_fixed:
            fixed.add(node)
    return fixed


_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose", "t", "squeeze",
    "unsqueeze", "expand", "expand_as", "narrow", "select", "unbind", "split", "chunk", "contiguous", "detach",
    "movedim", "as_strided", "to", "type_as", "float", "double", "half", "bfloat16", "long", "int", "cpu", "cuda",
    "__getitem__",
}
_VIEW_FUNCTIONS = {
    operator.getitem, torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
    torch.narrow, torch.select, torch.split, torch.chunk, torch.unbind, torch.t, torch.movedim, torch.detach,
    torch.as_tensor,
}


def _may_alias_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s result may share memory with its first input (a view, an alias, a no-op move)."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_module":
        return isinstance(called_module(gm, node), (nn.Identity, nn.Flatten))
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in node.target._schema.returns)
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


def written_or_returned(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Why ``node``'s memory must not be shared: a view of it is written in place or returned; else None."""
    pending, seen = [node], set()
    while pending:
        value = pending.pop()
        if value in seen:
            continue
        seen.add(value)
        for user in value.users:
            if user.op == "output":
                return f"{value.name} is returned by the model"
            if writes_in_place(gm, user) and user.args and user.args[0] is value:
                return f"{value.name} is written in place by {user.name}"
            if _may_alias_input(gm, user):
                pending.append(user)
    return None


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)')
TORCH_DIR = os.path.dirname(torch.__file__)


def source_line(node: fx.Node) -> str | None:
    """``file.py:12: y = x.sum().item()``: the innermost line of the model's own code that made ``node``."""
    frames = [f for f in _FRAME.findall(node.meta.get("stack_trace") or "") if not f[0].startswith(TORCH_DIR)]
    if not frames:
        return None
    path, line, code = frames[-1]
    return f"{os.path.basename(path)}:{line}: {code.strip()}"


def drop_unread_metadata_checks(gm: fx.GraphModule) -> None:
    """Erase torch.export's dtype/device checks on values nothing else reads (they would keep them alive)."""
    for node in list(gm.graph.nodes):
        if is_metadata_check(node) and all(is_metadata_check(user) for user in node.args[0].users):  # type: ignore[union-attr]
            gm.graph.erase_node(node)

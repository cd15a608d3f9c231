"""The parts of hand-written attention: matmuls, softmax (`SoftmaxView`), a transpose of the last two dims."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops.arguments import call_arguments
from graphopt.ops.graph import called_module, is_call_to
from graphopt.ops.layout import is_permute, permute_dims

aten = torch.ops.aten

_MATMUL_METHODS = {"matmul", "bmm"}
_MATMUL_TARGETS = {operator.matmul, torch.matmul, torch.bmm, aten.matmul.default, aten.bmm.default}
# softmax target -> the op that names its arguments (None: the target itself; torch.softmax has no Python signature).
# F.softmax has a _stacklevel before dtype, aten._softmax a half_to_float flag.
_SOFTMAX_FUNCTIONS: dict[Any, Any] = {
    F.softmax: None,
    torch.softmax: aten.softmax.int,
    aten.softmax.int: None,
    aten._softmax.default: None,
}


def matmul_operands(gm: nn.Module, node: fx.Node) -> tuple[Any, Any] | None:
    """The two operands of a matmul/bmm (``a @ b``, ``torch.matmul``, ``aten.bmm``, ...), else None."""
    if len(node.args) != 2 or node.kwargs or not is_call_to(gm, node, _MATMUL_METHODS, _MATMUL_TARGETS):
        return None
    return node.args[0], node.args[1]


@dataclass
class SoftmaxView:
    """A softmax in any form, with the dimension it normalises (None: implicit) and its dtype argument."""

    node: fx.Node
    input: Any
    dim: int | None
    dtype: Any  # a dtype argument (or aten._softmax's half_to_float) that changes the result's dtype
    unsupported: str | None = None  # why it cannot be rewritten: its dim or dtype is a graph value


def softmax_view(gm: fx.GraphModule, node: fx.Node) -> SoftmaxView | None:
    """View of a softmax node (nn.Softmax, ``x.softmax``, F.softmax, ATen), else None."""
    if node.op == "call_module":
        module = called_module(gm, node)
        if type(module) is not nn.Softmax:
            return None
        return SoftmaxView(node, node.args[0], module.dim, None)
    if node.op == "call_method" and node.target == "softmax":
        arguments = call_arguments(node, aten.softmax.int)
    elif node.op == "call_function" and node.target in _SOFTMAX_FUNCTIONS:
        arguments = call_arguments(node, _SOFTMAX_FUNCTIONS[node.target])
    else:
        return None
    dtype = arguments.get("half_to_float") if "half_to_float" in arguments.names else arguments.get("dtype")
    return SoftmaxView(node, node.args[0], arguments.get("dim"), dtype or None, arguments.not_constant("dim", "dtype", "half_to_float"))


def swapped_last_dims_input(gm: nn.Module, node: fx.Node, rank: int) -> Any:
    """The input of a transpose/permute that swaps the last two dims of a rank-``rank`` tensor, else None."""
    if not is_permute(gm, node) or node.kwargs:
        return None
    method = node.op == "call_method" and node.target
    if method == "transpose" or node.target in (torch.transpose, aten.transpose.int):
        if not all(isinstance(d, int) for d in node.args[1:]):
            return None  # dims that are graph values (forward() arguments) are unknown until run time
        dims = sorted(d % rank for d in node.args[1:])
        return node.args[0] if dims == [rank - 2, rank - 1] else None
    if permute_dims(node) == [*range(rank - 2), rank - 1, rank - 2]:
        return node.args[0]
    return None

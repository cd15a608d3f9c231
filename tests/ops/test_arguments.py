"""Arguments: a call's arguments by name, positional or keyword, and the names read from the op."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt import ops
from tests.ops.helpers import only_view, placeholder

aten = torch.ops.aten


class PositionalAndKeywordConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 2, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, None, 1, padding=1)


CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def test_arguments_get_reads_positional_keyword_and_default_values() -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(PositionalAndKeywordConv())
    node = only_view(gm, ops.weighted_op_view).node
    assert node.args[3] == 1 and node.kwargs == {"padding": 1}  # the premise of this test
    arguments = ops.Arguments(node, CONV_NAMES, {"dilation": 1, "groups": 1})
    assert arguments.get("input") is placeholder(gm)
    assert arguments.get("weight").op == "get_attr"
    assert arguments.get("bias") is None
    assert arguments.get("stride") == 1
    assert arguments.get("padding") == 1
    assert arguments.get("dilation") == 1
    assert arguments.get("groups") == 1
    with pytest.raises(ValueError):
        arguments.get("no_such_argument")


def test_arguments_set_writes_positional_and_keyword_values() -> None:
    torch.manual_seed(0)
    model = PositionalAndKeywordConv()
    gm = fx.symbolic_trace(model)
    node = only_view(gm, ops.weighted_op_view).node
    arguments = ops.Arguments(node, CONV_NAMES, {"dilation": 1, "groups": 1})

    arguments.set("stride", 2)  # positional
    arguments.set("padding", 2)  # already a keyword
    arguments.set("dilation", 2)  # absent: becomes a keyword
    assert node.args[3] == 2 and len(node.args) == 4
    assert node.kwargs == {"padding": 2, "dilation": 2}
    assert (arguments.get("stride"), arguments.get("padding"), arguments.get("dilation")) == (2, 2, 2)

    gm.recompile()
    x = torch.randn(1, 2, 7, 7)
    torch.testing.assert_close(gm(x), F.conv2d(x, model.weight, None, 2, 2, 2))


def test_argument_names_come_from_the_schema_or_the_signature() -> None:
    assert ops.argument_names(aten.conv2d.default) == CONV_NAMES
    assert ops.argument_names(F.hardtanh) == ("input", "min_val", "max_val", "inplace")
    assert ops.argument_names(torch.relu) == ()  # written in C: no Python signature


def test_call_arguments_take_the_defaults_the_op_declares() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    softmax = graph.call_function(F.softmax, (x,), {"dim": 1})
    batch_norm = graph.call_function(torch.batch_norm, (x, None, None, None, None, False, 0.1, 1e-3, False))
    assert ops.call_arguments(softmax).get("_stacklevel") == 3  # F.softmax's signature
    assert ops.call_arguments(softmax).get("dim") == 1
    assert ops.call_arguments(batch_norm, aten.batch_norm.default).get("eps") == 1e-3  # named by the ATen schema


# --------------------------------------------------------------------------- constants that are graph values

NOT_READABLE = "not a constant: graphopt cannot read it when optimizing"


class GraphValuedConv(nn.Module):
    """F.conv2d with its stride passed to forward() (inside a tuple) and its padding computed from the input's size."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 2, 3, 3))

    def forward(self, x: torch.Tensor, stride: int) -> torch.Tensor:
        return F.conv2d(x, self.weight, None, (stride, stride), x.shape[-1] // 8, 1)


def test_not_constant_names_the_first_argument_that_is_a_graph_value_and_where_it_comes_from() -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(GraphValuedConv())
    arguments = ops.Arguments(only_view(gm, ops.weighted_op_view).node, CONV_NAMES, {"groups": 1})
    assert arguments.not_constant("dilation", "groups") is None  # a constant and a default
    assert arguments.not_constant("no_such_argument") is None  # names the op does not take are ignored
    assert arguments.not_constant("dilation", "stride", "padding") == f"the stride argument of 'conv2d' is forward() argument 'stride', {NOT_READABLE}"
    assert arguments.not_constant("padding") == f"the padding argument of 'conv2d' is computed in the graph ('floordiv'), {NOT_READABLE}"

"""dropout_view: dropouts and identities in all three forms, active or not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt import ops
from tests.ops.helpers import Wrap, export_module, only_view, placeholder

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("layer", "training", "active", "kind"),
    [
        (nn.Dropout(0.1), False, False, "Dropout"),
        (nn.Dropout(0.1), True, True, "Dropout"),
        (nn.Dropout(0.0), True, False, "Dropout"),
        (nn.Dropout2d(0.2), False, False, "Dropout2d"),
        (nn.Dropout2d(0.2), True, True, "Dropout2d"),
        (nn.AlphaDropout(0.2), False, False, "AlphaDropout"),
        (nn.AlphaDropout(0.2), True, True, "AlphaDropout"),
        (nn.Identity(), False, False, "identity"),
        (nn.Identity(), True, False, "identity"),
    ],
    ids=lambda value: str(value).replace(" ", ""),
)
def test_dropout_view_module_form(layer: nn.Module, training: bool, active: bool, kind: str) -> None:
    gm = fx.symbolic_trace(Wrap(layer).train(training))
    view = only_view(gm, ops.dropout_view)
    assert view.form == "module"
    assert view.active is active
    assert view.kind == kind
    assert view.input is placeholder(gm)


class FunctionalDropout(nn.Module):
    def __init__(self, call: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)


@pytest.mark.parametrize(
    ("call", "active"),
    [
        pytest.param(lambda x: F.dropout(x, 0.1, training=False), False, id="training=False"),
        pytest.param(lambda x: F.dropout(x, 0.1), True, id="default_training"),
        pytest.param(lambda x: F.dropout(x, p=0.1, training=True), True, id="training=True"),
        pytest.param(lambda x: F.dropout(x, 0.0), False, id="p=0"),
        pytest.param(lambda x: F.dropout2d(x, 0.3, False), False, id="dropout2d_positional_false"),
        pytest.param(lambda x: F.alpha_dropout(x, 0.3, True), True, id="alpha_dropout_positional_true"),
    ],
)
def test_dropout_view_function_form(call: Callable[[torch.Tensor], torch.Tensor], active: bool) -> None:
    gm = fx.symbolic_trace(FunctionalDropout(call))
    view = only_view(gm, ops.dropout_view)
    assert view.form == "function"
    assert view.active is active
    assert view.input is placeholder(gm)


@pytest.mark.parametrize(
    ("args", "kwargs", "active"),
    [
        ((0.1,), {}, True),
        ((0.1, False), {}, False),
        ((), {"p": 0.1}, True),
        ((), {}, True),
        ((0.1,), {"training": False}, False),
    ],
    ids=["p_only", "positional_false", "keyword_p", "no_arguments", "keyword_false"],
)
def test_dropout_view_applies_functional_defaults_to_hand_built_nodes(args: tuple[Any, ...], kwargs: dict[str, Any], active: bool) -> None:
    """A pass may build ``F.dropout(x, 0.1)`` itself; omitted arguments take F.dropout's defaults (training=True)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(F.dropout, (x, *args), kwargs))
    gm = fx.GraphModule(nn.Module(), graph)
    assert only_view(gm, ops.dropout_view).active is active


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_dropout_view_aten_form(training: bool) -> None:
    gm = export_module(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).train(training), torch.randn(2, 4))
    view = only_view(gm, ops.dropout_view)
    assert view.form == "aten"
    assert view.node.target is aten.dropout.default
    assert view.active is training
    assert ops.weighted_op_view(gm, view.input) is not None  # the dropout reads the linear


def test_dropout_view_aten_form_keeps_functional_training_flag_of_an_eval_model() -> None:
    """F.dropout defaults to training=True, whatever the module's mode: export bakes it in."""
    gm = export_module(FunctionalDropout(lambda x: F.dropout(x, 0.1)).eval(), torch.randn(2, 4))
    view = only_view(gm, ops.dropout_view)
    assert view.active is True


class GraphValuedDropout(nn.Module):
    """``call(x, value)``: a dropout whose p or training flag is passed to forward() (fx keeps it a placeholder)."""

    def __init__(self, call: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        super().__init__()
        self.call = call

    def forward(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        return self.call(x, value)


@pytest.mark.parametrize(
    ("call", "active", "unknown"),
    [
        pytest.param(lambda x, p: F.dropout(x, p, training=True), True, "p", id="p"),
        pytest.param(lambda x, t: F.dropout(x, 0.5, training=t), True, "training", id="training"),
        pytest.param(lambda x, t: torch.dropout(x, 0.5, t), True, "train", id="torch.dropout_train"),
        pytest.param(lambda x, p: F.dropout(x, p, training=False), False, None, id="inactive_whatever_p"),
        pytest.param(lambda x, t: F.dropout(x, 0.0, training=t), False, None, id="p=0_whatever_the_flag"),
    ],
)
def test_dropout_view_with_a_graph_valued_argument(call: Callable[[torch.Tensor, Any], torch.Tensor], active: bool, unknown: str | None) -> None:
    """Active unless a constant says otherwise; ``unsupported`` names the graph value it depends on."""
    view = only_view(fx.symbolic_trace(GraphValuedDropout(call)), ops.dropout_view)
    assert view.active is active
    expected = f"the {unknown} argument of '{view.node.name}' is forward() argument 'value', not a constant: graphopt cannot read it when optimizing"
    assert view.unsupported == (None if unknown is None else expected)

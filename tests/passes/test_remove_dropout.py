"""remove_dropout: every dropout flavour and identity removed in eval graphs; active ones kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops import dropout_view
from graphopt.passes.remove_dropout import remove_dropout
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context

MODULES = {
    "Dropout": lambda: nn.Dropout(0.5),
    "Dropout2d": lambda: nn.Dropout2d(0.5),
    "AlphaDropout": lambda: nn.AlphaDropout(0.5),
    "FeatureAlphaDropout": lambda: nn.FeatureAlphaDropout(0.5),
    "Identity": nn.Identity,
    "inplace Dropout": lambda: nn.Dropout(0.5, inplace=True),
}


def dropouts(gm) -> list:
    return [node for node in gm.graph.nodes if dropout_view(gm, node) is not None]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("kind", MODULES)
def test_removes_inactive_dropout_modules(kind: str, frontend: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), MODULES[kind](), nn.ReLU()).eval()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, frontend)
    had_node = bool(dropouts(gm))  # export already drops identities
    result = remove_dropout(gm, context(inputs))
    assert dropouts(gm) == []
    assert len(result.report.rewrites) == int(had_node) and result.modified is had_node
    assert_same_outputs(model, gm, inputs)


class FunctionalDropout(nn.Module):
    def __init__(self, **dropout_kwargs) -> None:
        super().__init__()
        self.kwargs = dropout_kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x.relu(), **self.kwargs) * 2


@pytest.mark.parametrize("kwargs", [{"p": 0.3, "training": False}, {"p": 0.0}], ids=["training=False", "p=0"])
def test_removes_inactive_functional_dropout(kwargs: dict) -> None:
    model = FunctionalDropout(**kwargs).eval()
    inputs = (torch.randn(4, 5),)
    gm = captured(model, inputs, "fx")
    assert len(remove_dropout(gm, context(inputs)).report.rewrites) == 1
    assert dropouts(gm) == []
    assert_same_outputs(model, gm, inputs)


def test_guard_functional_dropout_active_in_eval_model() -> None:
    # F.dropout defaults to training=True: Monte-Carlo dropout stays random in eval mode
    model = FunctionalDropout(p=0.3).eval()
    inputs = (torch.randn(4, 5),)
    gm = captured(model, inputs, "fx")
    report = remove_dropout(gm, context(inputs)).report
    assert report.rewrites == [] and "active" in report.skips[0].reason
    assert len(dropouts(gm)) == 1


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_dropout_in_training_graph(frontend: str) -> None:
    model = nn.Sequential(nn.Linear(5, 5), nn.Dropout(0.5)).train()
    inputs = (torch.randn(4, 5),)
    gm = captured(model, inputs, frontend)
    report = remove_dropout(gm, context(inputs)).report
    assert report.rewrites == [] and "active" in report.skips[0].reason

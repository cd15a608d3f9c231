"""ParameterUsage: tied parameters, modules called twice and weights read by two ops are reported."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt import ops
from tests.ops.helpers import FORMS, build_weighted, export_module, graph_in, views


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.conv(x))


class TiedConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class FunctionalWeightReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.conv2d(x, self.w, padding=1), self.w, padding=1)


class TwoConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def sharing_messages(gm: fx.GraphModule) -> list[str | None]:
    usage = ops.ParameterUsage(gm)
    return [usage.sharing(view) for view in views(gm, ops.weighted_op_view)]


def test_sharing_reports_a_module_called_twice() -> None:
    messages = sharing_messages(fx.symbolic_trace(CalledTwice()))
    assert len(messages) == 2
    assert all(m is not None and "'conv'" in m and "called at 2 places" in m for m in messages)


def test_sharing_reports_tied_weights() -> None:
    messages = sharing_messages(fx.symbolic_trace(TiedConvs()))
    assert len(messages) == 2
    assert messages[0] is not None and "tied" in messages[0] and "b.weight" in messages[0]
    assert messages[1] is not None and "tied" in messages[1] and "a.weight" in messages[1]


def test_sharing_reports_a_functional_weight_read_by_two_ops() -> None:
    messages = sharing_messages(fx.symbolic_trace(FunctionalWeightReadTwice()))
    assert len(messages) == 2
    assert all(m is not None and "'w'" in m and "also read by another op" in m for m in messages)


@pytest.mark.parametrize("model_class", [CalledTwice, TiedConvs, FunctionalWeightReadTwice])
def test_sharing_is_reported_in_aten_form(model_class: type[nn.Module]) -> None:
    torch.manual_seed(0)
    messages = sharing_messages(export_module(model_class(), torch.randn(1, 4, 5, 5)))
    assert len(messages) == 2 and all(messages), messages


@pytest.mark.parametrize("form", FORMS)
def test_sharing_is_none_for_ordinary_layers(form: str) -> None:
    torch.manual_seed(0)
    if form == "function":
        _, gm, _, _ = build_weighted("conv2d", "function", bias=True)
    else:
        model = TwoConvs()
        gm = graph_in(form, model, torch.randn(1, 4, 5, 5))
    messages = sharing_messages(gm)
    assert messages and messages == [None] * len(messages)


def test_is_shared_distinguishes_tied_from_own_parameters() -> None:
    gm = fx.symbolic_trace(TiedConvs())
    usage = ops.ParameterUsage(gm)
    assert usage.is_shared(gm.a.weight)
    assert not usage.is_shared(gm.a.bias)

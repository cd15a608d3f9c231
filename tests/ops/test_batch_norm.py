"""batch_norm_view: BatchNorm modules, F.batch_norm and the ATen forms, with statistics and affine parameters."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt import ops
from tests.ops.helpers import Wrap, export_module, only_view, placeholder

aten = torch.ops.aten

BN_CASES = {
    "bn1d": (lambda **kw: nn.BatchNorm1d(4, **kw), (3, 4, 5)),
    "bn1d_2d_input": (lambda **kw: nn.BatchNorm1d(4, **kw), (3, 4)),
    "bn2d": (lambda **kw: nn.BatchNorm2d(4, **kw), (3, 4, 3, 3)),
    "bn3d": (lambda **kw: nn.BatchNorm3d(4, **kw), (3, 4, 2, 2, 2)),
}


def with_statistics(bn: nn.Module) -> nn.Module:
    """Give a BatchNorm non-trivial statistics and affine parameters, so identity checks mean something."""
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.copy_(torch.randn(bn.num_features))
            bn.running_var.copy_(torch.rand(bn.num_features) + 0.5)
        if bn.weight is not None:
            bn.weight.copy_(torch.randn(bn.num_features))
            bn.bias.copy_(torch.randn(bn.num_features))
    return bn


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", list(BN_CASES))
def test_batch_norm_view_module_form(case: str, training: bool) -> None:
    torch.manual_seed(0)
    factory, _ = BN_CASES[case]
    bn = with_statistics(factory(eps=1e-3))
    gm = fx.symbolic_trace(Wrap(bn).train(training))
    view = only_view(gm, ops.batch_norm_view)

    assert view.form == "module"
    assert view.module is bn
    assert view.training is training
    assert view.eps == pytest.approx(1e-3)
    assert view.num_features == 4
    assert view.input is placeholder(gm)
    assert view.output is view.node
    assert view.weight is bn.weight and view.bias is bn.bias
    assert view.running_mean is bn.running_mean and view.running_var is bn.running_var
    assert view.running_mean_target == "layer.running_mean"
    assert ops.get_attr(gm, view.running_mean_target) is bn.running_mean
    assert view.running_mean is not None
    assert view.unsupported is None


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_batch_norm_without_running_stats_always_uses_batch_statistics(training: bool) -> None:
    gm = fx.symbolic_trace(Wrap(nn.BatchNorm2d(4, track_running_stats=False)).train(training))
    view = only_view(gm, ops.batch_norm_view)
    assert view.training is True
    assert view.running_mean is None and view.running_var is None and view.running_mean_target is None
    assert view.running_mean is None


def test_batch_norm_without_affine_parameters() -> None:
    gm = fx.symbolic_trace(Wrap(nn.BatchNorm2d(4, affine=False)).eval())
    view = only_view(gm, ops.batch_norm_view)
    assert view.weight is None and view.bias is None
    assert view.training is False and view.running_mean is not None


class FunctionalBatchNorm(nn.Module):
    def __init__(self, training: bool, affine: bool = True) -> None:
        super().__init__()
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)
        self.gamma = nn.Parameter(torch.randn(4)) if affine else None
        self.beta = nn.Parameter(torch.randn(4)) if affine else None
        self.use_batch_stats = training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, self.gamma, self.beta, training=self.use_batch_stats, eps=1e-4)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_batch_norm_view_function_form(training: bool) -> None:
    torch.manual_seed(0)
    model = FunctionalBatchNorm(training)
    gm = fx.symbolic_trace(model)
    view = only_view(gm, ops.batch_norm_view)

    assert view.form == "function"
    assert view.training is training
    assert view.eps == pytest.approx(1e-4)
    assert view.num_features == 4
    assert view.running_mean is model.mean and view.running_var is model.var
    assert view.running_mean_target == "mean"
    assert view.weight is model.gamma and view.bias is model.beta
    assert view.output is view.node and view.input is placeholder(gm)
    assert view.running_mean is not None
    assert view.unsupported is None


def test_batch_norm_view_function_form_without_affine() -> None:
    gm = fx.symbolic_trace(FunctionalBatchNorm(training=False, affine=False))
    view = only_view(gm, ops.batch_norm_view)
    assert view.weight is None and view.bias is None and view.unsupported is None


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_batch_norm_view_aten_form(training: bool) -> None:
    torch.manual_seed(0)
    bn = with_statistics(nn.BatchNorm2d(4, eps=1e-3))
    model = Wrap(bn).train(training)
    expected_mean, expected_var = bn.running_mean.clone(), bn.running_var.clone()
    gm = export_module(model, torch.randn(3, 4, 3, 3))
    view = only_view(gm, ops.batch_norm_view)

    assert view.form == "aten"
    assert view.node.target is aten.batch_norm.default
    assert view.training is training
    assert view.eps == pytest.approx(1e-3)
    assert view.num_features == 4
    torch.testing.assert_close(view.running_mean, expected_mean, rtol=0, atol=0)
    torch.testing.assert_close(view.running_var, expected_var, rtol=0, atol=0)
    torch.testing.assert_close(view.weight, bn.weight, rtol=0, atol=0)
    torch.testing.assert_close(view.bias, bn.bias, rtol=0, atol=0)
    assert ops.get_attr(gm, view.running_mean_target) is view.running_mean
    assert view.output is view.node and view.input is placeholder(gm)
    assert view.running_mean is not None
    assert view.unsupported is None


def test_batch_norm_view_aten_form_without_running_stats() -> None:
    gm = export_module(Wrap(nn.BatchNorm2d(4, track_running_stats=False)).eval(), torch.randn(3, 4, 3, 3))
    view = only_view(gm, ops.batch_norm_view)
    assert view.training is True
    assert view.running_mean is None and view.num_features is None


def test_batch_norm_view_decomposed_aten_form_points_at_the_result_item() -> None:
    torch.manual_seed(0)
    bn = with_statistics(nn.BatchNorm2d(4, eps=1e-3))
    gm = torch.export.export(Wrap(bn).eval(), (torch.randn(3, 4, 3, 3),)).run_decompositions().module()
    view = only_view(gm, ops.batch_norm_view)
    assert view.node.target is aten._native_batch_norm_legit_no_training.default
    assert view.training is False and view.eps == pytest.approx(1e-3) and view.num_features == 4
    # the op returns a tuple: the normalised tensor is the getitem(…, 0) that reads it
    assert view.output is not view.node
    assert view.output.target is operator.getitem and view.output.args == (view.node, 0)
    torch.testing.assert_close(view.running_var, bn.running_var, rtol=0, atol=0)


class GraphValuedBatchNorm(nn.Module):
    """F.batch_norm with one argument (eps, training or momentum) passed to forward(): fx keeps it a placeholder."""

    def __init__(self, argument: str) -> None:
        super().__init__()
        self.argument = argument
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        arguments = {"training": False, "momentum": 0.1, "eps": 1e-4, self.argument: value}
        return F.batch_norm(x, self.mean, self.var, **arguments)


@pytest.mark.parametrize("argument", ["eps", "training"])
def test_batch_norm_view_with_a_graph_valued_eps_or_training_flag_is_unsupported(argument: str) -> None:
    view = only_view(fx.symbolic_trace(GraphValuedBatchNorm(argument)), ops.batch_norm_view)
    assert view.unsupported == f"the {argument} argument of 'batch_norm' is forward() argument 'value', not a constant: graphopt cannot read it when optimizing"
    assert view.training is (argument == "training")  # an unknown flag reads as batch statistics, which no pass folds
    assert view.eps is None if argument == "eps" else view.eps == pytest.approx(1e-4)


def test_batch_norm_view_does_not_need_momentum() -> None:
    """Folding ignores momentum and a dropped bias stays exact under any: a graph-valued momentum blocks nothing."""
    view = only_view(fx.symbolic_trace(GraphValuedBatchNorm("momentum")), ops.batch_norm_view)
    assert view.unsupported is None
    assert view.training is False and view.eps == pytest.approx(1e-4)

"""fold_channel_scale: structure, numerics, checkpoints and every guard, in module, functional and ATen form."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.checkpoint import FoldedScale
from graphopt.ops import arithmetic_operands
from graphopt.passes.fold_channel_scale import fold_channel_scale
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context


def muls(gm) -> list:
    return [node for node in gm.graph.nodes if arithmetic_operands(gm, node, "mul") is not None]


def fold_and_check(model: nn.Module, inputs: tuple, frontend: str, folded: int):
    """Fold, then assert the rewrite count, that the multiplies went and that outputs match the eager model (`assert_same_outputs`)."""
    model = model.eval()
    gm = captured(model, inputs, frontend)
    before = len(muls(gm))
    result = fold_channel_scale(gm, context(inputs))
    assert result.modified is (folded > 0)
    assert len(result.report.rewrites) == folded
    assert len(muls(gm)) == before - folded
    assert_same_outputs(model, gm, inputs)
    return gm, result.report


class ConvNeXtBlockTail(nn.Module):
    """ConvNeXt's block: linear in channels-last order, permuted back, times a (C, 1, 1) layer scale, plus the input."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6, bias=bias)
        self.layer_scale = nn.Parameter(torch.rand(6, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.permute(self.linear(x.permute(0, 2, 3, 1)), [0, 3, 1, 2])
        return self.layer_scale * y + x


class LayerScale(nn.Module):
    """CaiT/DeiT-III style: ``x * gamma`` right after a linear, gamma of shape (C,)."""

    def __init__(self, gamma_shape: tuple[int, ...] = (6,)) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.gamma = nn.Parameter(torch.rand(gamma_shape) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.gamma


class ConvScale(nn.Module):
    def __init__(self, scale: torch.Tensor, bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, bias=bias)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.scale * self.conv(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_folds_convnext_layer_scale_through_permutes(frontend: str, bias: bool) -> None:
    model = ConvNeXtBlockTail(bias)
    gm, report = fold_and_check(model, (torch.randn(2, 6, 5, 5),), frontend, folded=1)
    assert "layer_scale" not in dict(gm.named_parameters())
    linear_weight = next(value for name, value in gm.state_dict().items() if name.endswith("weight"))
    torch.testing.assert_close(linear_weight, model.linear.weight * model.layer_scale.reshape(6, 1))
    (change,) = report.state_changes
    assert change.shape == (6, 1, 1) and (change.bias is not None) == bias


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_folds_a_scale_right_after_a_linear(frontend: str) -> None:
    fold_and_check(LayerScale(), (torch.randn(3, 5, 4),), frontend, folded=1)


@pytest.mark.parametrize("scale", [torch.rand(6, 1, 1) + 0.5, torch.rand(1, 6, 1, 1) + 0.5, torch.tensor(0.7), torch.full((1,), 0.7)], ids=["c11", "1c11", "scalar", "one"])
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_folds_conv_scales_of_every_broadcast_shape(scale: torch.Tensor, frontend: str) -> None:
    fold_and_check(ConvScale(scale), (torch.randn(2, 3, 7, 7),), frontend, folded=1)


class FunctionalLinearScale(nn.Module):
    """Weights on the module, used through F.linear; the scale multiplies from the right."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6))
        self.gamma = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mul(F.linear(x, self.weight, self.bias), self.gamma)


def test_folds_the_functional_form() -> None:
    gm, _ = fold_and_check(FunctionalLinearScale(), (torch.randn(3, 4),), "fx", folded=1)
    assert not hasattr(gm, "gamma")


def test_optimize_runs_it_by_default_and_checkpoints_go_both_ways() -> None:
    model, other = ConvNeXtBlockTail().eval(), ConvNeXtBlockTail().eval()
    inputs = (torch.randn(2, 6, 5, 5),)
    optimized = graphopt.optimize(model, inputs)
    assert len(optimized.graphopt_report["fold_channel_scale"].rewrites) == 1
    assert [type(change) for change in optimized.state_changes] == [FoldedScale]
    assert "layer_scale" in optimized.parameter_map

    optimized.load_original_state_dict(other.state_dict())
    assert_same_outputs(other, optimized, inputs)
    restored = ConvNeXtBlockTail().eval()
    restored.load_state_dict(optimized.original_state_dict())
    torch.testing.assert_close(restored.layer_scale, torch.ones(6, 1, 1))
    assert_same_outputs(other, restored, inputs)


def test_under_bf16_no_cast_is_left_around_the_folded_scale() -> None:
    model, inputs = ConvNeXtBlockTail().eval(), (torch.randn(2, 6, 5, 5),)
    kept = graphopt.optimize(model, inputs, precision="bf16", memory_format="preserve", disable=["fold_channel_scale"])
    folded = graphopt.optimize(model, inputs, precision="bf16", memory_format="preserve")
    casts = [node for node in folded.graph.nodes if node.op == "call_method" and node.target == "to"]
    kept_casts = [node for node in kept.graph.nodes if node.op == "call_method" and node.target == "to"]
    assert len(casts) < len(kept_casts)
    assert_same_outputs(model, folded, inputs, 3e-2)


class OutputReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.gamma = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y * self.gamma + y


class ScaleAlongRows(nn.Module):
    """A (C, 1) scale times a linear's (N, C) output varies along N, not the output features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.rand(3, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


class SharedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(4, 6)
        self.gamma = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.gamma + self.b(x) * self.gamma


class TransposedConvScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose2d(3, 6, 3)
        self.scale = nn.Parameter(torch.rand(6, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * self.scale


class TiedLinears(LayerScale):
    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(4, 6)
        self.other.weight = self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.other(x)


@pytest.mark.parametrize(
    ("model", "inputs", "reason"),
    [
        (OutputReadTwice(), (torch.randn(3, 4),), "also read elsewhere: its unscaled value is needed"),
        (ScaleAlongRows(), (torch.randn(3, 4),), "varies along more than the 3 output channels"),
        (SharedScale(), (torch.randn(3, 4),), "the scale gamma is also read elsewhere"),
        (TransposedConvScale(), (torch.randn(2, 3, 5, 5),), "transposed convolution"),
        (ConvScale(torch.rand(1, 1, 5, 5) + 0.5), (torch.randn(2, 3, 7, 7),), "varies along more than the 6 output channels"),
        (ConvScale(torch.rand(6, 1, 1, dtype=torch.float64)), (torch.randn(2, 3, 7, 7),), "not a stored torch.float32 tensor"),
        (TiedLinears(), (torch.randn(3, 4),), "tied to"),
    ],
    ids=["output-read-twice", "scale-along-rows", "shared-scale", "transposed", "spatial-scale", "float64-scale", "tied-weights"],
)
def test_guards_leave_the_multiply_with_the_reason(model: nn.Module, inputs: tuple, reason: str) -> None:
    gm, report = fold_and_check(model, inputs, "fx", folded=0)
    assert any(reason in skip.reason for skip in report.skips), [skip.reason for skip in report.skips]


def test_multiplies_of_other_values_are_not_candidates() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    gm = captured(model.eval(), (torch.randn(2, 4),), "fx")
    result = fold_channel_scale(gm, context((torch.randn(2, 4),)))
    assert not result.modified and not result.report.skips

"""pad_channels: odd conv/linear channel counts padded to multiples of 8, outputs exactly unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from graphopt.ops import weighted_op_view
from graphopt.passes.pad_channels import pad_channels
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context


def weight_shapes(gm) -> list[tuple[int, ...]]:
    return [tuple(view.weight.shape) for node in gm.graph.nodes if (view := weighted_op_view(gm, node)) is not None]


def pad_and_check(model: nn.Module, x: torch.Tensor, frontend: str):
    """Pad, then assert that outputs match the eager model (`assert_same_outputs`)."""
    model = model.eval()
    gm = captured(model, (x,), frontend)
    report = pad_channels(gm, context((x,))).report
    assert_same_outputs(model, gm, (x,), 1e-6)
    return gm, report


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("conv, shape", [(nn.Conv1d, (2, 3, 12)), (nn.Conv2d, (2, 3, 10, 10)), (nn.Conv3d, (2, 3, 6, 6, 6))])
def test_odd_conv_channels_are_padded_exactly(frontend: str, conv: type[nn.Module], shape: tuple[int, ...]) -> None:
    model = nn.Sequential(conv(3, 5, 3), nn.ReLU(), conv(5, 7, 3, bias=False), nn.GELU(), conv(7, 4, 1))
    gm, report = pad_and_check(model, torch.randn(shape), frontend)
    assert [s[:2] for s in weight_shapes(gm)] == [(8, 3), (8, 8), (4, 8)]
    assert [r.detail.split(" (")[0] for r in report.rewrites] == [f"conv{len(shape) - 2}d output channels 5 -> 8", f"conv{len(shape) - 2}d output channels 7 -> 8"]
    assert "returned by the model" in report.skips[0].reason  # 4 output channels: the model's output


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_odd_linear_features_are_padded_exactly(frontend: str) -> None:
    model = nn.Sequential(nn.Linear(6, 13), nn.Sigmoid(), nn.Linear(13, 11), nn.Linear(11, 3))
    gm, report = pad_and_check(model, torch.randn(4, 6), frontend)
    assert weight_shapes(gm) == [(16, 6), (16, 16), (3, 16)]
    assert len(report.rewrites) == 2
    if frontend == "fx":
        assert (gm.get_submodule("0").out_features, gm.get_submodule("2").in_features) == (16, 16)


def test_padded_model_keeps_working_on_other_image_sizes() -> None:
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.SiLU(), nn.Conv2d(5, 2, 3)).eval()
    gm, _ = pad_and_check(model, torch.randn(2, 3, 8, 8), "fx")
    assert_same_outputs(model, gm, (torch.randn(5, 3, 12, 12),), 1e-6)  # second inputs vary batch, values and strides, not this


# --------------------------------------------------------------------------- guards


def assert_left_alone(model: nn.Module, x: torch.Tensor, reason: str, frontend: str = "fx") -> None:
    gm, report = pad_and_check(model, x, frontend)
    before = [tuple(view.weight.shape) for node in captured(model, (x,), frontend).graph.nodes if (view := weighted_op_view(gm, node)) is not None]
    assert report.rewrites == [] and weight_shapes(gm) == before
    assert any(reason in skip.reason for skip in report.skips), report.skips


def test_guard_output_read_twice() -> None:
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 5, 3, padding=1), nn.Conv2d(5, 5, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x)
            return self.b(y) + y

    assert_left_alone(Branch(), torch.randn(2, 3, 6, 6), "has 2 users")


def test_guard_op_mixing_channels_in_between() -> None:
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 8, 3))
    assert_left_alone(model, torch.randn(2, 3, 8, 8), "not a per-element activation")


def test_guard_grouped_convolution() -> None:
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 6, 3, groups=3))
    assert_left_alone(model, torch.randn(2, 3, 8, 8), "groups=3")


def test_guard_transposed_convolution() -> None:
    model = nn.Sequential(nn.ConvTranspose2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 8, 3))
    assert_left_alone(model, torch.randn(2, 3, 8, 8), "transposed")


def test_guard_conv_feeding_a_linear() -> None:
    model = nn.Sequential(nn.Conv1d(3, 5, 1), nn.ReLU(), nn.Linear(4, 8))
    assert_left_alone(model, torch.randn(2, 3, 4), "conv1d feeds a linear")


def test_guard_module_called_twice() -> None:
    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 5), nn.Linear(5, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(self.second(self.first(x))))

    assert_left_alone(Reused(), torch.randn(2, 4), "called at 2 places")


def test_aligned_channels_are_left_alone() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3))
    _, report = pad_and_check(model, torch.randn(2, 3, 8, 8), "fx")
    assert report.rewrites == [] and report.skips == []

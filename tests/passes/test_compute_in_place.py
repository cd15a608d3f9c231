"""compute_in_place: structure, numerics and every aliasing guard, in function, method and ATen form."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.passes.compute_in_place import compute_in_place
from graphopt.tuning import onednn_passes
from tests.conftest import FRONTENDS, captured, context

IN_PLACE = {"add_", "mul_", "div_", torch.ops.aten.add_.Tensor, torch.ops.aten.mul_.Tensor, torch.ops.aten.div_.Tensor, torch.ops.aten.mul_.Scalar}


def in_place_ops(gm) -> list:
    return [node for node in gm.graph.nodes if node.target in IN_PLACE]


def rewrite(model: nn.Module, inputs: tuple, frontend: str, rewritten: int):
    """Run the pass; assert the rewrite count and that the outputs are exactly the original's (values and strides)."""
    model = model.eval()
    with torch.inference_mode():
        expected = model(*inputs)
    gm = captured(model, inputs, frontend)
    result = compute_in_place(gm, context(inputs))
    assert len(result.report.rewrites) == rewritten and len(in_place_ops(gm)) == rewritten
    with torch.inference_mode():
        actual = gm(*inputs)
    for want, got in zip(expected if isinstance(expected, tuple) else (expected,), actual if isinstance(actual, tuple) else (actual,)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.stride() == want.stride()
    return gm, result.report


class SqueezeExcitation(nn.Module):
    """EfficientNet's pattern: the conv output is read by the pool, then multiplied last."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return y * torch.sigmoid(self.fc(y.mean((2, 3), keepdim=True)))


class ReadLater(nn.Module):
    """``y * 2`` cannot write into ``y`` (the add reads it later); the add can write into ``y * 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return y * 2 + y


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_squeeze_excitation_multiply_writes_into_the_dead_activation(frontend: str) -> None:
    gm, report = rewrite(SqueezeExcitation(), (torch.randn(2, 3, 8, 8),), frontend, rewritten=1)
    assert "mul computed in place" in report.rewrites[0].detail


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_operand_read_later_is_not_written(frontend: str) -> None:
    _, report = rewrite(ReadLater(), (torch.randn(2, 4, 6, 6),), frontend, rewritten=1)
    (skip,) = report.skips
    assert "is read after this op" in skip.reason


class InputAndStored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2) + self.offset, x + self.offset


def test_inputs_stored_tensors_and_outputs_are_never_written() -> None:
    gm, report = rewrite(InputAndStored(), (torch.randn(3, 4),), "fx", rewritten=1)  # only x * 2 dies at its add
    reasons = " ".join(skip.reason for skip in report.skips)
    assert "not a value computed in the graph" in reasons


class ViewStillNeeded(nn.Module):
    """``y = a.view(...)`` is read after ``a * 3``: writing into ``a`` would change ``y``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x + 1
        y = a.view(-1)
        b = a * 3
        return b, y.sum()


class ViewOfDeadValue(nn.Module):
    """A permuted view of a value nothing else reads: writing through it is safe."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x)
        return a.permute(0, 2, 1) * 2


class Broadcast(nn.Module):
    """``small + big``: the result is larger than ``small``, and ``big`` is the model's input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True) + x


class Promotes(nn.Module):
    """An int tensor times a float: the result's dtype is not the operand's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1, keepdim=True) * 0.5


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        return a * a


@pytest.mark.parametrize(
    ("model", "rewritten", "reason"),
    [
        (ViewStillNeeded(), 0, "shares memory with"),
        (ViewOfDeadValue(), 1, None),
        (Broadcast(), 0, "does not have"),
        (Promotes(), 0, "does not have"),
        (Twice(), 0, "both operands are the same value"),
    ],
    ids=["view-still-needed", "view-of-dead-value", "broadcast", "promotes", "same-value"],
)
def test_aliasing_and_layout_guards(model: nn.Module, rewritten: int, reason: str | None) -> None:
    _, report = rewrite(model, (torch.randn(3, 4, 5),), "fx", rewritten=rewritten)
    if reason is not None:
        assert any(reason in skip.reason for skip in report.skips), [skip.reason for skip in report.skips]


def test_optimize_runs_it_last_and_keeps_onednn_residual_fusions() -> None:
    model = nn.Sequential(SqueezeExcitation(), nn.Conv2d(8, 8, 1)).eval()
    x = torch.randn(2, 3, 16, 16)
    asked_first = ["compute_in_place", *(name for name in onednn_passes("fp32", "channels_last") if name != "compute_in_place")]
    optimized = graphopt.optimize(model, (x,), memory_format="channels_last", passes=asked_first)
    assert [p.name for p in optimized.graphopt_report.passes][-2:] == ["use_onednn_kernels", "compute_in_place"]
    assert len(in_place_ops(optimized.graph_module)) == 1
    torch.testing.assert_close(optimized(x), model(x), rtol=1e-5, atol=1e-5)
    fused = graphopt.optimize(model, (x,), memory_format="channels_last", fuse="inductor")
    assert "compute_in_place" not in [p.name for p in fused.graphopt_report.passes], "with fuse= the compiler plans buffers"

"""Capture: frontends, the eager check, fallback with reasons, dynamic batch, no mutation."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.capture import capture_graph
from graphopt.verify import Check, Reference, run_reference
from tests.conftest import ShapeBranch


class ValueBranch(nn.Module):
    """Control flow on tensor values: neither frontend can capture it as one graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_fx_is_tried_first_and_keeps_module_names() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    gm = graphopt.capture(model, torch.randn(2, 3, 6, 6))
    assert gm.meta["graphopt_frontend"] == "fx"
    assert [n.op for n in gm.graph.nodes].count("call_module") == 2
    assert set(gm.state_dict()) == set(model.state_dict())


def test_fx_graph_carries_shapes_for_the_passes() -> None:
    gm = graphopt.capture(nn.Sequential(nn.Linear(3, 4)), torch.randn(2, 3))
    linear = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert tuple(linear.meta["tensor_meta"].shape) == (2, 4)


def test_shape_dependent_control_flow_falls_back_to_export() -> None:
    model = ShapeBranch().eval()
    x = torch.randn(2, 3, 6, 6)
    gm = graphopt.capture(model, x)
    assert gm.meta["graphopt_frontend"] == "export"
    torch.testing.assert_close(gm(x), model(x))

    captured = capture_graph(model, Check((x,), run_reference(model, (x,)), "the example inputs"))
    assert captured.frontend == "export"
    assert "control flow" in captured.attempts["fx"]


def test_fx_only_raises_capture_error_with_reason_and_hint() -> None:
    with pytest.raises(graphopt.CaptureError) as info:
        graphopt.capture(ShapeBranch(), torch.randn(2, 3, 6, 6), frontend="fx")
    assert "fx: TraceError" in str(info.value) and "frontend='auto'" in str(info.value)
    assert set(info.value.attempts) == {"fx"}


def test_uncapturable_model_lists_every_frontend() -> None:
    with pytest.raises(graphopt.CaptureError) as info:
        graphopt.capture(ValueBranch(), torch.randn(2, 3))
    message = str(info.value)
    assert "  - fx: " in message and "  - export: " in message
    assert "torch.where or torch.cond" in message
    assert set(info.value.attempts) == {"fx", "export"}


def test_graph_that_computes_something_else_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    x = torch.randn(2, 3)
    wrong = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3)))

    def wrong_tracer(model: nn.Module, args: tuple, dynamic_batch: bool, gradients: bool):
        return wrong, Reference(wrong(*args), {}), []

    # graphopt.capture is also the public function; reach the module itself
    capture_module = importlib.import_module("graphopt.capture")
    monkeypatch.setitem(capture_module._TRACERS, "fx", wrong_tracer)
    captured = capture_graph(model, Check((x,), run_reference(model, (x,)), "the example inputs"))
    assert captured.frontend == "export"
    assert "computes something else than eager" in captured.attempts["fx"]


class CountsCalls(nn.Module):
    """Updates a buffer in place: symbolic_trace silently drops that, torch.export keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * 2


def test_graph_that_drops_a_state_update_is_rejected() -> None:
    model = CountsCalls()
    x = torch.randn(2, 3)
    captured = capture_graph(model, Check((x,), run_reference(model, (x,)), "the example inputs"))
    assert captured.frontend == "export"
    assert "does not update buffer['calls']" in captured.attempts["fx"]
    assert int(model.calls) == 0, "neither tracing nor checking advanced the state"
    captured.graph_module(x)
    assert int(captured.graph_module.get_buffer("calls")) == 1
    with pytest.raises(graphopt.CaptureError, match="drops in-place updates of buffers"):
        graphopt.capture(model, (x,), frontend="fx")


class RebindsCounter(nn.Module):
    """``self.count += <tensor from the input>`` rebinds the buffer: symbolic_trace binds its Proxy as the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += x.new_ones(())
        return x * self.count


def test_tracing_leaves_the_models_buffers_as_they_were() -> None:
    """The Proxy fx left as the buffer made torch.export fail next ("symbolically traced variables cannot be used as inputs to control flow")."""
    model = RebindsCounter()
    buffer = model.count
    x = torch.randn(2, 3)
    captured = capture_graph(model, Check((x,), run_reference(model, (x,)), "the example inputs"))
    assert captured.frontend == "export" and "does not update buffer['count']" in captured.attempts["fx"]
    assert model.count is buffer and float(buffer) == 0


class DecaysMean(nn.Module):
    """A moving average whose decay reads no input: symbolic_trace runs ``mul_(0.9)`` once, while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x + self.mean


def test_a_graph_that_writes_state_is_checked_over_consecutive_calls() -> None:
    """On the first call, from a zero buffer, fx's graph matches: the next call shows it."""
    model = DecaysMean()
    x = torch.randn(2, 3)
    captured = capture_graph(model, Check((x,), run_reference(model, (x,)), "the example inputs"))
    assert captured.frontend == "export"
    assert "over 3 consecutive calls" in captured.attempts["fx"] and "on call 2" in captured.attempts["fx"]
    assert torch.equal(model.mean, torch.zeros(3)), "the checks ran on copies"


def test_export_batch_dimension_is_dynamic_by_default() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 2)).eval()
    gm = graphopt.capture(model, torch.randn(2, 3, 6, 6), frontend="export")
    other = torch.randn(5, 3, 6, 6)
    torch.testing.assert_close(gm(other), model(other))


@pytest.mark.parametrize("static", [{"dynamic_shapes": None}, {"dynamic_batch": False}])
def test_export_static_batch_when_asked(static: dict[str, Any]) -> None:
    model = nn.Linear(3, 2).eval()
    gm = graphopt.capture(model, torch.randn(2, 3), frontend="export", **static)
    with pytest.raises(AssertionError, match=r"Guard failed: .*size\(\)\[0\] == 2"):
        gm(torch.randn(5, 3))


def test_batch_of_one_is_reported_as_fixed() -> None:
    model = nn.Linear(3, 2).eval()
    x = torch.randn(1, 3)
    captured = capture_graph(model, Check((x,), run_reference(model, (x,)), "the example inputs"), "export")
    assert any("batch of 2 or more" in note for note in captured.notes)


def test_capture_does_not_touch_the_model() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = graphopt.capture(model, torch.randn(2, 3, 6, 6))
    with torch.no_grad():
        gm.get_parameter("0.weight").add_(1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training


def test_capture_in_train_mode_does_not_advance_running_stats() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    for frontend in ("fx", "export"):
        gm = graphopt.capture(model, torch.randn(2, 3, 6, 6), frontend=frontend)
        assert torch.equal(gm.get_buffer("1.running_mean"), torch.zeros(4))
        assert int(gm.get_buffer("1.num_batches_tracked")) == 0

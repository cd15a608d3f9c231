"""A forward() that writes state (buffers updated in place or by reassignment): the optimized module computes what the
original computes on every call, its buffers following the original's, or graphopt refuses it saying why."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.errors import EngineError
from tests.test_verification import CountsSteps  # a counter in forward(): self.steps += 1

CALLS = 4


class RunningMean(nn.Module):
    """An exponential moving average whose decay reads no input: symbolic_trace runs ``mul_(0.9)`` once, while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.linear(x) + self.mean


class AddsOnes(nn.Module):
    """A counter rebound to a value computed from the input: symbolic_trace binds a Proxy as the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += x.new_ones(())
        return self.linear(x) * self.count


class KeepsLastMean(nn.Module):
    """Stores the input's mean for the next call through a slice: fx records a ``__setitem__`` that nothing uses."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x) + self.last
        self.last[:] = x.mean(0)
        return out


class LerpMean(nn.Module):
    """The moving average as one in-place op that reads the input: symbolic_trace keeps it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.lerp_(x.mean(0), 0.1)
        return self.linear(x) + self.mean


class AddsBiasInPlace(nn.Module):
    """Writes an intermediate in place with a buffer as the operand: the buffer itself is only read."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("bias", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        out.add_(self.bias)
        return out


def assert_computes_like_over_calls(original: nn.Module, optimized: nn.Module, training: bool = False) -> None:
    """``optimized`` and a copy of ``original`` (as it was) agree on `CALLS` consecutive calls on fresh inputs, outputs and buffers."""
    generator = torch.Generator().manual_seed(1)
    for call in range(CALLS):
        x = torch.randn(8, 4, generator=generator)
        with torch.set_grad_enabled(training):
            expected, actual = original(x), optimized(x)
        if training:
            expected.sum().backward()
            actual.sum().backward()
        torch.testing.assert_close(actual, expected, msg=lambda m: f"call {call + 1}: {m}")
        buffers = dict(optimized.named_buffers())
        for name, buffer in original.named_buffers():
            torch.testing.assert_close(buffers[name], buffer, msg=lambda m: f"buffer {name} after call {call + 1}: {m}")


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_an_update_symbolic_trace_runs_while_tracing_is_computed_on_every_call(mode: str) -> None:
    model = RunningMean().train(mode == "training")
    optimized = graphopt.optimize(model, torch.randn(8, 4), mode=mode)
    assert_computes_like_over_calls(copy.deepcopy(model), optimized, training=mode == "training")
    assert "consecutive calls" in optimized.graphopt_report.capture_attempts["fx"]  # fx was refused, not lucky
    assert torch.equal(model.mean, torch.zeros(4)), "the user's model is not mutated"


def test_frontend_fx_refuses_it_saying_why_and_what_to_do() -> None:
    with pytest.raises(graphopt.CaptureError) as info:
        graphopt.optimize(RunningMean().eval(), torch.randn(8, 4), frontend="fx")
    message = str(info.value)
    assert "forward() writes buffer['mean']" in message and "on call 2" in message and "self.mean.mul_(0.9)" in message
    assert "lerp_" in message and "move the update out of forward()" in message


@pytest.mark.parametrize("model_class", [CountsSteps, AddsOnes, KeepsLastMean])
def test_counters_and_stored_inputs_compute_right_on_every_call(model_class: type[nn.Module]) -> None:
    """``self.count += ...`` left a Proxy in the buffer, which torch.export then failed on; fx dropped ``self.last[:] = ...``."""
    model = model_class().eval()
    optimized = graphopt.optimize(model, torch.randn(8, 4))
    assert optimized.graphopt_report.frontend == "export"
    assert_computes_like_over_calls(copy.deepcopy(model), optimized)


def test_an_update_symbolic_trace_records_stays_on_fx() -> None:
    model = LerpMean().eval()
    optimized = graphopt.optimize(model, torch.randn(8, 4), frontend="fx")
    assert_computes_like_over_calls(copy.deepcopy(model), optimized)


def test_batch_norm_in_training_is_still_captured_by_fx_and_updates_its_running_stats() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 4)).train()
    optimized = graphopt.optimize(model, torch.randn(4, 3, 6, 6), mode="training")
    assert optimized.graphopt_report.frontend == "fx" and not optimized.graphopt_report.capture_attempts
    original = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6, generator=generator)
        torch.testing.assert_close(optimized(x), original(x))
    torch.testing.assert_close(optimized.get_buffer("1.running_mean"), original.get_buffer("1.running_mean"))
    assert int(optimized.get_buffer("1.num_batches_tracked")) == 3


@pytest.mark.parametrize("engine", ["openvino", "onnxruntime", "inductor"])
@pytest.mark.parametrize("model_class, written", [(CountsSteps, "steps"), (RunningMean, "mean")])
def test_engines_refuse_a_graph_that_writes_state(engine: str, model_class: type[nn.Module], written: str) -> None:
    """An engine holds its own copy of the buffers: openvino kept returning the first call's values, the others raised
    a VerificationError that did not say why."""
    with pytest.raises(EngineError, match=rf"engine='{engine}' cannot run this model: its forward\(\) writes the stored tensors '{written}'.*engine='pytorch'"):
        graphopt.optimize(model_class().eval(), torch.randn(8, 4), engine=engine)


def test_an_engine_takes_a_graph_that_only_reads_a_buffer_in_an_in_place_op() -> None:
    model = AddsBiasInPlace().eval()
    optimized = graphopt.optimize(model, torch.randn(8, 4), engine="onnxruntime")
    x = torch.randn(8, 4)
    torch.testing.assert_close(optimized(x), model(x))


"""use_onednn_linear: structure, numerics on a second input, the timing decision, every guard, state, copies, capture again."""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphopt
from graphopt import timing
from graphopt.ops import weighted_op_view
from graphopt.passes.use_onednn_linear import MIN_WEIGHT_ELEMENTS, use_onednn_linear
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context, measured_as

linear_pass = importlib.import_module("graphopt.passes.use_onednn_linear")  # the package attribute is the pass function
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
FP32 = 1e-5  # relative to the output's scale: oneDNN's GEMM differs from MKL's by float32 rounding
WIDTH, HIDDEN = 512, 1024  # a 1024x512 weight: the smallest size the pass takes
assert WIDTH * HIDDEN == MIN_WEIGHT_ELEMENTS
LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
LINEAR_ADD = torch.ops.graphopt.linear_add.default


class Timer:
    """Replaces the pass's timer: runs both sides once (their results are compared) and says which is faster."""

    def __init__(self, onednn_faster: bool | list[bool] = True) -> None:
        self.answers = onednn_faster  # one answer for every call, or one per call in order
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, aten: Callable[[], torch.Tensor], onednn: Callable[[], torch.Tensor], budget_s: float, asks: timing.Question) -> timing.Comparison:
        assert asks == "slower", "the pass's kernel stays unless clearly slower"
        self.calls.append((aten(), onednn()))
        faster = self.answers[len(self.calls) - 1] if isinstance(self.answers, list) else self.answers
        return measured_as(2.0, 1.0) if faster else measured_as(1.0, 2.0)


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch) -> Timer:
    timer = Timer()
    monkeypatch.setattr(linear_pass, "compare_latency", timer)
    return timer


class Block(nn.Module):
    """A transformer feed-forward block: linear + activation, linear + residual add."""

    def __init__(self, activation: nn.Module | None = None) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.activation = activation if activation is not None else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x))) + x


def rewrite(model: nn.Module, inputs: tuple, frontend: str = "fx", mode: str = "inference"):
    gm = captured(model.eval(), inputs, frontend)
    result = use_onednn_linear(gm, context(inputs, mode))
    assert result.modified is bool(result.report.rewrites)
    return gm, result.report


def calls(gm: fx.GraphModule) -> list[tuple]:
    """The oneDNN calls in the graph: (op, post-op) per call."""
    return [(node.target, node.args[3] if node.target is LINEAR_POINTWISE else "add") for node in gm.graph.nodes if node.target in (LINEAR_POINTWISE, LINEAR_ADD)]


def linears(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if weighted_op_view(gm, node) is not None]


ACTIVATIONS = {
    "gelu": (nn.GELU(), "gelu"),
    "gelu_tanh": (nn.GELU(approximate="tanh"), "gelu"),
    "relu": (nn.ReLU(), "relu"),
    "silu": (nn.SiLU(), "swish"),
    "tanh": (nn.Tanh(), "tanh"),
    "hardtanh": (nn.Hardtanh(-0.5, 0.5), "hardtanh"),
    "leaky_relu": (nn.LeakyReLU(0.2), "leaky_relu"),
    "sigmoid": (nn.Sigmoid(), "sigmoid"),
    "hardswish": (nn.Hardswish(), "hardswish"),
    "hardsigmoid": (nn.Hardsigmoid(), "hardsigmoid"),
}


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_linear_gelu_and_linear_add_become_two_kernels_on_the_stored_weights(frontend: str, timer: Timer) -> None:
    model = Block().eval()
    inputs = (torch.randn(2, 6, WIDTH),)
    gm, report = rewrite(model, inputs, frontend)
    assert report.skips == [] and len(report.rewrites) == 2
    assert linears(gm) == []
    assert calls(gm) == [(LINEAR_POINTWISE, "gelu"), (LINEAR_ADD, "add")]
    # the kernels read the model's own parameters: nothing copied, nothing renamed
    assert dict(gm.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(gm.state_dict()[key], value) for key, value in model.state_dict().items())
    assert_same_outputs(model, gm, inputs, FP32)  # the example, then another batch size, fresh values, other strides
    transposed = torch.randn(WIDTH, 6, 3).permute(2, 1, 0)  # a non-contiguous input
    torch.testing.assert_close(gm(transposed), model(transposed), rtol=FP32, atol=FP32 * 10)
    assert len(timer.calls) == 2  # each distinct linear timed once


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_each_activation_is_fused_and_timed_against_the_same_aten_ops(name: str, timer: Timer) -> None:
    activation, attr = ACTIVATIONS[name]
    model = nn.Sequential(nn.Linear(WIDTH, HIDDEN), copy.deepcopy(activation)).eval()
    inputs = (torch.randn(3, WIDTH),)
    gm, report = rewrite(model, inputs)
    assert calls(gm) == [(LINEAR_POINTWISE, attr)], report.skips
    assert_same_outputs(model, gm, inputs, FP32)
    (aten, onednn), = timer.calls  # the baseline the pass timed computes what the kernel computes
    torch.testing.assert_close(onednn, aten, rtol=FP32, atol=FP32 * 10)
    torch.testing.assert_close(aten, model(*inputs), rtol=0, atol=0)


def test_where_aten_is_faster_the_linears_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = Timer(onednn_faster=False)
    monkeypatch.setattr(linear_pass, "compare_latency", timer)
    model = nn.Sequential(Block(), Block()).eval()  # two blocks of the same shapes: each distinct linear timed once
    gm, report = rewrite(model, (torch.randn(2, 4, WIDTH),))
    assert report.rewrites == [] and len(linears(gm)) == 4
    assert len(report.skips) == 4 and all("ATen's ops are faster here" in skip.reason for skip in report.skips)
    assert "oneDNN 0.50x ATen's speed" in report.notes[0]
    assert len(timer.calls) == 4  # fused and alone, for each of the two shapes


def test_a_slow_activation_is_left_to_aten_and_the_linear_still_runs_on_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = Timer(onednn_faster=[False, True])  # linear + gelu: ATen faster; the linear alone: oneDNN faster
    monkeypatch.setattr(linear_pass, "compare_latency", timer)
    model = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU()).eval()
    inputs = (torch.randn(3, WIDTH),)
    gm, report = rewrite(model, inputs)
    assert len(timer.calls) == 2
    assert calls(gm) == [(LINEAR_POINTWISE, "none")]
    assert [node.target for node in gm.graph.nodes if node.op == "call_module"] == ["1"]  # the GELU stays
    assert [skip.reason for skip in report.skips] == ["not fused into 0 (1): ATen's ops are faster here (1024x512 linear + gelu at 3 rows: oneDNN 0.50x their speed)"]
    assert_same_outputs(model, gm, inputs, FP32)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_training_mode(frontend: str, timer: Timer) -> None:
    gm, report = rewrite(Block(), (torch.randn(2, WIDTH),), frontend, mode="training")
    assert report.rewrites == [] and len(linears(gm)) == 2
    assert [skip.reason for skip in report.skips] == ["training mode: oneDNN's fused kernels have no gradient (inference only)"] * 2


def test_guard_small_weight(timer: Timer) -> None:
    model = nn.Sequential(nn.Linear(WIDTH, HIDDEN - 8), nn.ReLU())
    gm, report = rewrite(model, (torch.randn(2, WIDTH),))
    assert report.rewrites == [] and timer.calls == []
    assert [skip.reason for skip in report.skips] == [f"1016x512 weight: under {MIN_WEIGHT_ELEMENTS} elements oneDNN's per-call overhead outweighs its gain"]


def test_guard_dtype(timer: Timer) -> None:
    gm, report = rewrite(Block().double(), (torch.randn(2, WIDTH, dtype=torch.float64),))
    assert report.rewrites == [] and len(report.skips) == 2
    assert all("float64 weight: oneDNN fused kernels are used for float32 and bfloat16 only" in skip.reason for skip in report.skips)


def test_guard_onednn_disabled(timer: Timer) -> None:
    with torch.backends.mkldnn.flags(enabled=False):
        gm, report = rewrite(Block(), (torch.randn(2, WIDTH),))
    assert report.rewrites == [] and len(report.skips) == 2
    assert all("oneDNN is disabled" in skip.reason for skip in report.skips)


class TableAdd(nn.Module):
    """linear(x) + a learned (1, tokens, width) table: the add broadcasts over the batch."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, WIDTH)
        self.table = nn.Parameter(torch.randn(1, tokens, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.table


def test_an_add_fused_at_batch_1_still_broadcasts_at_other_batch_sizes(timer: Timer) -> None:
    model = TableAdd(tokens=5).eval()
    fast = graphopt.optimize(model, (torch.randn(1, 5, HIDDEN),), passes=["use_onednn_linear"], progress=False)
    assert calls(fast.graph_module) == [(LINEAR_ADD, "add")]  # same shapes at batch 1: fused
    x = torch.randn(3, 5, HIDDEN)  # the table now broadcasts: the kernel's add cannot, so it runs after it
    torch.testing.assert_close(fast(x), model(x), rtol=FP32, atol=FP32 * 10)


class TiedBlock(Block):
    """A block with a second linear whose weight is the first's: nothing is copied, so tying holds."""

    def __init__(self) -> None:
        super().__init__()
        self.tied = nn.Linear(WIDTH, HIDDEN)
        self.tied.weight = self.up.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)) * self.tied(x)) + x


# the default preset also measures use_onednn_kernels, which would take these linears with prepacked weights where faster
WITHOUT_PREPACKING = ["use_onednn_kernels"]


def test_in_the_default_preset_state_copies_and_capturing_again_see_the_model_unchanged(timer: Timer) -> None:
    model = TiedBlock().eval()
    inputs = (torch.randn(2, 3, WIDTH),)
    fast = graphopt.optimize(model, inputs, progress=False, disable=WITHOUT_PREPACKING)
    assert "use_onednn_linear" in [report.name for report in fast.graphopt_report.passes]
    assert sorted(post_op for _, post_op in calls(fast.graph_module)) == ["add", "gelu", "none"]
    assert fast.graph_module.get_parameter("up.weight") is fast.graph_module.get_parameter("tied.weight")
    assert fast.state_dict().keys() == model.state_dict().keys()
    assert sum(p.numel() for p in fast.parameters()) == sum(p.numel() for p in model.parameters())
    x = torch.randn(4, 3, WIDTH)
    torch.testing.assert_close(copy.deepcopy(fast)(x), model(x), rtol=FP32, atol=FP32 * 10)
    again = graphopt.optimize(fast, inputs, progress=False, disable=WITHOUT_PREPACKING)  # the fused calls are ops: captured as they are
    assert calls(again.graph_module) == calls(fast.graph_module)
    torch.testing.assert_close(again(x), model(x), rtol=FP32, atol=FP32 * 10)
    exported = torch.export.export(fast.graph_module, inputs)  # torch.export knows the shapes the calls return
    with torch.inference_mode():  # as the optimized module runs its graph
        torch.testing.assert_close(exported.module()(*inputs), model(*inputs), rtol=FP32, atol=FP32 * 10)


def test_onnx_export_runs_atens_ops_where_the_module_runs_onednns(tmp_path, timer: Timer) -> None:
    pytest.importorskip("onnxruntime")
    model = Block().eval()
    inputs = (torch.randn(2, 3, WIDTH),)
    fast = graphopt.optimize(model, inputs, progress=False, disable=WITHOUT_PREPACKING)
    assert len(calls(fast.graph_module)) == 2
    graphopt.export_onnx(fast, inputs, tmp_path / "as_is.onnx", optimize=False)  # checked against the module in onnxruntime
    assert len(calls(fast.graph_module)) == 2  # the user's module keeps its kernels
    report = graphopt.export_onnx(model, inputs, tmp_path / "model.onnx")
    assert "use_onednn_linear" not in [p.name for p in report.optimize_report.passes]


def test_in_a_graph_larger_than_the_caches_each_linear_is_timed_on_copies_of_its_weight(monkeypatch: pytest.MonkeyPatch, timer: Timer) -> None:
    """A language model's weights exceed the caches: each linear's weight is read from memory, and is timed so."""
    timed: list[int] = []  # the weight of each linear ATen ran while timed
    aten = linear_pass._Linear.aten
    monkeypatch.setattr(linear_pass._Linear, "aten", lambda kernel, x, other=None: (timed.append(kernel.weight.data_ptr()), aten(kernel, x, other))[1])
    inputs = (torch.randn(2, WIDTH),)
    rewrite(Block(), inputs)
    assert len(timed) == len(timer.calls) == 2  # 4 MiB of weights stay in the caches: each linear timed on its own weight
    timed.clear()
    timer.calls.clear()
    monkeypatch.setattr(linear_pass, "CACHE_BYTES", 3 * 2**20)
    gm, _ = rewrite(Block(), inputs)
    assert len(timer.calls) == 2 and len(timed) == 4  # each on its 2 MiB weight and a copy: more than 3 MiB read per call
    assert timed[0] != timed[1] and timed[2] != timed[3]
    assert calls(gm) == [(LINEAR_POINTWISE, "gelu"), (LINEAR_ADD, "add")]


def test_the_timer_really_times_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a stub: the pass's timing runs (on this CPU either side may win) and its figures reach the report."""
    monkeypatch.setattr(linear_pass, "MEASURE_BUDGET_S", 0.05)
    model = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU()).eval()
    gm, report = rewrite(model, (torch.randn(2, WIDTH),))
    assert report.notes[0].startswith("measured on the example values: 1024x512 linear + relu at 2 rows: oneDNN ")
    assert len(report.rewrites) + len(report.skips) >= 1
    assert_same_outputs(model, gm, (torch.randn(2, WIDTH),), FP32)

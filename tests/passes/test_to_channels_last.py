"""to_channels_last: conversions counted, convs fed channels_last, numerics, guards, training, auto."""

from __future__ import annotations

import copy

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp

import graphopt
from graphopt import pipeline
from graphopt.models import REFERENCE_MODELS
from graphopt.ops import interpreter_inputs, weighted_op_view
from graphopt.passes.to_channels_last import CONVERSION, to_channels_last
from tests.conftest import FRONTENDS, assert_same_outputs, assert_trains_like, captured, context, measured_as, randomize_batch_norms

CL = torch.channels_last
REPO = Path(__file__).resolve().parents[2]


def conversions(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if node.meta.get(CONVERSION)]


def is_channels_last(node: fx.Node) -> bool:
    meta = node.meta["tensor_meta"]
    fmt = CL if len(meta.shape) == 4 else torch.channels_last_3d
    return torch.empty_strided(meta.shape, meta.stride).is_contiguous(memory_format=fmt)


def conv_inputs_layouts(gm: fx.GraphModule, inputs: tuple) -> list[bool]:
    """Independent check: ShapeProp's real strides of every 2-D/3-D conv's input."""
    ShapeProp(gm).propagate(*interpreter_inputs(gm, inputs))
    layouts = []
    for node in gm.graph.nodes:
        conv = weighted_op_view(gm, node)
        if conv is not None and conv.spatial_dims in (2, 3):
            layouts.append(is_channels_last(conv.input))
    return layouts


def conversion_counts(report) -> str:
    return next(note for note in report.notes if note.startswith("layout conversions"))


# name -> (to channels_last, back to contiguous inside the graph); no reference model needs an output conversion
EXPECTED = {"resnet": (1, 0), "mobilenet_v2": (1, 0), "convnext": (1, 0), "transformer": (1, 1)}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_models_need_few_conversions(name: str, frontend: str) -> None:
    reference = REFERENCE_MODELS[name]
    model = randomize_batch_norms(reference.build()).eval()
    inputs = reference.example_inputs(batch_size=2)
    gm = captured(model, inputs, frontend)
    result = to_channels_last(gm, context(inputs))

    to_cl, to_contiguous = EXPECTED[name]
    assert conversion_counts(result.report) == f"layout conversions: {to_cl} to channels_last, {to_contiguous} back to contiguous inside, 0 on outputs"
    assert len(conversions(gm)) == to_cl + to_contiguous
    assert all(conv_inputs_layouts(gm, inputs))
    assert result.report.skips == [], "no op silently leaves channels_last"
    assert gm(*inputs).is_contiguous()
    assert_same_outputs(model, gm, inputs)


def test_conv_weights_are_stored_channels_last_once_even_when_tied() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).relu())

    inputs = (torch.randn(2, 3, 6, 6),)
    model = Tied()
    gm = captured(model, inputs, "fx")
    report = to_channels_last(gm, context(inputs)).report
    assert gm.a.weight is gm.b.weight and gm.a.weight.is_contiguous(memory_format=CL)
    assert "1 conv weights stored in channels_last" in report.notes
    assert_same_outputs(model, gm, inputs)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_four_d_outputs_get_their_layout_back(frontend: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    inputs = (torch.randn(2, 3, 8, 8),)
    gm = captured(model, inputs, frontend)
    report = to_channels_last(gm, context(inputs)).report
    assert conversion_counts(report).endswith("1 on outputs")
    out = gm(*inputs)
    assert out.is_contiguous() and not out.is_contiguous(memory_format=CL)
    assert_same_outputs(model, gm, inputs)


def test_outputs_stay_channels_last_when_asked() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    inputs = (torch.randn(2, 3, 8, 8),)
    gm = captured(model, inputs, "fx")
    ctx = context(inputs)
    ctx.keep_channels_last_outputs = True
    report = to_channels_last(gm, ctx).report
    assert conversion_counts(report).endswith("0 on outputs")
    assert gm(*inputs).is_contiguous(memory_format=CL)


class ViewHead(nn.Module):
    """``view`` over channels and space: fails on a channels_last tensor unless converted back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).relu()
        return self.fc(y.view(y.shape[0], -1))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_view_over_channels_gets_a_conversion_back(frontend: str) -> None:
    model = ViewHead().eval()
    inputs = (torch.randn(2, 3, 8, 8),)
    gm = captured(model, inputs, frontend)
    report = to_channels_last(gm, context(inputs)).report
    assert conversion_counts(report).startswith("layout conversions: 1 to channels_last, 1 back to contiguous inside")
    assert any("back to contiguous for" in rewrite.detail for rewrite in report.rewrites)
    assert_same_outputs(model, gm, inputs)


def test_three_d_convs_use_channels_last_3d() -> None:
    model = nn.Sequential(nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten()).eval()
    inputs = (torch.randn(2, 3, 5, 5, 5),)
    gm = captured(model, inputs, "fx")
    to_channels_last(gm, context(inputs))
    assert gm.get_parameter("0.weight").is_contiguous(memory_format=torch.channels_last_3d)
    assert all(conv_inputs_layouts(gm, inputs))
    assert_same_outputs(model, gm, inputs)


def test_model_without_convs_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    inputs = (torch.randn(2, 4),)
    gm = captured(model, inputs, "fx")
    result = to_channels_last(gm, context(inputs))
    assert not result.modified and "nothing to gain" in result.report.notes[0]


def test_guard_weight_computed_in_the_graph() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.conv2d(x, self.weight * 2)

    inputs = (torch.randn(2, 3, 6, 6),)
    model = Scaled()
    gm = captured(model, inputs, "fx")
    report = to_channels_last(gm, context(inputs)).report
    assert "weight computed in the graph" in report.skips[0].reason
    assert_same_outputs(model, gm, inputs)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("dropout", [nn.Dropout(0.5), nn.Dropout2d(0.5)])
def test_guard_active_elementwise_dropout_of_an_image(frontend: str, dropout: nn.Module) -> None:
    """Element-wise dropout draws its mask in memory order: in channels_last, other elements for the same seed."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), copy.deepcopy(dropout), nn.Conv2d(4, 4, 1)).train()
    inputs = (torch.randn(2, 3, 8, 8),)
    gm = captured(model, inputs, frontend)
    result = to_channels_last(gm, context(inputs, "training"))
    per_channel = isinstance(dropout, nn.Dropout2d)  # one draw per (sample, channel): the same in any layout
    assert result.modified is per_channel
    if not per_channel:
        assert "draws its mask in memory order" in result.report.skips[0].reason
    assert_trains_like(model, gm, inputs)


class InputResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mixed = x + y
        # without the shared conversion this add would be NCHW + channels_last -> NCHW (its first operand's)
        return mixed + self.conv(mixed).relu()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_other_readers_of_a_converted_value_share_the_conversion(frontend: str) -> None:
    inputs = (torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6))
    model = InputResidual()
    gm = captured(model, inputs, frontend)
    report = to_channels_last(gm, context(inputs)).report
    assert conversion_counts(report) == "layout conversions: 1 to channels_last, 0 back to contiguous inside, 1 on outputs"
    assert report.skips == []
    output_conversion = next(n for n in conversions(gm) if any(u.op == "output" for u in n.users))
    assert output_conversion.args[0].meta["graphopt_layout"] == "channels_last"  # the final add
    assert_same_outputs(model, gm, inputs)


def test_mixed_layouts_are_reported() -> None:
    class SecondInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return y + self.conv(x)  # y never meets a conv: it stays NCHW, and so does the add

    inputs = (torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6))
    model = SecondInput()
    gm = captured(model, inputs, "fx")
    report = to_channels_last(gm, context(inputs)).report
    assert [skip.where for skip in report.skips] == ["add"]
    assert "returns NCHW from a channels_last input" in report.skips[0].reason
    assert_same_outputs(model, gm, inputs)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_training_gradients_match_and_parameters_stay_channels_last(frontend: str) -> None:
    model = REFERENCE_MODELS["resnet"].build().train()
    inputs = (torch.randn(4, 3, 32, 32),)
    optimized = graphopt.optimize(model, inputs, frontend=frontend, memory_format="channels_last")
    assert_trains_like(model, optimized, inputs)
    torch.optim.SGD(optimized.parameters(), lr=0.1, momentum=0.9).step()
    conv_weights = [p for p in optimized.parameters() if p.dim() == 4]
    assert conv_weights and all(p.is_contiguous(memory_format=CL) for p in conv_weights)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_weights_cast_for_mixed_precision_training_are_stored_channels_last(frontend: str) -> None:
    """use_low_precision reads training weights through ``.to(bf16)``: they are stored channels_last once.

    Gradients then come back with exactly the parameters' strides (1x1 kernels included),
    which is what DDP compares with its bucket views.
    """
    model = REFERENCE_MODELS["resnet"].build().train()
    inputs = (torch.randn(4, 3, 32, 32),)
    optimized = graphopt.optimize(model, inputs, frontend=frontend, memory_format="channels_last", precision="bf16")
    report = optimized.graphopt_report["to_channels_last"]
    assert "12 conv weights stored in channels_last" in report.notes
    assert len(conversions(optimized.graph_module)) == 1, "the input only: no conversion of a weight per call"
    assert not report.skips
    optimized(*inputs).square().mean().backward()
    conv_weights = [p for p in optimized.parameters() if p.dim() == 4]
    assert any(p.shape[-1] == 1 for p in conv_weights), "1x1 kernels are covered"
    assert all(p.grad.stride() == p.stride() for p in conv_weights)


def test_optimize_reports_the_pass() -> None:
    model = randomize_batch_norms(REFERENCE_MODELS["mobilenet_v2"].build()).eval()
    inputs = (torch.randn(2, 3, 32, 32),)
    optimized = graphopt.optimize(model, inputs, memory_format="channels_last")
    report = optimized.graphopt_report["to_channels_last"]
    assert report.modified and conversion_counts(report).startswith("layout conversions: 1 to channels_last")
    assert "layout conversions: 1 to channels_last" in str(optimized.graphopt_report)
    assert_same_outputs(model, optimized, inputs)


@pytest.mark.parametrize("gain, note", [(1.5, ": kept"), (1.01, ": kept"), (0.9, "beyond the measurement noise)")])
@pytest.mark.usefixtures("convolutions_pay")
def test_auto_keeps_the_layout_unless_it_measures_slower(monkeypatch: pytest.MonkeyPatch, gain: float, note: str) -> None:
    kept = gain > 1.0  # 1.01x in every round: not 1.02x faster, but clearly not slower either: the preset's choice stands
    monkeypatch.setattr(pipeline, "compare_latency", lambda before, after, threshold, budget_s, asks: measured_as(gain, 1.0, threshold))
    model = randomize_batch_norms(REFERENCE_MODELS["resnet"].build()).eval()
    inputs = (torch.randn(2, 3, 32, 32),)
    # memory_format="auto" is the default; the oneDNN kernels, measured after it, would keep the weights prepacked
    optimized = graphopt.optimize(model, inputs, disable=["use_onednn_kernels"])
    report = optimized.graphopt_report["to_channels_last"]
    assert report.modified is kept
    assert "ms without" in report.notes[-1] and report.notes[-1].endswith(note)
    assert bool(conversions(optimized.graph_module)) is kept
    weight = optimized.get_parameter("stem_conv.weight")
    assert weight.is_contiguous(memory_format=CL) is kept
    assert_same_outputs(model, optimized, inputs)


class PatchThenLinears(nn.Module):
    """A tiny conv (a ViT's patch embedding, in miniature) before linears that take nearly all the time."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.mlp = nn.Sequential(nn.Linear(8 * 4 * 4, 2048), nn.ReLU(), *[nn.Linear(2048, 2048) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.patch(x).flatten(1))


def test_auto_leaves_out_channels_last_untimed_where_convs_take_almost_no_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timing(before, after, threshold, budget_s, asks):
        raise AssertionError("to_channels_last was timed although its convs could not pay")

    monkeypatch.setattr(pipeline, "compare_latency", no_timing)
    # 1024 rows: the conv's share measured 0.3-0.6% (AMD Zen 5), far enough under the ~2% threshold that a stall during
    # the conv does not lift it over; at 256 rows (0.6-1.3%) one did in a full suite run
    model, x = PatchThenLinears().eval(), torch.randn(1024, 3, 16, 16)
    before = copy.deepcopy(model.state_dict())
    fast = graphopt.optimize(model, (x,), disable=["use_onednn_kernels", "use_onednn_linear"])
    report = fast.graphopt_report["to_channels_last"]
    assert not report.modified and not conversions(fast.graph_module)
    assert report.notes[-1].startswith("convolutions take ") and "without timing" in report.notes[-1]
    assert not fast.get_parameter("patch.weight").is_contiguous(memory_format=CL), "the weight keeps its layout"
    torch.testing.assert_close(fast.state_dict(), before, rtol=0, atol=0)
    assert_same_outputs(model, fast, (torch.randn(5, 3, 16, 16),))


def test_an_explicit_channels_last_converts_however_little_the_convs_take() -> None:
    model, x = PatchThenLinears().eval(), torch.randn(256, 3, 16, 16)
    fast = graphopt.optimize(model, (x,), memory_format="channels_last")
    report = fast.graphopt_report["to_channels_last"]
    assert report.modified and conversion_counts(report) == "layout conversions: 1 to channels_last, 1 back to contiguous inside, 0 on outputs"
    assert conv_inputs_layouts(fast.graph_module, (x,)) == [True]
    assert_same_outputs(model, fast, (torch.randn(5, 3, 16, 16),))


def test_memory_format_option_errors() -> None:
    model, inputs = nn.Sequential(nn.Conv2d(3, 4, 3)), (torch.randn(2, 3, 6, 6),)
    with pytest.raises(graphopt.InvalidOptionError, match="unknown memory_format 'nhwc'"):
        graphopt.optimize(model, inputs, memory_format="nhwc")
    with pytest.raises(graphopt.InvalidOptionError, match="memory_format='preserve' forbids it"):
        graphopt.optimize(model, inputs, memory_format="preserve", passes=["to_channels_last"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ddp(order: str) -> str:
    """Two gloo ranks on this machine training a channels_last model; returns their stderr."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    worker = [sys.executable, "-m", "tests.passes.ddp_channels_last_worker"]
    ranks = [subprocess.Popen([*worker, str(rank), str(port), order], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    errors = [rank.communicate(timeout=240)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], errors
    return "".join(errors)


@pytest.mark.slow
def test_ddp_sees_no_stride_mismatch() -> None:
    assert "do not match bucket view strides" in _run_ddp("convert-after-ddp"), "the check must be able to fail"
    assert "do not match bucket view strides" not in _run_ddp("optimize-then-ddp")

"""use_onednn_kernels: structure, numerics (fp32 tight, bf16), every guard, both frontends, state and copies."""

from __future__ import annotations

import copy
import importlib
import inspect
import io
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt import timing
from graphopt.errors import ExportError, InvalidModelError
from graphopt.ops import weighted_op_view
from graphopt.passes.use_onednn_kernels import use_onednn_kernels
from graphopt.runtime.onednn import OneDNNConv, OneDNNLinear, Prepacked
from graphopt.runtime.portable import to_aten
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context, measured_as

onednn = importlib.import_module("graphopt.passes.use_onednn_kernels")  # the package attribute is the pass function
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
FP32 = 1e-5  # relative to the output's scale: oneDNN runs the primitive ATen uses (linear: to float32 rounding)


def channels_last(shape: tuple[int, ...]) -> torch.Tensor:
    x = torch.randn(shape)
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d) if x.dim() in (4, 5) else x


def prepacked(gm: fx.GraphModule) -> list[Prepacked]:
    return [m for m in gm.modules() if isinstance(m, Prepacked)]


def convs_and_linears(gm: fx.GraphModule) -> list[fx.Node]:
    return [node for node in gm.graph.nodes if weighted_op_view(gm, node) is not None]


def rewrite(model: nn.Module, inputs: tuple, frontend: str = "fx", mode: str = "inference"):
    """Run the pass on ``model`` (set to eval) captured by ``frontend``; return the graph and its report."""
    gm = captured(model.eval(), inputs, frontend)
    result = use_onednn_kernels(gm, context(inputs, mode))
    assert result.modified is bool(result.report.rewrites)
    return gm, result.report


def assert_fused(model: nn.Module, inputs: tuple, frontend: str, fused: list[tuple[str, bool]]) -> fx.GraphModule:
    """Every conv/linear became a prepacked oneDNN module with the expected (post-op, binary); fp32 outputs match tightly."""
    gm, report = rewrite(model, inputs, frontend)
    assert report.skips == []
    assert len(report.rewrites) == len(fused)
    assert convs_and_linears(gm) == []
    assert sorted((m.post_op.attr, m.binary) for m in prepacked(gm)) == sorted(fused)
    assert_same_outputs(model, gm, inputs, FP32)
    return gm


ACTIVATIONS = {
    "relu": (nn.ReLU(), "relu"),
    "relu_inplace": (nn.ReLU(inplace=True), "relu"),
    "relu6": (nn.ReLU6(), "hardtanh"),
    "hardtanh": (nn.Hardtanh(-0.5, 0.5), "hardtanh"),
    "silu": (nn.SiLU(), "swish"),
    "gelu": (nn.GELU(), "gelu"),
    "gelu_tanh": (nn.GELU(approximate="tanh"), "gelu"),
    "hardswish": (nn.Hardswish(), "hardswish"),
    "sigmoid": (nn.Sigmoid(), "sigmoid"),
    "tanh": (nn.Tanh(), "tanh"),
    "hardsigmoid": (nn.Hardsigmoid(), "hardsigmoid"),
    "leaky_relu": (nn.LeakyReLU(0.2), "leaky_relu"),
}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_conv_and_activation_become_one_kernel(name: str, frontend: str) -> None:
    activation, attr = ACTIVATIONS[name]
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), copy.deepcopy(activation))
    gm = assert_fused(model, (channels_last((2, 4, 7, 7)),), frontend, [(attr, False)])
    assert not [node for node in gm.graph.nodes if node.op == "call_module" and not isinstance(gm.get_submodule(str(node.target)), OneDNNConv) and str(node.target) != "_guards_fn"]


class FunctionalActivations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 6, 3), nn.Conv2d(6, 6, 1), nn.Conv2d(6, 6, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.silu(self.b(F.relu6(self.a(x))))).sigmoid()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_functional_and_method_activations(frontend: str) -> None:
    assert_fused(FunctionalActivations(), (channels_last((2, 4, 8, 8)),), frontend, [("hardtanh", False), ("swish", False), ("sigmoid", False)])


class Residual(nn.Module):
    """conv -> add(identity) -> relu, and a downsampled branch: two convs feed one add."""

    def __init__(self, relu: bool = True) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 16, 1)
        self.down, self.up = nn.Conv2d(8, 16, 1, stride=2), nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.relu = nn.ReLU(inplace=True) if relu else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv1(x) + x)
        identity = self.down(y)
        return self.relu(self.up(self.conv2(y)) + identity)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_residual_add_and_relu_fuse_into_the_conv(frontend: str) -> None:
    gm = assert_fused(Residual(), (channels_last((2, 8, 8, 8)),), frontend, [("relu", True), ("none", False), ("none", False), ("relu", True)])
    assert not [node for node in gm.graph.nodes if node.op == "call_function" and "add" in str(node.target)]


def test_residual_add_without_activation() -> None:
    model, inputs = Residual(relu=False), (channels_last((2, 8, 8, 8)),)
    gm, report = rewrite(model, inputs, "fx")
    assert_same_outputs(model, gm, inputs, FP32)
    assert sorted((m.post_op.attr, m.binary) for m in prepacked(gm)) == [("none", False), ("none", False), ("none", True), ("none", True)]
    assert "conv2d + add -> mkldnn._convolution_pointwise.binary" in {r.detail.split(",")[0] for r in report.rewrites}


CONVS = {
    "depthwise": (nn.Conv2d(8, 8, 3, padding=1, groups=8), (2, 8, 9, 9)),
    "grouped": (nn.Conv2d(8, 12, 3, groups=4, bias=False), (2, 8, 9, 9)),
    "strided_padded": (nn.Conv2d(4, 6, 5, stride=2, padding=2), (2, 4, 11, 11)),
    "dilated": (nn.Conv2d(4, 6, 3, dilation=2, padding=(2, 1)), (2, 4, 11, 11)),
    "asymmetric": (nn.Conv2d(4, 6, (1, 3), stride=(1, 2)), (2, 4, 7, 9)),
    "conv3d": (nn.Conv3d(4, 6, 3, padding=1, stride=(1, 2, 2)), (2, 4, 5, 6, 6)),
}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("kind", CONVS)
def test_conv_geometries(kind: str, frontend: str) -> None:
    conv, shape = CONVS[kind]
    assert_fused(nn.Sequential(copy.deepcopy(conv), nn.Hardswish()), (channels_last(shape),), frontend, [("hardswish", False)])


class Mlp(nn.Module):
    """A transformer MLP with its residual: linear -> gelu -> linear -> add."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(16, 32), nn.Linear(32, 16), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("shape", [(4, 16), (2, 5, 16)])
def test_linear_gelu_and_linear_add(shape: tuple[int, ...], frontend: str) -> None:
    gm = assert_fused(Mlp(), (torch.randn(shape),), frontend, [("gelu", False), ("none", True)])
    assert all(isinstance(m, OneDNNLinear) for m in prepacked(gm))


class LinearPlusPosition(nn.Module):
    """A linear, then a learned (1, tokens, dim) table added: it broadcasts over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.position = nn.Linear(8, 8), nn.Parameter(torch.randn(1, 5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.position


def test_an_add_that_fits_only_a_batch_of_one_is_added_after_the_kernel_for_other_batches() -> None:
    # planned on a batch of 1, the table has the output's shape; at other batch sizes it broadcasts,
    # which the fused kernel cannot do ("shape '[10, 8]' is invalid" before): the module adds it afterwards.
    # fx only: torch.export fixes a batch of 1 in the graph
    model, inputs = LinearPlusPosition().eval(), (torch.randn(1, 5, 8),)
    gm, report = rewrite(model, inputs, "fx")
    assert [(m.post_op.attr, m.binary) for m in prepacked(gm)] == [("none", True)]
    assert_same_outputs(model, gm, inputs, FP32)


def test_other_batch_sizes_run_with_weights_packed_for_the_example() -> None:
    model = nn.Sequential(Residual(), nn.Flatten(), nn.LazyLinear(10)).eval()
    model(channels_last((2, 8, 8, 8)))
    gm, report = rewrite(model, (channels_last((4, 8, 8, 8)),))
    assert len(report.rewrites) == 5
    for batch in (1, 3, 9):  # each and batch + 1, so the example's batch size too
        assert_same_outputs(model, gm, (channels_last((batch, 8, 8, 8)),), FP32)


@pytest.mark.skipif(not onednn.bf16_supported(), reason="this CPU has no oneDNN bfloat16 kernels")
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_bf16_after_low_precision_and_channels_last(frontend: str) -> None:
    model = nn.Sequential(Residual(), nn.Conv2d(16, 8, 1), nn.SiLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10), nn.GELU()).eval()
    x = torch.randn(4, 8, 8, 8)
    passes = ["use_low_precision", "to_channels_last", "use_onednn_kernels"]
    fast = graphopt.optimize(model, (x,), passes=passes, precision="bf16", memory_format="channels_last", frontend=frontend)
    plain = graphopt.optimize(model, (x,), passes=passes[:2], precision="bf16", memory_format="channels_last", frontend=frontend)
    report = fast.graphopt_report["use_onednn_kernels"]
    assert len(report.rewrites) == 6
    assert all(m.packed_weight.dtype == torch.bfloat16 for m in prepacked(fast.graph_module))
    assert convs_and_linears(fast.graph_module) == []
    # the input reaches the first residual add in fp32: that add stays out of the fusion, and the report says why
    assert [skip.reason for skip in report.skips if "other operand is torch.float32" in skip.reason]
    assert_same_outputs(model, fast, (x,), 3e-2)
    assert_same_outputs(plain, fast, (x,), 2e-2)


def test_unpacked_values_and_optimize_report() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.GELU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4)).eval()
    x = torch.randn(2, 3, 8, 8)
    fast = graphopt.optimize(model, (x,), passes=["to_channels_last", "use_onednn_kernels"], memory_format="channels_last")
    report = fast.graphopt_report["use_onednn_kernels"]
    assert report.notes == ["2 convs and 1 linears run by oneDNN with prepacked weights; fused: 2 activations, 0 residual adds"]
    assert_same_outputs(model, fast, (x,), FP32)
    # the state_dict has the model's keys and dense values; parameters() lists the biases only
    assert list(fast.state_dict()) == list(model.state_dict())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[name], value, rtol=0, atol=0)
    assert [name for name, _ in fast.named_parameters()] == [name for name in model.state_dict() if name.endswith("bias")]


def test_copies_pickles_and_loads_state() -> None:
    def build() -> nn.Module:  # no annotated forward(): fx cannot pickle string annotations
        return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).eval()

    model, other = build(), build()
    x = channels_last((2, 8, 8, 8))
    gm, _ = rewrite(model, (x,))
    assert len(prepacked(gm)) == 3
    assert_same_outputs(model, copy.deepcopy(gm), (x,), FP32)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    assert_same_outputs(model, torch.load(buffer, weights_only=False), (x,), FP32)
    gm.load_state_dict(other.state_dict())  # repacks
    assert_same_outputs(other, gm, (x,), FP32)
    with pytest.raises(RuntimeError, match="size mismatch for 0.weight"):
        gm.load_state_dict({**other.state_dict(), "0.weight": torch.zeros(8, 8, 1, 1)})
    with pytest.raises(RuntimeError, match="Missing key.*2.weight"):
        gm.load_state_dict({k: v for k, v in other.state_dict().items() if k != "2.weight"})


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_optimized_module_is_optimized_again_and_exported_with_aten_ops(frontend: str, tmp_path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.GELU()).eval()
    x = torch.randn(2, 3, 6, 6)
    passes = ["to_channels_last", "use_onednn_kernels"]
    fast = graphopt.optimize(model, (x,), passes=passes, memory_format="channels_last", frontend=frontend)
    assert len(prepacked(fast.graph_module)) == 3
    assert_same_outputs(model, copy.deepcopy(fast), (x,), FP32)

    aten = to_aten(fast.graph_module)  # what optimize and export_onnx start from
    assert prepacked(aten) == [] and len(prepacked(fast.graph_module)) == 3  # a copy: the module keeps its kernels
    targets = [node.target for node in aten.graph.nodes if node.op == "call_function"]
    assert targets.count(F.conv2d) == 2 and F.linear in targets and F.relu in targets and F.gelu in targets
    assert list(aten.state_dict()) == list(fast.state_dict())
    second = channels_last((3, 3, 6, 6))
    assert_same_outputs(model, aten, (second,), FP32)

    again = graphopt.optimize(fast, (x,), passes=passes, memory_format="channels_last")
    assert len(prepacked(again.graph_module)) == 3
    assert_same_outputs(model, again, (second,), FP32)
    written = graphopt.export_onnx(fast, (x,), tmp_path / "m.onnx", optimize=False)
    assert Path(written.path).exists()
    with pytest.raises(ExportError, match="passes= asks for use_onednn_kernels"):
        graphopt.export_onnx(model, (x,), tmp_path / "m2.onnx", passes=["use_onednn_kernels"])
    fast.graph_module.add_submodule("extra", OneDNNConv(torch.randn(4, 3, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, [2, 3, 6, 6]))
    with pytest.raises(InvalidModelError, match="optimize the original model"):
        graphopt.optimize(nn.Sequential(fast.graph_module.extra), (x,))  # a kernel outside an optimized graph cannot be undone


class Timed:
    """A stand-in for the pipeline's timer (seconds before, after a pass): a pass that adds oneDNN kernels takes the graph
    from 1 s to ``with_kernels``; any other measured pass (to_channels_last) from 1 s to 0.5 s."""

    def __init__(self, with_kernels: float) -> None:
        self.with_kernels = with_kernels

    def __call__(self, before, after, threshold, budget_s, asks) -> timing.Comparison:
        def graph(run) -> fx.GraphModule:
            return next(v for v in inspect.getclosurevars(run).nonlocals.values() if isinstance(v, fx.GraphModule))

        adds_kernels = bool(prepacked(graph(after))) and not prepacked(graph(before))
        return measured_as(1.0, self.with_kernels if adds_kernels else 0.5, threshold)


@pytest.mark.parametrize("faster", [True, False])
@pytest.mark.usefixtures("convolutions_pay")  # no clock decides anything here: on a loaded machine channels_last was left out
def test_the_default_call_keeps_the_kernels_only_where_they_measure_faster(faster: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = importlib.import_module("graphopt.pipeline")
    monkeypatch.setattr(pipeline, "compare_latency", Timed(0.5 if faster else 2.0))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 4 * 4, 4)).eval()
    x = torch.randn(2, 3, 6, 6)
    fast = graphopt.optimize(model, (x,))
    report = fast.graphopt_report["use_onednn_kernels"]
    assert len(prepacked(fast.graph_module)) == (3 if faster else 0)
    assert report.notes[-1].endswith("(2.00x): kept" if faster else "(0.50x): undone (clearly slower with it, beyond the measurement noise)")
    second = torch.randn(5, 3, 6, 6)
    assert_same_outputs(model, fast, (second,), FP32)
    assert list(fast.state_dict()) == list(graphopt.optimize(model, (x,), memory_format="channels_last").state_dict())


def test_the_kernels_are_in_the_inference_preset_only_where_measured() -> None:
    from graphopt.pipeline import select_passes

    def names(**options) -> list[str]:
        defaults = {"preserve_layout": False, "low_precision": False, "fuse": None}
        return [info.name for info in select_passes("inference", None, (), **{**defaults, **options})]

    assert "use_onednn_kernels" in names(measure=True)
    assert names(measure=True).index("use_onednn_kernels") > names(measure=True).index("to_channels_last")
    assert "use_onednn_kernels" not in names(measure=False)  # memory_format="channels_last"/"preserve": opt-in
    assert "use_onednn_kernels" not in names(measure=True, fuse="inductor")  # the compiler plans the kernels then
    assert "use_onednn_kernels" not in [info.name for info in select_passes("training", None, (), preserve_layout=False, low_precision=False, fuse=None)]
    model = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    explicit = graphopt.optimize(model, (torch.randn(2, 3, 6, 6),), memory_format="channels_last")
    assert "use_onednn_kernels" not in [p.name for p in explicit.graphopt_report.passes]


# ----------------------------------------------------------------------------- guards


def assert_skipped(gm: fx.GraphModule, report, reason: str, count: int = 1) -> None:
    assert report.rewrites == [] and prepacked(gm) == []
    assert len(report.skips) == count
    assert all(reason in skip.reason for skip in report.skips), report.skips


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_training_mode(frontend: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2))
    gm, report = rewrite(model, (channels_last((2, 3, 4, 4)),), frontend, mode="training")
    assert_skipped(gm, report, "training mode: oneDNN's fused kernels have no gradient", count=2)


def test_guard_onednn_unavailable_or_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    x = channels_last((2, 3, 6, 6))
    with torch.backends.mkldnn.flags(enabled=False):
        gm, report = rewrite(model, (x,))
    assert_skipped(gm, report, "torch.backends.mkldnn.enabled is False")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    gm, report = rewrite(model, (x,))
    assert_skipped(gm, report, "not available in this torch build")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_guard_dtype(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).to(dtype)
    gm, report = rewrite(model, (channels_last((2, 3, 6, 6)).to(dtype),))
    assert_skipped(gm, report, "float32 and bfloat16 only")


def test_guard_bf16_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn, "bf16_supported", lambda: False)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).to(torch.bfloat16)
    gm, report = rewrite(model, (channels_last((2, 3, 6, 6)).to(torch.bfloat16),))
    assert_skipped(gm, report, "no oneDNN bfloat16 kernels")


def test_guard_device() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).to("meta"))
    result = use_onednn_kernels(gm, context((torch.randn(2, 3, 6, 6, device="meta"),)))
    assert_skipped(gm, result.report, "weight on meta: oneDNN kernels run on the CPU only")


class Unsupported(nn.Module):
    """Convs this pass leaves alone, each for its own reason."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1d, self.transposed = nn.Conv1d(4, 4, 3, padding=1), nn.ConvTranspose2d(4, 4, 3, padding=1)
        self.same, self.shared = nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 1)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1d(x.flatten(2)).view_as(x)
        y = torch.relu(self.transposed(y))
        y = F.conv2d(y, self.same.weight, self.same.bias, padding="same")
        y = F.conv2d(y, self.same.weight * self.scale)  # computed weight
        return self.shared(self.shared(y))


def test_guard_unsupported_convs() -> None:
    _, report = rewrite(Unsupported(), (channels_last((2, 4, 6, 6)),))
    reasons = sorted(skip.reason for skip in report.skips)
    assert report.rewrites == []
    assert len(reasons) == 6
    for reason in (
        "conv1d: oneDNN weight prepacking supports conv2d and conv3d only",
        "transposed convolution: not prepacked",
        "padding='same': only numeric padding is prepacked",
        "is computed in the graph",
        "module 'shared' is called at 2 places",
    ):
        assert any(reason in r for r in reasons), (reason, reasons)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_nchw_input_keeps_aten_conv(frontend: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    gm, report = rewrite(model, (torch.randn(2, 3, 6, 6),), frontend)
    assert_skipped(gm, report, "use memory_format='channels_last'")


def test_guard_activation_with_another_reader_is_not_fused() -> None:
    class TwoReaders(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return torch.relu(y) + y

    model, inputs = TwoReaders(), (channels_last((2, 3, 6, 6)),)
    gm, _ = rewrite(model, inputs)
    assert [(m.post_op.attr, m.binary) for m in prepacked(gm)] == [("none", False)]
    assert_same_outputs(model, gm, inputs, FP32)

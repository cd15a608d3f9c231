"""quantize_int8: structure, numerics against the quantization scheme, the accuracy budget, a trained model, guards and errors."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.errors import ExportError, InvalidInputsError, InvalidModelError, InvalidOptionError, SaveError
from graphopt.runtime.int8 import Int8Conv, Int8Linear, Int8Op, activation_levels, quantize_weight
from graphopt.runtime.onednn import PostOp
from tests.conftest import measured_as, relative_error
from tests.digits import DigitsNet, digits

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
FP32 = 1e-5  # the kernel against the same arithmetic in float32: int32 accumulation is exact, the rest float32 rounding
quantize = importlib.import_module("graphopt.passes.quantize_int8")  # the package attribute is the pass function


def timed_as(*ratios: float):
    """A fake `compare_latency` for the layer timing: runs both, then says int8 is ``ratios[i]`` times faster on the i-th layer
    timed (float32 seconds, int8 seconds), or 2x when no ratio is given."""
    speedups = iter(ratios)

    def compare(baseline, candidate, threshold, budget_s, asks):
        assert asks == "faster", "int8 is taken only where faster"
        baseline()
        candidate()
        return measured_as(next(speedups, 2.0), 1.0, threshold)

    return compare


@pytest.fixture(autouse=True)
def int8_twice_as_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test times anything: every layer's int8 kernel 'measures' 2x faster (one test scripts it otherwise)."""
    monkeypatch.setattr(quantize, "compare_latency", timed_as())


def int8_layers(module: nn.Module) -> dict[str, Int8Op]:
    return {name: m for name, m in module.named_modules() if isinstance(m, Int8Op)}


def quantize_report(module: graphopt.OptimizedModule):
    return next(p for p in module.graphopt_report.passes if p.name == "quantize_int8")


class Block(nn.Module):
    """conv-bn-relu, conv-bn + residual add + relu, global pool, linear: every fusion the int8 kernels take over."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = F.relu(self.bn(self.conv(y)) + y)
        return self.head(y.mean((2, 3)))


def batches(count: int, size: int = 4, shape: tuple[int, ...] = (3, 16, 16)) -> list[torch.Tensor]:
    return [torch.randn(size, *shape) for _ in range(count)]


def test_convs_and_linears_run_int8_kernels_with_their_fusions() -> None:
    model = Block().eval()
    x = torch.randn(4, 3, 16, 16)
    fast = graphopt.optimize(model, x, precision="int8", calibration=batches(3))
    layers = int8_layers(fast)
    assert sorted((type(m).__name__, m.post_op.attr, m.binary) for m in layers.values()) == [
        ("Int8Conv", "relu", False), ("Int8Conv", "relu", True), ("Int8Linear", "none", False),
    ]  # fmt: skip
    report = quantize_report(fast)
    assert report.skips == [] and len(report.rewrites) == 3
    assert "onednn.qconv_pointwise (int8" in report.rewrites[0].detail
    assert "3 of 3 convs/linears in int8" in report.notes[-1]
    assert fast.graphopt_report.tolerance == graphopt.precision.DEFAULT_INT8_ACCURACY
    # verified on a second input of another batch size and strides, with real values: the last calibration batch's
    assert "values of the last calibration batch" in fast.graphopt_report.second_input
    assert 0 < fast.graphopt_report.second_input_error <= graphopt.precision.DEFAULT_INT8_ACCURACY
    with torch.no_grad():
        for other in (x, torch.randn(7, 3, 16, 16), torch.randn(2, 3, 16, 16).contiguous(memory_format=torch.channels_last)):
            error = relative_error(model(other), fast(other))
            assert 0 < error <= graphopt.precision.DEFAULT_INT8_ACCURACY  # quantized (not float32), within the budget


def reference_conv(module: Int8Conv, x: torch.Tensor) -> torch.Tensor:
    """The scheme in float64: x quantized per tensor (rounded as the module rounds), the weight per channel, the conv on their values."""
    levels = torch.mul(x, 1.0 / module.input_scale).add_(module.input_zero_point).round_().clamp_(0, module.input_max)
    dequantized = (levels.double() - module.input_zero_point) * module.input_scale
    bias = None if module.bias is None else module.bias.double()
    y = F.conv2d(dequantized, module.weight.double(), bias, module.stride, module.padding, module.dilation, module.groups)
    return y.float()


def with_post_op(y: torch.Tensor, post_op: PostOp) -> torch.Tensor:
    functions = {"none": lambda y: y, "relu": F.relu, "hardtanh": lambda y: F.hardtanh(y, 0.0, 6.0), "gelu": F.gelu}
    return functions[post_op.attr](y)


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("post_op", [PostOp(), PostOp("relu"), PostOp("hardtanh", (0.0, 6.0)), PostOp("gelu", (), "none")])
def test_int8_conv_computes_the_quantization_scheme(groups: int, post_op: PostOp) -> None:
    weight, bias = torch.randn(8, 8 // groups, 3, 3), torch.randn(8)
    scale, zero_point = 18 / (activation_levels() - 1), (activation_levels() - 1) // 2  # a zero point inside the range
    module = Int8Conv(weight, bias, [1, 1], [2, 2], [1, 1], groups, [2, 8, 10, 10], scale, zero_point, post_op)
    # the example's shape, then another batch and size than the weight was packed for; values beyond the range clamp
    for x in (torch.randn(2, 8, 10, 10) * 3, torch.randn(3, 8, 7, 9) * 20):
        actual = module(x)
        assert relative_error(with_post_op(reference_conv(module, x), post_op), actual) < FP32
        assert actual.is_contiguous(memory_format=torch.channels_last)
    # the weight it computes with is the float weight, quantized per output channel
    assert relative_error(weight, module.weight) <= 0.5 / 127 + 1e-6


def test_int8_conv_adds_in_its_kernel_and_int8_linear_takes_any_leading_dims() -> None:
    conv = Int8Conv(torch.randn(4, 4, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, [1, 4, 5, 5], 0.05, 0, PostOp("relu"), binary=True)
    assert conv.adds_in_kernel and conv.after is None
    x, other = torch.rand(1, 4, 5, 5), torch.randn(1, 4, 5, 5)
    kept = other.clone()
    assert relative_error(F.relu(reference_conv(conv, x) + other), conv(x, other)) < FP32
    assert torch.equal(other, kept)  # into_other is not set: the kernel accumulated into a copy
    # an activation the kernel does not take after an add: the add and it run after the kernel
    after = Int8Conv(torch.randn(4, 4, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, [1, 4, 5, 5], 0.05, 0, PostOp("hardtanh", (0.0, 6.0)), binary=True)
    assert not after.adds_in_kernel and after.after is not None
    assert relative_error(F.hardtanh(reference_conv(after, x) + other, 0.0, 6.0), after(x, other)) < FP32
    weight, bias = torch.randn(6, 5), torch.randn(6)
    linear = Int8Linear(weight, bias, 6, 0.02, 60, PostOp("relu"))
    x = torch.randn(2, 3, 5)
    levels = torch.mul(x, 1.0 / 0.02).add_(60).round_().clamp_(0, linear.input_max)
    expected = F.relu(F.linear((levels - 60) * 0.02, linear.weight, bias))
    assert relative_error(expected, linear(x)) < FP32


def test_int8_conv_add_accumulates_into_other_only_where_it_may() -> None:
    conv = Int8Conv(torch.randn(8, 4, 3, 3), torch.randn(8), [1, 1], [1, 1], [1, 1], 1, [2, 4, 6, 6], 0.05, 0, PostOp(), binary=True)
    conv.into_other = True
    x = torch.rand(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    other = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    expected = reference_conv(conv, x) + other
    assert relative_error(expected, conv(x, other)) < FP32
    assert relative_error(expected, other) < FP32  # it held the result: the kernel wrote into it
    # another layout, another dtype, a batch other than the example's: a copy, the operand untouched
    for other in (torch.randn(2, 8, 6, 6), torch.randn(2, 8, 6, 6).double().contiguous(memory_format=torch.channels_last)):
        kept = other.clone()
        assert relative_error(reference_conv(conv, x) + other.float(), conv(x, other)) < FP32
        assert torch.equal(other, kept)
    x3, other3 = torch.rand(3, 4, 5, 7), torch.randn(3, 8, 5, 7)
    assert relative_error(reference_conv(conv, x3) + other3, conv(x3, other3)) < FP32


@pytest.mark.parametrize("uint8_output", [False, True])
def test_int8_conv_adds_into_a_uint8_operand_with_its_quantization(uint8_output: bool) -> None:
    conv = Int8Conv(torch.randn(8, 4, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, [2, 4, 6, 6], 0.05, 0, PostOp("relu"), binary=True)
    conv.into_other, conv.accum_quantization = True, (0.04, 100)
    if uint8_output:
        conv.output_quantization = (0.1, 0)
    x = torch.rand(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    other = torch.randint(0, 256, (2, 8, 6, 6), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    expected = F.relu(reference_conv(conv, x) + (other.float() - 100) * 0.04)
    kept = other.clone()
    actual = conv(x, other)
    if uint8_output:
        assert actual.dtype == torch.uint8
        levels = torch.clamp(torch.round(expected / 0.1), 0, conv.input_max)
        assert (actual.float() - levels).abs().max() <= 1  # a level apart at most, where float rounding differs
        assert torch.equal(other, actual)  # accumulated into the uint8 operand in place
    else:
        assert actual.dtype == torch.float32 and relative_error(expected, actual) < FP32
        assert torch.equal(other, kept)  # a float result: the kernel added into other dequantized, a new tensor


def test_weights_are_symmetric_per_channel_and_copies_keep_the_kernels() -> None:
    weight = torch.randn(3, 2, 1, 1) * torch.tensor([1.0, 100.0, 0.01]).view(3, 1, 1, 1)
    quantized, scales = quantize_weight(weight)
    assert quantized.dtype == torch.int8 and int(quantized.abs().amax()) == 127
    assert torch.equal(quantized.abs().flatten(1).amax(1), torch.tensor([127, 127, 127], dtype=torch.int8))
    assert torch.allclose(scales, weight.abs().flatten(1).amax(1) / 127)
    module = Int8Conv(weight, None, [0, 0], [1, 1], [1, 1], 1, [1, 2, 4, 4], 0.1, 3)
    x = torch.randn(1, 2, 4, 4)
    for copied in (copy.deepcopy(module), torch.load(_saved(module), weights_only=False)):
        assert torch.equal(copied(x), module(x))
    state = module.state_dict()
    assert set(state) == {"weight"}  # no bias
    fresh = Int8Conv(torch.zeros_like(weight), None, [0, 0], [1, 1], [1, 1], 1, [1, 2, 4, 4], 0.1, 3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), module(x))


def _saved(module: nn.Module):
    import io

    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


class OutlierChannel(nn.Module):
    """conv2 reads one channel 1000x larger than the others: no per-tensor uint8 range serves both halves of its output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        with torch.no_grad():
            self.conv1.weight[0] *= 1000
            self.conv1.bias[0] *= 1000
            self.conv2.weight[:4, 1:] = 0  # half the outputs read the outlier channel (scaled back), half the others
            self.conv2.weight[:4, 0] /= 1000
            self.conv2.weight[4:, 0] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(F.relu(self.conv2(self.conv1(x))))


def test_a_layer_that_quantizes_badly_stays_in_float32_and_the_report_names_it() -> None:
    model = OutlierChannel().eval()
    x = torch.randn(4, 3, 12, 12)
    fast = graphopt.optimize(model, x, precision="int8", calibration=batches(2, shape=(3, 12, 12)), accuracy=0.1)
    assert sorted(int8_layers(fast)) == ["conv1", "conv3"]
    kept = fast.graphopt_report.why("conv2")
    assert any("kept in float32: alone in int8 it changes the output by" in line for line in kept), kept
    assert any("int8" in line and "qconv_pointwise" in line for line in fast.graphopt_report.why("conv1"))
    with torch.no_grad():
        assert relative_error(model(x), fast(x)) <= 0.1


def test_a_budget_no_layer_meets_gives_the_default_float32_call_and_says_why() -> None:
    model = Block().eval()
    x = torch.randn(4, 3, 16, 16)
    with pytest.warns(UserWarning, match="precision='int8': no conv or linear stayed in int8"):
        fast = graphopt.optimize(model, x, precision="int8", calibration=batches(1), accuracy=1e-7)
    assert int8_layers(fast) == {}
    default = graphopt.optimize(model, x)
    # the default call's passes and result, then the int8 attempt's quantize_int8 entry, which says why per layer
    assert [p.name for p in fast.graphopt_report.passes] == [p.name for p in default.graphopt_report.passes] + ["quantize_int8"]
    assert fast.graphopt_report.notes[0].startswith("precision='int8': no conv or linear stayed in int8 (0 of 3 convs/linears in int8")
    assert fast.graphopt_report.tolerance == default.graphopt_report.tolerance
    report = quantize_report(fast)
    assert not report.modified and len(report.skips) == 3
    assert all("over accuracy=1e-07" in skip.reason for skip in report.skips)
    assert any("over accuracy=1e-07" in line for line in fast.graphopt_report.why("conv"))
    with torch.no_grad():
        for other in (x, torch.randn(7, 3, 16, 16)):  # the example and another batch
            torch.testing.assert_close(fast(other), default(other))


class Branches(nn.Module):
    """One Linear(1, 1) per input feature, weight 1, their outputs summed.

    Weights of 1 quantize exactly, and inputs within the calibrated range round by half a level at most: a layer's int8
    error comes from the values it clips, those beyond the range its calibration observed. Clipped values lose their
    excess, always downwards, so on a row where several inputs exceed the range the layers' errors add up, each
    ``excess / output``: the test sets every layer's error alone and together.
    """

    def __init__(self, count: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(count))
        with torch.no_grad():
            for branch in self.branches:
                branch.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x[:, i : i + 1]) for i, branch in enumerate(self.branches)], 1).sum(1, keepdim=True)


def spread(rows: int, features: int) -> torch.Tensor:
    """``rows`` values from 0 to 1 per feature, each feature in its own order: the range the calibration observes."""
    return torch.stack([torch.linspace(0, 1, rows)[torch.randperm(rows)] for _ in range(features)], 1)


def beyond_the_range(excess: list[float]) -> torch.Tensor:
    """Example inputs within [0, 1] but a first row of ``1 + excess``: each layer clips its feature there by its excess."""
    x = spread(8, len(excess))
    x[0] = 1 + torch.tensor(excess)
    return x


def test_layers_together_over_the_budget_go_back_to_float32_worst_first_until_within_it() -> None:
    # on the first row (output 5.35) the layers alone change the output by 4.7e-2, 9.3e-2, 7.5e-2, 3.7e-2 of its scale,
    # each within accuracy=0.12, all four together by 0.25; without the worst (1) by 0.16, still over; without the two
    # worst (1 and 2) by 8.4e-2. The two worst are neither first nor last in graph order.
    model = Branches(4).eval()
    x = beyond_the_range([0.25, 0.5, 0.4, 0.2])
    calibration = [spread(64, 4) for _ in range(2)]
    fast = graphopt.optimize(model, x, precision="int8", calibration=calibration, accuracy=0.12, verify=False)
    assert sorted(int8_layers(fast)) == ["branches.0", "branches.3"]
    skips = {skip.where: skip.reason for skip in quantize_report(fast).skips}
    assert sorted(skips) == ["branches.1", "branches.2"]
    assert all("together exceeded accuracy=0.12, and it had the largest error of them" in reason for reason in skips.values())
    with torch.no_grad():
        for args in (x, *calibration):
            assert relative_error(model(args), fast(args)) <= 0.12


def test_layers_together_stay_within_the_budget_on_every_calibration_batch_not_only_the_example() -> None:
    # the example: layers 1 and 2 clip their features by 0.2 and 0.1, together changing the output by 7.0e-2, within
    # accuracy=0.1. A quiet calibration batch (a dark image): features 1 and 2 below half an int8 level, the others 0,
    # so its output is small and layers 1 and 2 in int8 round their inputs to 0: each alone changes that batch's output
    # by about half of it. Within the budget there, both go back to float32, one after the other.
    model = Branches(4).eval()
    x = beyond_the_range([0.0, 0.2, 0.1, 0.0])
    quiet = torch.zeros(8, 4)
    quiet[:, 1] = quiet[:, 2] = torch.linspace(0.0002, 0.001, 8)  # half a level: 2e-3 (4e-3 with 7 bits)
    calibration = [spread(64, 4), quiet]
    fast = graphopt.optimize(model, x, precision="int8", calibration=calibration, accuracy=0.1, verify=False)
    assert sorted(int8_layers(fast)) == ["branches.0", "branches.3"]
    skips = {skip.where: skip.reason for skip in quantize_report(fast).skips}
    assert sorted(skips) == ["branches.1", "branches.2"]
    assert all("together exceeded accuracy=0.1, and it had the largest error of them" in reason for reason in skips.values())
    with torch.no_grad():
        for args in (x, *calibration):
            assert relative_error(model(args), fast(args)) <= 0.1


def test_a_dataloader_of_inputs_and_labels_calibrates() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(12, 3, 16, 16), torch.randint(0, 10, (12,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    fast = graphopt.optimize(Block().eval(), torch.randn(4, 3, 16, 16), precision="int8", calibration=loader)
    assert "calibrated on 3 batches" in quantize_report(fast).notes[-1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "precision='int8' needs calibration="),
        ({"calibration": torch.randn(4, 3, 16, 16)}, "takes an iterable of batches"),
        ({"calibration": []}, "holds no batch"),
        ({"calibration": [torch.randn(4, 3, 16, 16)], "accuracy": 0}, "accuracy=0"),
        ({"calibration": [torch.randn(4, 3, 16, 16)], "mode": "training"}, "is for inference"),
        ({"calibration": [torch.randn(4, 3, 16, 16)], "memory_format": "preserve"}, "channels_last"),
        ({"calibration": [torch.randn(4, 3, 16, 16)], "fuse": "inductor"}, "leave fuse out"),
        ({"calibration": [torch.randn(4, 3, 16, 16)], "tune": True}, "tune=True chooses the precision itself"),
        ({"calibration": [torch.randn(4, 3, 16, 16)], "device": "meta"}, "run the model on the CPU"),
    ],
)
def test_int8_options_are_checked_before_anything_runs(options: dict, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        graphopt.optimize(Block().eval(), torch.randn(4, 3, 16, 16), precision="int8", **options)


def test_calibration_and_the_pass_need_precision_int8() -> None:
    with pytest.raises(InvalidOptionError, match="calibration= is for precision='int8'"):
        graphopt.optimize(Block().eval(), torch.randn(4, 3, 16, 16), calibration=batches(1))  # neither precision="int8" nor tune
    with pytest.raises(InvalidOptionError, match="passes= asks for quantize_int8 but precision is not 'int8'"):
        graphopt.optimize(Block().eval(), torch.randn(4, 3, 16, 16), passes=["quantize_int8"])
    with pytest.raises(InvalidInputsError, match="calibration batch 0 holds"):
        graphopt.optimize(Block().eval(), torch.randn(4, 3, 16, 16), precision="int8", calibration=[torch.randn(4, 5)])
    with pytest.raises(InvalidInputsError, match=r"calibration batch 1: input 0 is \(4, 5, 16, 16\), the example's \(4, 3, 16, 16\): dimension 1 differs"):
        graphopt.optimize(Block().eval(), torch.randn(4, 3, 16, 16), precision="int8", calibration=[torch.randn(4, 3, 16, 16), torch.randn(4, 5, 16, 16)])


def test_int8_modules_are_refused_by_save_export_and_a_second_optimize(tmp_path) -> None:
    x = torch.randn(4, 3, 16, 16)
    fast = graphopt.optimize(Block().eval(), x, precision="int8", calibration=batches(1))
    with pytest.raises(SaveError, match="cannot write int8 modules yet"):
        graphopt.save(fast, tmp_path / "model.pt2")
    with pytest.raises(ExportError, match="oneDNN's int8 kernels, which have no ONNX form: export the original model with precision='int8'"):
        graphopt.export_onnx(fast, x, tmp_path / "model.onnx", optimize=False)
    with pytest.raises(InvalidModelError, match="already run oneDNN's int8 kernels"):
        graphopt.optimize(fast, x)
    assert not list(tmp_path.iterdir())


def test_a_trained_cnn_keeps_its_top1_accuracy_in_int8() -> None:
    images, labels, train, test = digits()
    model = DigitsNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(8):
        for batch in train.split(64):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images[batch]), labels[batch]).backward()
            optimizer.step()
    model.eval()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images[train], labels[train]), batch_size=100)
    fast = graphopt.optimize(model, images[train[:100]], precision="int8", calibration=loader)
    assert len(int8_layers(fast)) == 5  # every conv and linear
    with torch.no_grad():
        float_top1 = (model(images[test]).argmax(1) == labels[test]).float().mean().item()
        int8_top1 = (fast(images[test]).argmax(1) == labels[test]).float().mean().item()
    assert float_top1 > 0.9  # trained
    assert int8_top1 >= float_top1 - 0.01, (float_top1, int8_top1)


def test_int8_layers_write_uint8_for_int8_readers() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(4, 3, 12, 12)
    fast = graphopt.optimize(model, x, precision="int8", calibration=batches(2, shape=(3, 12, 12)))
    layers = int8_layers(fast)
    assert [name for name, m in layers.items() if m.output_quantization is not None] == ["0", "2"]
    assert layers["0"].output_quantization == (layers["2"].input_scale, layers["2"].input_zero_point)
    details = {rewrite.where: rewrite.detail for rewrite in quantize_report(fast).rewrites}
    assert "int8, uint8 output for its int8 readers" in details["2"] and "uint8" not in details["4"]
    seen = []
    layers["4"].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    unchained = copy.deepcopy(fast)
    for module in int8_layers(unchained).values():
        module.output_quantization = None
    with torch.no_grad():
        chained_output = fast(x)
        assert seen == [torch.uint8]
        # the kernel rounds to the reader's levels as the reader would: at most a level apart where float rounding differs
        assert relative_error(unchained(x), chained_output) < 1e-3
        assert int(layers["2"](layers["0"](x.contiguous(memory_format=torch.channels_last))).max()) <= layers["2"].input_max


def test_int8_conv_writing_uint8_quantizes_a_float_operand_to_its_levels() -> None:
    # quantize_int8 never plans this (a conv adding into float writes float), but the module computes it: the sum in
    # float32 (negative parts of the operand count before the ReLU), then quantized
    conv = Int8Conv(torch.randn(8, 4, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, [2, 4, 6, 6], 0.05, 0, PostOp("relu"), binary=True)
    conv.output_quantization = (0.1, 0)
    x, other = torch.rand(2, 4, 6, 6), torch.randn(2, 8, 6, 6)
    kept = other.clone()
    actual = conv(x, other)
    levels = torch.clamp(torch.round(F.relu(reference_conv(conv, x) + other) / 0.1), 0, conv.input_max)
    assert actual.dtype == torch.uint8 and (actual.float() - levels).abs().max() <= 1  # a level apart where rounding differs
    assert torch.equal(other, kept)


class Residual(nn.Module):
    """Two residual blocks (the first block's output is the second's conv input and the operand its conv adds into),
    then a projection block whose second conv adds into the first's output (ResNet's downsample), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.blocks = nn.ModuleList(nn.ModuleDict({"a": nn.Conv2d(8, 8, 3, padding=1), "b": nn.Conv2d(8, 8, 3, padding=1)}) for _ in range(2))
        self.c, self.projection = nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(8, 16, 1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        for block in self.blocks:
            y = F.relu(block["b"](F.relu(block["a"](y))) + y)
        z = self.c(y)
        y = F.relu(self.projection(y) + z)
        return self.head(y.mean((2, 3)))


def test_the_residual_stream_stays_uint8_between_int8_convs() -> None:
    model = Residual().eval()
    x = torch.randn(4, 3, 12, 12)
    fast = graphopt.optimize(model, x, precision="int8", calibration=batches(2, shape=(3, 12, 12)))
    layers = int8_layers(fast)
    # the last add goes into c or the projection, whichever runs second; the other is only added into
    adder, added = ("c", "projection") if layers["c"].binary else ("projection", "c")
    uint8_out = sorted(name for name, m in layers.items() if m.output_quantization is not None)
    # every conv writes uint8 but the last adder, whose result feeds the pool; the conv only added into, at the range observed
    assert uint8_out == sorted(["blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", added, "stem.0"])
    first, second, last = layers["blocks.0.b"], layers["blocks.1.b"], layers[adder]
    assert all(m.adds_in_kernel and m.into_other for m in (first, second, last))
    assert first.accum_quantization == layers["stem.0"].output_quantization
    assert second.accum_quantization == first.output_quantization == (layers["blocks.1.a"].input_scale, layers["blocks.1.a"].input_zero_point)
    assert last.accum_quantization == layers[added].output_quantization != (last.input_scale, last.input_zero_point)
    seen = {}
    for name in ("blocks.1.a", "blocks.1.b", adder):
        layers[name].register_forward_pre_hook(lambda module, args, name=name: None if seen.setdefault(name, [a.dtype for a in args]) else None)
    unchained = copy.deepcopy(fast)
    for module in int8_layers(unchained).values():
        module.output_quantization = module.accum_quantization = None
    with torch.no_grad():
        assert 0 < relative_error(model(x), fast(x)) <= graphopt.precision.DEFAULT_INT8_ACCURACY
        for other in (x, torch.randn(6, 3, 12, 12)):  # the example, and another batch
            # each uint8 tensor rounded once more, to its readers' levels: over 8 seeds measured up to 1.3e-2 with 256
            # levels, 1.8e-2 with 128 (CPUs without VNNI)
            assert relative_error(unchained(other), fast(other)) < 3e-2
    assert seen == {name: [torch.uint8] * count for name, count in (("blocks.1.a", 1), ("blocks.1.b", 2), (adder, 2))}


def test_a_layer_int8_does_not_speed_up_stays_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantize, "has_int8_dot_products", lambda: False)  # a CPU without VNNI/AMX: each layer is timed
    monkeypatch.setattr(quantize, "compare_latency", timed_as(2.0, 1.01, 1.5))  # stem.0, conv, head, in graph order; the graph
    model = Block().eval()
    x = torch.randn(4, 3, 16, 16)
    fast = graphopt.optimize(model, x, precision="int8", calibration=batches(2))
    assert sorted(int8_layers(fast)) == ["head", "stem.0"]
    (skip,) = quantize_report(fast).skips
    assert skip.where == "conv" and skip.reason.startswith("kept in float32: int8 measured 1.01x its float32 kernel on the example")
    assert "int8 stays only 1.02x faster or more" in skip.reason
    details = {rewrite.where: rewrite.detail for rewrite in quantize_report(fast).rewrites}
    assert "2.00x its float32 kernel on the example" in details["stem.0"] and "1.50x" in details["head"]
    with torch.no_grad():
        assert relative_error(model(x), fast(x)) <= graphopt.precision.DEFAULT_INT8_ACCURACY


def test_with_int8_dot_products_the_whole_graph_is_timed_and_int8_kept_only_where_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantize, "has_int8_dot_products", lambda: True)  # VNNI/AMX: the layers are not timed alone
    timed = []

    def graph_timing(ratio: float):
        def compare(baseline, candidate, threshold, budget_s, asks):
            timed.append(budget_s)
            return timed_as(ratio)(baseline, candidate, threshold, budget_s, asks)

        return compare

    model, x = Block().eval(), torch.randn(4, 3, 16, 16)
    monkeypatch.setattr(quantize, "compare_latency", graph_timing(1.5))
    fast = graphopt.optimize(model, x, precision="int8", calibration=batches(2))
    assert timed == [quantize.GRAPH_TIMING_BUDGET_S]  # once, the graph: no layer alone
    assert sorted(int8_layers(fast)) == ["conv", "head", "stem.0"]
    assert "with its 3 int8 layers the graph runs 1.50x the float32 graph on the example" in quantize_report(fast).notes[0]
    # not faster as a whole: every layer stays in float32, each saying why
    monkeypatch.setattr(quantize, "compare_latency", graph_timing(1.01))
    with pytest.warns(UserWarning, match="so this is the default float32 call's result"):
        slow = graphopt.optimize(model, x, precision="int8", calibration=batches(2))
    assert int8_layers(slow) == {} and not quantize_report(slow).modified
    report = quantize_report(slow)
    assert report.notes[0].startswith("int8 left out: with its 3 int8 layers the graph measured 1.01x the float32 graph")
    assert {skip.where for skip in report.skips} == {"conv", "head", "stem.0"}
    assert all("int8 stays only 1.02x faster or more" in skip.reason for skip in report.skips)
    with torch.no_grad():
        assert relative_error(model(x), slow(x)) < 1e-5

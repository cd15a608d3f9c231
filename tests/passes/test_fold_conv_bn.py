"""fold_conv_bn: structure, numerics and every guard, in module, functional and ATen form."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops import batch_norm_view, weighted_op_view
from graphopt.passes.fold_conv_bn import fold_conv_bn
from tests.conftest import FRONTENDS, ConvOutputReused, assert_same_outputs, captured, context, randomize_batch_norms

CONVS = {
    "conv1d": (nn.Conv1d, nn.BatchNorm1d, (2, 4, 9)),
    "conv2d": (nn.Conv2d, nn.BatchNorm2d, (2, 4, 7, 7)),
    "conv3d": (nn.Conv3d, nn.BatchNorm3d, (2, 4, 5, 5, 5)),
    "conv_transpose1d": (nn.ConvTranspose1d, nn.BatchNorm1d, (2, 4, 9)),
    "conv_transpose2d": (nn.ConvTranspose2d, nn.BatchNorm2d, (2, 4, 7, 7)),
    "conv_transpose3d": (nn.ConvTranspose3d, nn.BatchNorm3d, (2, 4, 5, 5, 5)),
}


def batch_norms(gm) -> list:
    return [node for node in gm.graph.nodes if batch_norm_view(gm, node) is not None]


def fold_and_check(model: nn.Module, inputs: tuple, frontend: str, folded: int, tolerance: float = 1e-5):
    """Fold, then assert the rewrite count and that outputs match the eager model (`assert_same_outputs`)."""
    model = randomize_batch_norms(model).eval()
    gm = captured(model, inputs, frontend)
    result = fold_conv_bn(gm, context(inputs))
    assert result.modified is (folded > 0)
    assert len(result.report.rewrites) == folded
    assert_same_outputs(model, gm, inputs, tolerance)
    return gm, result.report


class ConvBN(nn.Module):
    def __init__(self, conv: type[nn.Module], norm: type[nn.Module], bias: bool, groups: int = 1) -> None:
        super().__init__()
        self.conv = conv(4, 6, 3, bias=bias, groups=groups)
        self.bn = norm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", CONVS)
def test_folds_every_conv_rank_and_kind(kind: str, bias: bool, frontend: str) -> None:
    conv, norm, shape = CONVS[kind]
    inputs = (torch.randn(shape),)
    gm, report = fold_and_check(ConvBN(conv, norm, bias), inputs, frontend, folded=1)
    assert batch_norms(gm) == []
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gm.modules())
    assert not [name for name, _ in gm.named_buffers() if "running" in name]
    assert report.rewrites[0].detail.endswith(kind)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_folds_grouped_and_depthwise_convs(frontend: str) -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 1, groups=2), nn.BatchNorm2d(6))
    fold_and_check(model, (torch.randn(2, 4, 6, 6),), frontend, folded=2)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_folds_linear_into_batchnorm1d(frontend: str, bias: bool) -> None:
    model = nn.Sequential(nn.Linear(5, 6, bias=bias), nn.BatchNorm1d(6), nn.ReLU())
    gm, _ = fold_and_check(model, (torch.randn(4, 5),), frontend, folded=1)
    assert batch_norms(gm) == []


class FunctionalConvBN(nn.Module):
    """Parameters stored on the module, used through torch.nn.functional."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4, 3, 3))
        self.conv_bias = nn.Parameter(torch.randn(6)) if bias else None
        self.gamma = nn.Parameter(torch.randn(6))
        self.beta = nn.Parameter(torch.randn(6))
        self.register_buffer("mean", torch.randn(6))
        self.register_buffer("var", torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x, self.weight, self.conv_bias, padding=1)
        return F.batch_norm(y, self.mean, self.var, self.gamma, self.beta, training=False, eps=1e-3)


@pytest.mark.parametrize("bias", [True, False])
def test_folds_functional_form_and_drops_batchnorm_state(bias: bool) -> None:
    inputs = (torch.randn(2, 4, 5, 5),)
    model = FunctionalConvBN(bias).eval()
    gm, _ = fold_and_check(model, inputs, "fx", folded=1)
    assert batch_norms(gm) == []
    names = {name for name, _ in [*gm.named_parameters(), *gm.named_buffers()]}
    assert names.isdisjoint({"gamma", "beta", "mean", "var"})
    assert "weight" in names


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_one_batchnorm_module_shared_by_two_convs_folds_into_both(frontend: str) -> None:
    class SharedNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.bn = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.a(x)) + self.bn(self.b(x))

    gm, _ = fold_and_check(SharedNorm(), (torch.randn(2, 3, 6, 6),), frontend, folded=2)
    assert batch_norms(gm) == []


# --------------------------------------------------------------------------- guards


def assert_skipped(model: nn.Module, gm, report, inputs, reason: str) -> None:
    """Nothing folded, for ``reason``, and the outputs are still the eager model's (`assert_same_outputs`)."""
    assert report.rewrites == []
    assert any(reason in skip.reason for skip in report.skips), report.skips
    assert len(batch_norms(gm)) >= 1
    assert_same_outputs(model, gm, inputs, 1e-6)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_conv_output_with_other_users(frontend: str) -> None:
    model = randomize_batch_norms(ConvOutputReused()).eval()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, frontend)
    report = fold_conv_bn(gm, context(inputs)).report
    assert_skipped(model, gm, report, inputs, "output has 2 users")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_batchnorm_without_running_stats(frontend: str) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, frontend)
    report = fold_conv_bn(gm, context(inputs)).report
    assert_skipped(model, gm, report, inputs, "batch statistics")


def test_guard_batchnorm_in_training_mode() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, "fx")
    report = fold_conv_bn(gm, context(inputs)).report
    assert report.rewrites == [] and "batch statistics" in report.skips[0].reason


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_conv_module_called_twice(frontend: str) -> None:
    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(self.bn(self.conv(x)))  # the second call must not see folded weights

    model = randomize_batch_norms(Reused()).eval()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, frontend)
    report = fold_conv_bn(gm, context(inputs)).report
    reason = "called at 2 places" if frontend == "fx" else "also read by another op"
    assert_skipped(model, gm, report, inputs, reason)


def test_guard_tied_weights() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.bn = nn.Conv2d(3, 3, 3), nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.a(x)) + self.b(x)

    model = randomize_batch_norms(Tied()).eval()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, "fx")
    report = fold_conv_bn(gm, context(inputs)).report
    assert_skipped(model, gm, report, inputs, "tied to b.weight")


def test_guard_non_floating_point_parameters() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    model[0].weight = nn.Parameter(torch.ones(4, 3, 3, 3, dtype=torch.int32), requires_grad=False)
    gm = torch.fx.symbolic_trace(model)  # integer convs do not run on CPU: check the guard only
    report = fold_conv_bn(gm, context(())).report
    assert report.rewrites == [] and "non-floating-point" in report.skips[0].reason


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_linear_feeding_batchnorm1d_on_3d_input(frontend: str) -> None:
    # BatchNorm1d on (N, C, L) normalises dim 1, which is not the linear's feature axis
    model = randomize_batch_norms(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))).eval()
    inputs = (torch.randn(2, 4, 4),)
    gm = captured(model, inputs, frontend)
    report = fold_conv_bn(gm, context(inputs)).report
    assert_skipped(model, gm, report, inputs, "3-D linear output")


def test_guard_grouped_transposed_conv() -> None:
    model = randomize_batch_norms(nn.Sequential(nn.ConvTranspose2d(4, 6, 3, groups=2), nn.BatchNorm2d(6))).eval()
    inputs = (torch.randn(2, 4, 5, 5),)
    gm = captured(model, inputs, "fx")
    report = fold_conv_bn(gm, context(inputs)).report
    assert_skipped(model, gm, report, inputs, "grouped transposed")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_batchnorm_not_after_a_conv(frontend: str) -> None:
    model = randomize_batch_norms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4))).eval()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, frontend)
    report = fold_conv_bn(gm, context(inputs)).report
    assert_skipped(model, gm, report, inputs, "does not come from a conv or linear")


def test_guard_conv_subclass_overriding_forward() -> None:
    class ScaledConv(nn.Conv2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = randomize_batch_norms(nn.Sequential(ScaledConv(3, 4, 3), nn.BatchNorm2d(4))).eval()
    inputs = (torch.randn(2, 3, 6, 6),)
    tracer = torch.fx.Tracer()
    tracer.is_leaf_module = lambda module, name: isinstance(module, nn.Conv2d | nn.BatchNorm2d)  # type: ignore[method-assign]
    gm = torch.fx.GraphModule(model, tracer.trace(model))
    report = fold_conv_bn(gm, context(inputs)).report
    assert_skipped(model, gm, report, inputs, "overrides forward()")


def test_no_batchnorm_means_no_change() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model.eval(), inputs, "fx")
    code = gm.code
    result = fold_conv_bn(gm, context(inputs))
    assert not result.modified and result.report.skips == [] and gm.code == code
    assert weighted_op_view(gm, next(n for n in gm.graph.nodes if n.op == "call_module")) is not None


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("layer, norm, shape", [(nn.Linear(4, 3), nn.BatchNorm1d, (2, 4)), (nn.Conv2d(3, 3, 3), nn.BatchNorm2d, (2, 3, 6, 6))])
def test_folds_batchnorm_without_affine_parameters(frontend: str, layer: nn.Module, norm: type[nn.Module], shape: tuple) -> None:
    # found by the fuzzer: the missing weight/bias of BatchNorm(affine=False) mean 1 and 0
    gm, _ = fold_and_check(nn.Sequential(layer, norm(3, affine=False)), (torch.randn(shape),), frontend, folded=1)
    assert batch_norms(gm) == []

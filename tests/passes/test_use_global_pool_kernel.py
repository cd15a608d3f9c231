"""use_global_pool_kernel: structure, numerics and every guard, in module, functional and ATen form."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.passes.use_global_pool_kernel import use_global_pool_kernel
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context

KERNEL = torch.ops.aten._adaptive_avg_pool2d.default
# the kernel's result and mean's are the same value, each rounded once to bf16/fp16: one bf16
# rounding (< 2^-7 of the value) apart at most, so less than 8e-3 of the output's scale
ONE_ROUNDING = 8e-3


class ModulePool(nn.Module):
    def __init__(self, output_size=1) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(x), 1)


class FunctionalPool(nn.Module):
    """A squeeze-excitation scale: pooled by F.adaptive_avg_pool2d with a (1, 1) size, then multiplied back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(F.adaptive_avg_pool2d(x, (1, 1)))


def low_channels_last(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).contiguous(memory_format=torch.channels_last)


def kernel_calls(gm) -> list:
    return [node for node in gm.graph.nodes if node.target is KERNEL]


def rewrite(model: nn.Module, x: torch.Tensor, frontend: str, rewritten: int):
    """Run the pass; assert the rewrite count, the example's output strides and that the outputs equal the original's to bf16 rounding."""
    gm = captured(model, (x,), frontend)
    result = use_global_pool_kernel(gm, context((x,)))
    assert len(result.report.rewrites) == rewritten and len(kernel_calls(gm)) == rewritten
    assert gm(x).stride() == model(x).stride()
    assert_same_outputs(model, gm, (x,), ONE_ROUNDING)
    return gm, result.report


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("model", [ModulePool(), ModulePool((1, 1)), FunctionalPool()], ids=["module", "module-tuple", "functional"])
def test_rewrites_global_pools_of_bf16_channels_last_tensors(model: nn.Module, frontend: str) -> None:
    rewrite(model.eval(), low_channels_last(2, 8, 12, 12), frontend, rewritten=1)


def test_rewrites_fp16_too() -> None:
    rewrite(ModulePool().eval(), low_channels_last(2, 8, 6, 6, dtype=torch.float16), "fx", rewritten=1)


def test_the_kernel_takes_other_spatial_sizes() -> None:
    model = FunctionalPool().eval()
    gm, _ = rewrite(model, low_channels_last(2, 8, 12, 12), "fx", rewritten=1)
    assert_same_outputs(model, gm, (low_channels_last(3, 8, 7, 5),), ONE_ROUNDING)


@pytest.mark.parametrize(
    ("model", "x", "reason"),
    [
        (ModulePool(), torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last), "float32 tensor: mean is as fast"),
        (ModulePool(), torch.randn(2, 8, 6, 6).bfloat16(), "NCHW tensor"),
    ],
    ids=["fp32", "nchw"],
)
def test_guards_leave_the_pool_with_the_reason(model: nn.Module, x: torch.Tensor, reason: str) -> None:
    _, report = rewrite(model.eval(), x, "fx", rewritten=0)
    assert [skip.reason for skip in report.skips] == [report.skips[0].reason] and reason in report.skips[0].reason


def test_pools_to_other_sizes_are_not_candidates() -> None:
    _, report = rewrite(ModulePool(2).eval(), low_channels_last(2, 8, 6, 6), "fx", rewritten=0)
    assert not report.skips


def test_bf16_channels_last_optimize_uses_the_kernel() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 3, 16, 16)
    optimized = graphopt.optimize(model, (x,), precision="bf16", memory_format="channels_last")
    assert len(kernel_calls(optimized.graph_module)) == 1
    fp32 = graphopt.optimize(model, (x,), memory_format="channels_last")
    assert not kernel_calls(fp32.graph_module) and fp32.graphopt_report["use_global_pool_kernel"].skips
    preserved = graphopt.optimize(model, (x,), precision="bf16", memory_format="preserve")
    assert not kernel_calls(preserved.graph_module), "use_low_precision runs first even without to_channels_last: NCHW is seen"
    assert "NCHW" in preserved.graphopt_report["use_global_pool_kernel"].skips[0].reason

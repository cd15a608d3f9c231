"""Op constants that are graph values, through optimize: each pass skips the op with the reason instead of crashing.

fx keeps a number, flag or dtype passed to forward() as a placeholder, and a size read
from a tensor is computed in the graph (under torch.export too, where other non-tensor
arguments are specialised). The views report such a constant as unknown
(`Arguments.not_constant`); each model here optimizes in inference and training mode,
its report says which pass left which op alone and why, and the optimized module agrees
with the model on a second input and on another value of the argument.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.pipeline import cpu_kernel_passes, preset_with

NOT_READABLE = "not a constant: graphopt cannot read it when optimizing"
# every pass that reads the views: the preset, plus the opt-in oneDNN kernels (inference) and drop_conv_bias (training)
PASSES = {
    "inference": cpu_kernel_passes("fp32", "channels_last"),
    "training": preset_with("training", ["drop_conv_bias"], low_precision=False, channels_last=True),
}


class ConvBatchNorm(nn.Module):
    """conv -> F.batch_norm -> relu, with one batch_norm argument passed to forward()."""

    def __init__(self, argument: str) -> None:
        super().__init__()
        self.argument = argument
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, value: float) -> torch.Tensor:
        bn = self.bn
        arguments = {"training": self.training, "momentum": 0.1, "eps": 1e-5, self.argument: value}
        return F.batch_norm(self.conv(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, **arguments).relu()


class Conv(nn.Module):
    """F.conv2d with one argument passed to forward() (or computed by ``value_of``), then a BatchNorm."""

    def __init__(self, argument: str, value_of: Callable[[torch.Tensor, Any], Any] = lambda x, value: value) -> None:
        super().__init__()
        self.argument, self.value_of = argument, value_of
        self.weight, self.bias = nn.Parameter(torch.randn(4, 2, 3, 3) / 4), nn.Parameter(torch.randn(4))
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, value: Any = None) -> torch.Tensor:
        arguments = {"groups": 2, self.argument: self.value_of(x, value)}
        return self.bn(F.conv2d(x, self.weight, self.bias, **arguments)).relu()


class Dropout(nn.Module):
    """conv -> F.dropout, its p (with training=self.training) or its training flag passed to forward()."""

    def __init__(self, argument: str) -> None:
        super().__init__()
        self.argument = argument
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        arguments = {"p": 0.5, "training": self.training, self.argument: value}
        return F.dropout(self.conv(x), **arguments)


class LeakyLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, slope: float) -> torch.Tensor:
        return F.leaky_relu(self.linear(x), slope)


class Attention(nn.Module):
    """softmax(q @ k^T * scale) @ v, with the softmax's dim or the first dim the key's transpose swaps passed to forward()."""

    def __init__(self, argument: str) -> None:
        super().__init__()
        self.argument = argument

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, value: int) -> torch.Tensor:
        first, dim = (value if self.argument == "transposed" else -2), (value if self.argument == "dim" else -1)
        return torch.softmax(q @ k.transpose(first, -1) * 0.25, dim) @ v


class Cast(nn.Module):
    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (x * 2).to(dtype)


class CastConstant(nn.Module):
    """A tensor constant (symbolic_trace stores it) cast to a dtype passed to forward()."""

    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x + torch.full((8,), 1000.1).to(dtype)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    args: Callable[[], tuple[Any, ...]]
    other_value: Any  # forward()'s last argument in another call, where a pass left the op alone (None: no other call)
    expected: dict[str, tuple[str, str] | None]  # mode -> (the pass, what its report says), or None: nothing reads it


def images(channels: int = 3) -> torch.Tensor:
    return torch.randn(4, channels, 8, 8)


def attention_inputs() -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(2, 3, 5, 8) for _ in range(3))


def reason(argument: str, node: str, origin: str) -> str:
    return f"the {argument} argument of '{node}' is {origin}, {NOT_READABLE}"


CASES = {
    "batch_norm_eps": Case(
        lambda: ConvBatchNorm("eps"), lambda: (images(), 1e-3), 1e-1,
        {mode: (name, reason("eps", "batch_norm", "forward() argument 'value'")) for mode, name in (("inference", "fold_conv_bn"), ("training", "drop_conv_bias"))},
    ),
    "conv_groups": Case(
        lambda: Conv("groups"), lambda: (images(4), 2), 2,
        {mode: (name, reason("groups", "conv2d", "forward() argument 'value'")) for mode, name in (("inference", "fold_conv_bn"), ("training", "drop_conv_bias"))},
    ),
    "conv_stride": Case(  # only the kernel pass needs it: the BatchNorm is still folded
        lambda: Conv("stride"), lambda: (images(4), 2), 1,
        {"inference": ("use_onednn_kernels", reason("stride", "conv2d", "forward() argument 'value'")), "training": None},
    ),
    "conv_padding_from_the_batch_size": Case(
        lambda: Conv("padding", lambda x, _: x.shape[0] // 4), lambda: (images(4),), None,
        {"inference": ("use_onednn_kernels", reason("padding", "conv2d", "computed in the graph ('floordiv')")), "training": None},
    ),
    "dropout_p": Case(  # inference: training=False is a constant, so the dropout goes whatever p is
        lambda: Dropout("p"), lambda: (images(), 0.3), 0.7,
        {"inference": None, "training": ("to_channels_last", "(read as active: " + reason("p", "dropout", "forward() argument 'value'"))},
    ),
    "dropout_training": Case(
        lambda: Dropout("training"), lambda: (images(), False), True,
        {
            "inference": ("remove_dropout", "dropout may be active at run time: " + reason("training", "dropout", "forward() argument 'value'")),
            "training": ("to_channels_last", "(read as active: " + reason("training", "dropout", "forward() argument 'value'")),
        },
    ),
    "leaky_relu_slope": Case(
        LeakyLinear, lambda: (torch.randn(4, 8), 0.2), 0.05,
        {"inference": ("use_onednn_kernels", "not fused into the linear: " + reason("negative_slope", "leaky_relu", "forward() argument 'slope'")), "training": None},
    ),
    "softmax_dim": Case(
        lambda: Attention("dim"), lambda: (*attention_inputs(), -1), 3,
        {mode: ("use_attention_kernel", reason("dim", "softmax", "forward() argument 'value'")) for mode in ("inference", "training")},
    ),
    "transposed_dim": Case(
        lambda: Attention("transposed"), lambda: (*attention_inputs(), -2), 2,
        {mode: ("use_attention_kernel", "the keys are not transposed in the graph") for mode in ("inference", "training")},
    ),
    "cast_dtype": Case(  # a no-op cast on the example (float32), not in another call
        Cast, lambda: (torch.randn(4, 8), torch.float32), torch.float64,
        {mode: ("remove_redundant_transfers", reason("device/dtype", "to", "forward() argument 'dtype'")) for mode in ("inference", "training")},
    ),
    "constant_cast_dtype": Case(  # not stored in the example's dtype (float16 rounds it to 1000): cast at run time
        CastConstant, lambda: (torch.randn(4, 8), torch.float16), torch.float32,
        {mode: ("create_on_device", reason("device/dtype", "to", "forward() argument 'dtype'")) for mode in ("inference", "training")},
    ),
}


def call(module: nn.Module, args: tuple[Any, ...]) -> Any:
    torch.manual_seed(0)  # the same dropout masks
    return module(*args)


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_graph_valued_constant_is_skipped_with_its_reason(name: str, mode: str) -> None:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().train(mode == "training")
    args = case.args()
    optimized = graphopt.optimize(model, args, frontend="fx", mode=mode, passes=PASSES[mode], memory_format="channels_last", verify="strict")
    report = optimized.graphopt_report
    assert report.second_input and report.second_input_error is not None, "verified on a second input"

    expected = case.expected[mode]
    calls = [args]
    if expected is not None:
        pass_name, said = expected
        assert any(said in skip.reason for skip in report[pass_name].skips), report[pass_name].skips
        if case.other_value is not None:  # what the pass left alone must not have been decided from the example's value
            calls.append((*args[:-1], case.other_value))
    reference = copy.deepcopy(model)
    for inputs in calls:
        torch.testing.assert_close(call(optimized, inputs), call(reference, inputs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["batch_norm_momentum", "conv_stride"])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_graph_value_no_pass_needs_blocks_nothing(name: str, mode: str) -> None:
    """The BatchNorm folds (inference) or its conv's bias drops (training) whatever the momentum or the stride."""
    torch.manual_seed(0)
    model = (ConvBatchNorm("momentum") if name == "batch_norm_momentum" else Conv("stride")).train(mode == "training")
    args = (images(), 0.3) if name == "batch_norm_momentum" else (images(4), 2)
    optimized = graphopt.optimize(model, args, frontend="fx", mode=mode, passes=PASSES[mode], memory_format="channels_last", verify="strict")
    pass_name = "fold_conv_bn" if mode == "inference" else "drop_conv_bias"
    assert optimized.graphopt_report[pass_name].rewrites and not optimized.graphopt_report[pass_name].skips


def test_a_size_computed_under_torch_export_is_skipped_with_its_reason() -> None:
    """torch.export specialises non-tensor arguments, but a size of a dynamic dimension stays a graph value."""
    torch.manual_seed(0)
    model = Conv("padding", lambda x, _: x.shape[0] // 4).eval()
    optimized = graphopt.optimize(model, (images(4),), frontend="export", passes=PASSES["inference"], memory_format="channels_last", verify="strict")
    report = optimized.graphopt_report
    assert report.frontend == "export" and report.second_input_error is not None
    assert any(reason("padding", "conv2d", "computed in the graph ('floordiv')") in skip.reason for skip in report["use_onednn_kernels"].skips)
    bigger = (torch.randn(9, 4, 8, 8),)  # padding 2 instead of 1
    torch.testing.assert_close(optimized(*bigger), model(*bigger), rtol=1e-4, atol=1e-5)

"""Shared test helpers: capture a small model in each graph form and compare outputs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphopt
from graphopt.passes import PassContext

FRONTENDS = ("fx", "export")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def model_state(model: nn.Module) -> tuple[Any, ...]:
    """Everything a public call must leave alone: tensors (bytes), training flags, hooks."""
    tensors = tuple((name, t.dtype, tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for name, t in model.state_dict().items())
    flags = tuple(m.training for m in model.modules())
    hooks = tuple(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    return tensors, flags, hooks


def captured(model: nn.Module, inputs: tuple[Any, ...], frontend: str) -> fx.GraphModule:
    """``model`` captured by ``frontend``; checks that ``model`` itself was left untouched."""
    before = model_state(model)
    gm = graphopt.capture(model, inputs, frontend=frontend)
    assert model_state(model) == before, "capture changed the user's model"
    return gm


def context(inputs: tuple[Any, ...], mode: str = "inference") -> PassContext:
    return PassContext(mode=mode, example_inputs=inputs)  # type: ignore[arg-type]


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """max |actual - expected| relative to the largest magnitude of ``expected``."""
    return float((expected.detach() - actual.detach()).abs().max() / expected.detach().abs().max())


def randomize_batch_norms(model: nn.Module) -> nn.Module:
    """Give every BatchNorm non-trivial statistics and affine parameters, so folding is really tested."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            features = module.num_features
            with torch.no_grad():
                if module.running_mean is not None:
                    module.running_mean.copy_(torch.randn(features, generator=generator))
                    module.running_var.copy_(torch.rand(features, generator=generator) + 0.5)
                if module.affine:
                    module.weight.copy_(torch.randn(features, generator=generator))
                    module.bias.copy_(torch.randn(features, generator=generator))
    return model


class ConvOutputReused(nn.Module):
    """A conv whose raw output is also read on a path without the BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


class ShapeBranch(nn.Module):
    """Python control flow on a shape: symbolic_trace cannot follow it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if y.shape[-1] > 2:
            y = torch.relu(y)
        return y


def assert_trains_like(model: nn.Module, optimized: nn.Module, inputs: tuple[Any, ...]) -> None:
    """Forward (same dropout masks) and the gradient of every parameter ``optimized`` kept match a copy of ``model``."""
    reference = copy.deepcopy(model)
    torch.manual_seed(3)
    expected = reference(*inputs)
    torch.manual_seed(3)
    actual = optimized(*inputs)
    assert relative_error(expected, actual) < 1e-5
    expected.square().mean().backward()
    actual.square().mean().backward()
    reference_grads = dict(reference.named_parameters())
    for name, parameter in optimized.named_parameters():
        torch.testing.assert_close(parameter.grad, reference_grads[name].grad, rtol=1e-3, atol=1e-5)

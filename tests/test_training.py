"""Training with the optimized module: the same losses, weights and statistics as the original, step by step."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.checkpoint import to_optimized
from graphopt.models import REFERENCE_MODELS
from graphopt.verify import tolerance_for
from tests.conftest import randomize_batch_norms, relative_error

CNNS = ("resnet", "mobilenet_v2", "convnext")
STEPS = 4


def batches(steps: int = STEPS, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches in turn: statistics see different data, and the loss on each falls as the model fits them."""
    generator = torch.Generator().manual_seed(7)
    pair = [(torch.randn(size, 3, 32, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator)) for _ in range(2)]
    return [pair[step % 2] for step in range(steps)]


def train(module: nn.Module, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[float]:
    """SGD with momentum over `batches`; the same dropout masks for every module (seeded per step)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for step, (images, labels) in enumerate(batches()):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss = F.cross_entropy(forward(module, images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def eager(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
    return module(images)


def autocast_bf16_channels_last(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The playbook by hand: channels_last inputs (the module converted too) under bf16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return module(images.contiguous(memory_format=torch.channels_last)).float()


def assert_same_state(optimized: graphopt.OptimizedModule, reference: nn.Module, tolerance: float) -> None:
    """Every parameter and BatchNorm statistic, the reference's mapped into the optimized module's form."""
    expected_state = to_optimized(reference.state_dict(), optimized.state_changes)
    for key, value in optimized.state_dict().items():
        expected = expected_state[key]
        if value.is_floating_point():
            assert relative_error(expected, value) < tolerance, key
        else:
            assert torch.equal(value, expected), key  # num_batches_tracked counts the same steps


@pytest.mark.parametrize("name", CNNS)
def test_fp32_sgd_steps_match_the_original(name: str) -> None:
    """The training preset (drop_conv_bias, channels_last) gives the original's losses, weights and statistics."""
    model = randomize_batch_norms(REFERENCE_MODELS[name].build()).train()
    optimized = graphopt.optimize(model, (batches()[0][0],), frontend="fx", memory_format="channels_last")
    reference = copy.deepcopy(model)

    expected_losses, losses = train(reference, eager), train(optimized, eager)
    assert losses[-2] < losses[0] and losses[-1] < losses[1], f"the optimized model learns: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-4, atol=0)
    assert_same_state(optimized, reference, 1e-4)

    reference.eval()
    optimized.eval()
    images = batches()[0][0]
    assert relative_error(reference(images), optimized(images)) < 1e-4


@pytest.mark.parametrize("name", CNNS)
def test_bf16_sgd_steps_match_autocast(name: str) -> None:
    """graphopt's bf16 casts train like torch.autocast on the same layout, within bf16's tolerance.

    drop_conv_bias is left out here: see the next test.
    """
    model = REFERENCE_MODELS[name].build().train()
    optimized = graphopt.optimize(
        model, (batches()[0][0],), frontend="fx", memory_format="channels_last", precision="bf16", disable=["drop_conv_bias"]
    )
    reference = copy.deepcopy(model).to(memory_format=torch.channels_last)

    expected_losses, losses = train(reference, autocast_bf16_channels_last), train(optimized, eager)
    assert losses[-2] < losses[0] and losses[-1] < losses[1], f"the optimized model learns: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-2, atol=0)
    assert all(p.dtype == torch.float32 for p in optimized.parameters()), "fp32 weights, gradients and optimizer state"
    assert_same_state(optimized, reference, tolerance_for(torch.bfloat16))


def test_bf16_training_preset_follows_autocast_losses() -> None:
    """With drop_conv_bias, bf16 rounds the conv output without its bias (autocast rounds conv + bias).

    Both are bf16 approximations of the fp32 gradients, about equally far from them (here
    conv weight gradients differ from fp32 by 20-30% either way), so weights are not
    comparable within a tolerance after a few steps; the losses stay within 1%.
    """
    model = REFERENCE_MODELS["resnet"].build().train()
    optimized = graphopt.optimize(model, (batches()[0][0],), frontend="fx", memory_format="channels_last", precision="bf16")
    assert len(optimized.graphopt_report["drop_conv_bias"].rewrites) == 5
    reference = copy.deepcopy(model).to(memory_format=torch.channels_last)

    expected_losses, losses = train(reference, autocast_bf16_channels_last), train(optimized, eager)
    assert losses[-2] < losses[0] and losses[-1] < losses[1], f"the optimized model learns: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-2, atol=0)

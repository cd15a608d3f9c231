"""fp16 training with loss scaling: `torch.amp.GradScaler` works through graphopt's explicit casts as through autocast.

On the CPU, where torch runs fp16 (the CUDA check is in `make bench-gpu`'s machine, not here).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt

pytestmark = pytest.mark.filterwarnings("ignore::graphopt.errors.VerificationWarning")

# a loss this small gives fp16 activation gradients below fp16's smallest subnormal (6e-8): they underflow unscaled
LOSS_WEIGHT = 1e-9


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).train()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator)


def scaled_steps(model: nn.Module, forward: object, scaler: torch.amp.GradScaler, steps: int, loss_weight: float = LOSS_WEIGHT) -> list[float]:
    """SGD steps on the scaled loss (times ``loss_weight``); the scale after each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e6)  # the tiny loss's gradients, unscaled, move the weights
    x, y = data()
    scales = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(x), y) * loss_weight  # type: ignore[operator]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_the_scaler_rescues_gradients_that_underflow_in_fp16_and_steps_as_with_autocast() -> None:
    model = net()
    fast = graphopt.optimize(model, data()[0], precision="fp16", mode="training")
    assert "use_low_precision" in [p.name for p in fast.graphopt_report.passes if not p.rolled_back]
    x, y = data()
    (F.cross_entropy(fast(x), y) * LOSS_WEIGHT).backward()
    assert fast.get_parameter("0.weight").grad.abs().max() == 0  # underflowed in fp16, as under autocast

    reference = copy.deepcopy(model)

    def under_autocast(inputs: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return reference(inputs).float()

    fast.zero_grad(set_to_none=True)
    scales = scaled_steps(fast, fast, torch.amp.GradScaler("cpu", init_scale=2.0**16), steps=3)
    expected_scales = scaled_steps(reference, under_autocast, torch.amp.GradScaler("cpu", init_scale=2.0**16), steps=3)
    assert scales == expected_scales
    for name, parameter in reference.named_parameters():
        moved = fast.get_parameter(name) - model.get_parameter(name)
        assert moved.abs().max() > 0, name  # scaled, the gradients reached every weight
        torch.testing.assert_close(fast.get_parameter(name), parameter, rtol=1e-2, atol=1e-3)


def test_an_overflowing_scale_skips_the_step_and_backs_off() -> None:
    model = net()
    fast = graphopt.optimize(model, data()[0], precision="fp16", mode="training")
    before = {name: p.detach().clone() for name, p in fast.named_parameters()}
    scales = scaled_steps(fast, fast, torch.amp.GradScaler("cpu", init_scale=2.0**40), steps=1, loss_weight=1.0)  # fp16 overflows
    assert scales == [2.0**39]  # backed off
    for name, parameter in fast.named_parameters():
        assert torch.equal(parameter, before[name]), name  # the step was skipped: inf gradients never reached the weights

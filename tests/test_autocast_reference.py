"""A low precision is judged against torch.autocast in that precision on the same inputs, not a fixed number.

`graphopt.pipeline.Verifier.low_precision_tolerances`: a bf16 graph may reach
`verify.AUTOCAST_FACTOR` times autocast's own error (outputs; in training gradients too).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import verify
from graphopt.passes.use_low_precision import DEFAULT_FP32_OPS, DEFAULT_LOW_PRECISION_OPS

pytestmark = pytest.mark.filterwarnings("ignore::graphopt.errors.VerificationWarning")


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class CancellingResNet(nn.Module):
    """Residual conv-BatchNorm blocks and a head that subtracts two nearly equal linears: its logits are a small
    difference of large terms, which bf16 rounds coarsely, in torch.autocast as in graphopt."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, 10)
        self.shadow = nn.Linear(16, 10)
        with torch.no_grad():
            self.shadow.weight.copy_(self.head.weight * 0.97)
            self.shadow.bias.copy_(self.head.bias * 0.97)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x)).mean(dim=(2, 3))
        return self.head(features) - self.shadow(features)


class SharpSoftmax(nn.Module):
    """A softmax over large logits, then a linear: autocast keeps the softmax in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.softmax(x * 16.0, dim=-1))


def autocast_error(model: nn.Module, x: torch.Tensor, training: bool) -> tuple[float, float | None]:
    model = copy.deepcopy(model).train(training)
    check = verify.Check((x,), verify.run_reference(copy.deepcopy(model), (x,), gradients=training), "the example")
    return verify.autocast_errors(check, model, torch.bfloat16, gradients=training)


def low_precision_pass(report: graphopt.Report) -> graphopt.report.PassReport:
    return next(p for p in report.passes if p.name == "use_low_precision")


def test_bf16_training_is_kept_where_autocast_itself_is_as_far_from_fp32() -> None:
    torch.manual_seed(0)
    model, x = CancellingResNet().train(), torch.randn(4, 3, 16, 16)
    own_error, own_gradients = autocast_error(model, x, training=True)
    assert own_error > 5e-2  # beyond the fixed bf16 tolerance graphopt used before: the case this rule is for
    optimized = graphopt.optimize(model, x, precision="bf16", mode="training")
    report = optimized.graphopt_report
    kept = low_precision_pass(report)
    assert not kept.rolled_back and kept.rewrites
    assert own_error / 2 < report.max_error <= verify.AUTOCAST_FACTOR * own_error
    note = next(note for note in report.notes if "judged against torch.autocast(bfloat16) on the example inputs" in note)
    assert f"autocast's own error {own_error:.1e}" in note and f"gradients {own_gradients:.1e}" in note
    # the gradients were compared by value, against autocast's own gradient error
    assert kept.gradient_error is not None and 0 < kept.gradient_error <= verify.AUTOCAST_FACTOR * own_gradients


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_low_precision_rewrite_clearly_worse_than_autocast_is_rolled_back(training: bool) -> None:
    torch.manual_seed(0)
    model, x = SharpSoftmax().train(training), torch.randn(8, 64)
    own_error, _ = autocast_error(model, x, training=training)
    broken = graphopt.optimize(
        model, x, precision="bf16", low_precision_ops=DEFAULT_LOW_PRECISION_OPS | {"softmax"}, fp32_ops=DEFAULT_FP32_OPS - {"softmax"}, memory_format="preserve"
    )
    rolled_back = low_precision_pass(broken.graphopt_report).rolled_back
    # clearly worse than autocast, though within the fixed 5e-2 bf16 tolerance graphopt used before
    error = float(rolled_back.split(" by ")[1].split(" relative")[0])
    assert verify.AUTOCAST_FACTOR * own_error < error < 5e-2, rolled_back
    assert "softmax" in rolled_back
    torch.testing.assert_close(broken(x), model(x), rtol=1e-4, atol=1e-5)  # what is returned is the fp32 graph
    # the same model under graphopt's own policy (softmax in float32) is as close as autocast, and kept
    policy = graphopt.optimize(model, x, precision="bf16", memory_format="preserve").graphopt_report
    assert not low_precision_pass(policy).rolled_back
    assert policy.max_error <= max(verify.AUTOCAST_FACTOR * own_error, verify.low_precision_floor(torch.bfloat16))


def test_autocast_errors_are_measured_on_the_inputs_in_the_dtype_asked_for() -> None:
    torch.manual_seed(0)
    model, x = SharpSoftmax().eval(), torch.randn(8, 64)
    check = verify.Check((x,), verify.run_reference(copy.deepcopy(model), (x,)), "the example")
    bf16, _ = verify.autocast_errors(check, copy.deepcopy(model), torch.bfloat16, gradients=False)
    with torch.no_grad():
        by_hand = float((model(x) - _autocast(model, x)).abs().max() / model(x).abs().max())
    assert bf16 == pytest.approx(by_hand, rel=1e-6) and bf16 > 0
    fp32_model = nn.Sequential(nn.ReLU())  # no op autocast lowers: its error is zero, one bf16 rounding is the floor
    check = verify.Check((x,), verify.run_reference(fp32_model, (x,)), "the example")
    assert verify.autocast_errors(check, fp32_model, torch.bfloat16, gradients=False) == (0.0, None)
    assert verify.low_precision_floor(torch.bfloat16) == 2**-7 and verify.low_precision_floor(torch.float16) == 2**-10


def _autocast(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float()

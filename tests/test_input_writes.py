"""A forward that writes to its inputs in place: refused, naming the op and the input, and the caller's tensors left as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphopt
from tests.conftest import FRONTENDS


class Doubles(nn.Module):
    """Writes its first input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, bias):
        x.mul_(2)
        return self.linear(x) + bias


class ShiftsFirstRow(nn.Module):
    """Writes one row of its second input, through a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, bias):
        bias[0] += 1
        return self.linear(x) + bias


CASES = {"x.mul_(2)": (Doubles, r"input x in place \(aten\.mul_\.Tensor\)"), "bias[0] += 1": (ShiftsFirstRow, r"input bias in place \(aten\.add_\.Tensor\)")}


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("case", CASES)
def test_a_forward_that_writes_its_inputs_is_refused_and_the_callers_tensors_stay_bit_identical(case: str, frontend: str, mode: str) -> None:
    model_class, written = CASES[case]
    x = torch.randn(3, 4)
    bias = torch.randn(3, 8)[:, ::2]  # a strided view: its base must stay untouched too
    before = [x.clone(), bias.clone(), bias._base.clone()]
    with pytest.raises(graphopt.InvalidModelError, match=f"{model_class.__name__}.forward writes to its {written}.* leave"):
        graphopt.optimize(model_class(), {"x": x, "bias": bias}, frontend=frontend, mode=mode)
    assert all(torch.equal(now, then) for now, then in zip([x, bias, bias._base], before, strict=True))
    assert (x._version, bias._version) == (0, 0)


def test_capture_refuses_it_too_and_leaves_the_input_alone() -> None:
    x = torch.randn(3, 4)
    before = x.clone()
    with pytest.raises(graphopt.InvalidModelError, match=r"input x in place \(aten\.mul_\.Tensor\)"):
        graphopt.capture(Doubles(), (x, torch.zeros(4)))
    assert torch.equal(x, before) and x._version == 0


def test_it_is_found_when_optimize_runs_under_inference_mode() -> None:
    with torch.inference_mode():  # inference tensors have no version counter: graphopt's copies must
        x = torch.randn(3, 4)
        before = x.clone()
        with pytest.raises(graphopt.InvalidModelError, match=r"input x in place \(aten\.mul_\.Tensor\)"):
            graphopt.optimize(Doubles().eval(), (x, torch.zeros(4)), frontend="fx")
    assert torch.equal(x, before)


def test_tune_says_why_when_no_candidate_could_be_built() -> None:
    """Every candidate fails the same way: tune raises that error (it once ended in min() of an empty sequence)."""
    x = torch.randn(3, 4)
    before = x.clone()
    with pytest.raises(graphopt.InvalidModelError, match=r"input x in place \(aten\.mul_\.Tensor\)"):
        graphopt.optimize(Doubles().eval(), (x, torch.zeros(4)), tune=True)
    assert torch.equal(x, before)

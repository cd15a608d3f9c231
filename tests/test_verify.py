"""Verification: errors relative to output scale, exact integer outputs, isolation."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from graphopt.verify import compare, compare_state, run_isolated, run_reference, tolerance_for


def test_identical_outputs_have_no_error() -> None:
    x = torch.randn(3, 4)
    assert compare(x, x.clone()).max_error == 0.0 and compare(x, x.clone()).ok


def test_error_is_relative_to_the_output_scale() -> None:
    tiny = torch.randn(100) * 1e-9  # logits of a randomly initialised net can be this small
    result = compare(tiny, tiny + 1e-10)
    assert not result.ok and 0.01 < result.max_error < 1.0
    assert compare(tiny * 1e9, tiny * 1e9 + 1e-10).ok


def test_tolerance_depends_on_dtype() -> None:
    assert tolerance_for(torch.float64) < tolerance_for(torch.float32) < tolerance_for(torch.float16) < tolerance_for(torch.bfloat16)
    x = torch.randn(50, dtype=torch.bfloat16)
    assert compare(x, x * 1.004).ok  # one bf16 rounding step
    assert not compare(x.float(), x.float() * 1.004).ok


def test_integer_outputs_must_be_exact() -> None:
    x = torch.arange(5)
    assert compare(x, x.clone()).ok
    result = compare(x, x + 1)
    assert not result.ok and result.detail == "integer outputs differ"


def test_nan_and_structure_mismatches_are_infinite_errors() -> None:
    x = torch.randn(4)
    y = x.clone()
    y[1] = float("nan")
    assert math.isinf(compare(x, y).max_error)
    nan_both = torch.tensor([float("nan"), 1.0])
    assert compare(nan_both, nan_both.clone()).ok
    assert "structure changed" in compare((x, x), (x,)).detail
    assert "shape" in compare(x, x[:2]).detail


def test_worst_output_is_named() -> None:
    a, b = torch.randn(3), torch.randn(3)
    result = compare({"a": a, "b": b}, {"a": a, "b": b + 1})
    assert result.where == "output['b']" and not result.ok


def test_isolated_run_restores_buffers_and_fixes_randomness() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Dropout(0.5)).train()
    x = torch.randn(8, 3) + 5
    first = run_isolated(model, (x,))
    assert torch.equal(model[0].running_mean, torch.zeros(3))
    assert int(model[0].num_batches_tracked) == 0
    assert torch.equal(first, run_isolated(model, (x,)))  # same dropout mask
    state = torch.random.get_rng_state()
    run_isolated(model, (x,))
    assert torch.equal(state, torch.random.get_rng_state())


def test_reference_records_only_the_buffers_a_run_changes() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3).eval()).train()
    model[1].eval()
    reference = run_reference(model, (torch.randn(8, 3) + 5,))
    assert set(reference.state) == {"0.running_mean", "0.running_var", "0.num_batches_tracked"}
    assert torch.equal(model[0].running_mean, torch.zeros(3))


def test_state_comparison_names_the_buffer() -> None:
    a = {"bn.running_mean": torch.ones(3), "bn.running_var": torch.ones(3)}
    b = {"bn.running_var": torch.ones(3), "bn.running_mean": torch.ones(3)}
    assert compare_state(a, b).ok, "order does not matter"
    missing = compare_state(a, {"bn.running_mean": torch.ones(3)})
    assert not missing.ok and missing.where == "buffer['bn.running_var']" and missing.detail == "changed by one run only"
    different = compare_state(a, {**a, "bn.running_mean": torch.ones(3) * 2})
    assert not different.ok and different.where == "buffer['bn.running_mean']"

"""Verification: errors relative to output scale, exact integer outputs, isolation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from graphopt.verify import compare, compare_gradients, compare_state, run_isolated, run_reference, tolerance_for


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


# --------------------------------------------------------------------------- gradients


def test_gradient_values_are_compared() -> None:
    expected = {"conv.weight": torch.randn(4, 3), "conv.bias": torch.randn(4)}
    assert compare_gradients(expected, {name: g.clone() for name, g in expected.items()}, 1e-4).max_error == 0.0
    scaled = compare_gradients(expected, {**expected, "conv.weight": expected["conv.weight"] * 1.01}, 1e-4)
    assert not scaled.ok and scaled.where == "gradient['conv.weight']" and scaled.max_error == pytest.approx(1e-2, rel=1e-3)
    reshaped = compare_gradients(expected, {**expected, "conv.bias": expected["conv.bias"][:2]}, 1e-4)
    assert not reshaped.ok and reshaped.detail == "shape (2,) instead of (4,)"
    # low-precision graphs: which parameters receive gradients, not their values
    assert compare_gradients(expected, {**expected, "conv.weight": expected["conv.weight"] * 1.01}, 1e-4, values=False).ok
    assert not compare_gradients(expected, {**expected, "conv.weight": None}, 1e-4, values=False).ok


def test_a_small_gradient_is_compared_at_one_percent_of_the_largest() -> None:
    """Below 1% of the largest gradient, a gradient's error is measured at that 1%; above it, at its own scale."""
    largest = torch.tensor([1.0, -0.5], dtype=torch.float64)
    below, above = torch.full((3,), 0.005, dtype=torch.float64), torch.full((3,), 0.02, dtype=torch.float64)
    nudge = torch.tensor([8e-7, 0.0, 0.0], dtype=torch.float64)
    expected = {"big": largest, "small": below}
    result = compare_gradients(expected, {"big": largest, "small": below + nudge}, 1e-4)
    assert result.ok and result.where == "gradient['small']" and result.max_error == pytest.approx(8e-7 / 0.01)  # 1.6e-4 at its own scale
    floored = compare_gradients(expected, {"big": largest, "small": below + 2 * nudge}, 1e-4)
    assert not floored.ok and floored.max_error == pytest.approx(1.6e-6 / 0.01)  # the floor excuses rounding, not a change
    expected = {"big": largest, "medium": above}
    own_scale = compare_gradients(expected, {"big": largest, "medium": above + 3 * nudge}, 1e-4)
    assert not own_scale.ok and own_scale.max_error == pytest.approx(2.4e-6 / 0.02)


def test_removed_and_unused_parameters_may_leave_the_graph() -> None:
    expected = {"conv.weight": torch.randn(4, 3), "conv.bias": torch.randn(4), "unused.weight": None}
    without_bias = {"conv.weight": expected["conv.weight"].clone()}  # e.g. drop_conv_bias took the bias out
    missing = compare_gradients(expected, without_bias, 1e-4)
    assert not missing.ok and missing.where == "gradient['conv.bias']" and missing.detail == "the parameter is no longer in the graph"
    assert compare_gradients(expected, without_bias, 1e-4, removed={"conv.bias"}).ok
    # a removed parameter still in the graph is compared like any other
    assert not compare_gradients(expected, {**without_bias, "conv.bias": expected["conv.bias"] * 2}, 1e-4, removed={"conv.bias"}).ok


def test_a_tied_parameter_may_keep_one_of_its_names() -> None:
    shared = torch.randn(10, 8)  # one gradient object under both names, as run_reference records a tied parameter
    expected = {"shared.weight": shared, "encoder_embed.weight": shared, "head.weight": torch.randn(3, 8)}
    kept_one = {"encoder_embed.weight": shared.clone(), "head.weight": expected["head.weight"].clone()}
    assert compare_gradients(expected, kept_one, 1e-4).ok
    changed = compare_gradients(expected, {**kept_one, "encoder_embed.weight": shared * 1.01}, 1e-4)
    assert not changed.ok and changed.where == "gradient['encoder_embed.weight']"
    kept_none = compare_gradients(expected, {"head.weight": expected["head.weight"]}, 1e-4)
    assert not kept_none.ok and kept_none.detail == "the parameter is no longer in the graph"
    # equal values are not a tie: two parameters that happen to be alike must both stay
    untied = {"a.weight": shared, "b.weight": shared.clone()}
    assert not compare_gradients(untied, {"a.weight": shared.clone()}, 1e-4).ok

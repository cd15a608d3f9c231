"""Numerical verification: reference outputs, dtype-aware tolerances, isolated runs.

Error is measured relative to the scale of each output tensor,
``max|actual - expected| / max|expected|``, because models with random weights can
produce logits around 1e-9 where any absolute tolerance would pass anything.
Integer and boolean outputs must match exactly.

Runs are isolated: the RNG is forked and seeded (dropout draws the same masks in the
reference and the candidate) and buffers are restored afterwards (a train-mode
BatchNorm's running statistics are not advanced by verification).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

# Largest accepted error relative to the output's scale, by the dtype the reference produced.
# fp32 leaves headroom over the ~1e-6 that reordering a few hundred multiply-adds costs.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}

SEED = 0


def tolerance_for(dtype: torch.dtype) -> float:
    """Accepted relative error for outputs of ``dtype`` (0 for exact types)."""
    return TOLERANCES.get(dtype, 0.0)


@contextlib.contextmanager
def isolated(module: nn.Module, seed: int = SEED, state_after: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
    """Run ``module`` with a fixed RNG state and restore its buffers and the global RNG afterwards.

    ``state_after``, when given, receives the buffers the run changed, with their new values.
    """
    saved = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        try:
            yield
        finally:
            buffers = dict(module.named_buffers())
            if state_after is not None:
                state_after.update(
                    {name: buffer.detach().clone() for name, buffer in buffers.items() if not torch.equal(buffer, saved[name])}
                )
            for name, value in saved.items():
                if name in buffers:
                    buffers[name].copy_(value)


def run_isolated(module: nn.Module, args: tuple[Any, ...], seed: int = SEED) -> Any:
    """``module(*args)`` with fixed RNG, no autograd, and buffers left as they were."""
    with isolated(module, seed):
        return module(*args)


@dataclass
class Reference:
    """What one isolated run produced: outputs, and the buffers it changed (new values)."""

    outputs: Any
    state: dict[str, torch.Tensor]


def run_reference(module: nn.Module, args: tuple[Any, ...], seed: int = SEED) -> Reference:
    """Like `run_isolated`, also recording the state updates (e.g. BatchNorm running statistics)."""
    state: dict[str, torch.Tensor] = {}
    with isolated(module, seed, state):
        outputs = module(*args)
    return Reference(outputs, state)


def compare_state(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> Comparison:
    """Compare two runs' buffer updates (name -> new value): the same buffers must change, alike."""
    for name in sorted(expected.keys() ^ actual.keys()):
        return Comparison(float("inf"), 0.0, f"buffer['{name}']", "changed by one run only")
    names = sorted(expected)  # module and graph list buffers in different orders
    result = compare({name: expected[name] for name in names}, {name: actual[name] for name in names})
    return Comparison(result.max_error, result.tolerance, result.where.replace("output", "buffer", 1), result.detail)


@dataclass
class Comparison:
    """The worst mismatch between two output structures."""

    max_error: float
    tolerance: float
    where: str  # path of the worst output, e.g. "output[0]"
    detail: str = ""
    mean_error: float = 0.0  # mean |actual - expected| over the worst output, relative to its scale

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance


def _leaf_error(expected: Any, actual: Any, tolerance: float) -> tuple[float, float, float, str]:
    """(max error, mean error, tolerance, detail) for one output leaf."""
    infinite = float("inf")
    if not isinstance(expected, torch.Tensor):
        same = type(expected) is type(actual) and expected == actual
        return (0.0, 0.0, 0.0, "") if same else (infinite, infinite, 0.0, f"expected {expected!r}, got {actual!r}")
    if not isinstance(actual, torch.Tensor):
        return infinite, infinite, 0.0, f"expected a tensor, got {type(actual).__name__}"
    if expected.shape != actual.shape:
        return infinite, infinite, 0.0, f"shape {tuple(actual.shape)} instead of {tuple(expected.shape)}"
    if not (expected.is_floating_point() or expected.is_complex()):
        same = torch.equal(expected, actual.to(expected.dtype))
        return (0.0, 0.0, 0.0, "") if same else (infinite, infinite, 0.0, "integer outputs differ")
    if expected.numel() == 0:
        return 0.0, 0.0, tolerance, ""
    expected64, actual64 = expected.detach().double(), actual.detach().double()
    nan_mismatch = torch.isnan(expected64) != torch.isnan(actual64)
    if nan_mismatch.any():
        return infinite, infinite, tolerance, "NaN where the original has a number (or the reverse)"
    finite = torch.isfinite(expected64)
    if not torch.equal(expected64[~finite].nan_to_num(), actual64[~finite].nan_to_num()):
        return infinite, infinite, tolerance, "infinities differ"
    diff = (expected64 - actual64)[finite].abs()
    if not diff.numel():
        return 0.0, 0.0, tolerance, ""
    scale = expected64[finite].abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    detail = f"max abs diff {float(diff.max()):.3e} at output scale {float(scale):.3e}"
    return float(diff.max() / scale), float(diff.mean() / scale), tolerance, detail


def compare(expected: Any, actual: Any, compute_dtype: torch.dtype | None = None) -> Comparison:
    """Compare two (nested) outputs leaf by leaf; the result names the worst leaf.

    ``compute_dtype``: the lowest precision the candidate computes in (e.g. bf16 after
    mixed precision); its tolerance applies when looser than the output dtype's.
    """
    expected_leaves, expected_spec = pytree.tree_flatten_with_path(expected)
    actual_leaves, actual_spec = pytree.tree_flatten_with_path(actual)
    if expected_spec != actual_spec:
        return Comparison(float("inf"), 0.0, "output", f"output structure changed: {actual_spec} instead of {expected_spec}")
    worst = Comparison(0.0, 0.0, "output")
    worst_ratio = -1.0
    for (path, exp_leaf), (_, act_leaf) in zip(expected_leaves, actual_leaves, strict=True):
        tolerance = tolerance_for(exp_leaf.dtype) if isinstance(exp_leaf, torch.Tensor) else 0.0
        if compute_dtype is not None and tolerance:
            tolerance = max(tolerance, tolerance_for(compute_dtype))
        error, mean_error, tolerance, detail = _leaf_error(exp_leaf, act_leaf, tolerance)
        ratio = error / tolerance if tolerance else (0.0 if error == 0 else float("inf"))
        if ratio > worst_ratio:
            worst_ratio = ratio
            worst = Comparison(error, tolerance, "output" + pytree.keystr(path), detail, mean_error)
    return worst

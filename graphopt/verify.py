"""Numerical verification: reference outputs, dtype-aware tolerances, isolated runs.

Error is measured relative to the scale of each output tensor,
``max|actual - expected| / max|expected|``, because models with random weights can
produce logits around 1e-9 where any absolute tolerance would pass anything. The scale
has a floor: differences no larger than the dtype's smallest normal number are rounding
of subnormals, not a wrong rewrite (`degenerate_outputs` says when a whole output is
that small, so nothing about it can be verified). Integer and boolean outputs must
match exactly, and every output must keep its dtype.

In training mode gradients are compared too (`run_reference(..., gradients=True)`):
the gradient of every parameter for a loss that is a fixed random projection of the
outputs (a plain ``.sum()`` after a BatchNorm has zero gradient and proves nothing).

Runs are isolated: the RNG is forked and seeded (dropout draws the same masks in the
reference and the candidate) and buffers are restored afterwards (a train-mode
BatchNorm's running statistics are not advanced by verification).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.trees import leaves_with_paths

# Largest accepted error relative to the output's scale, by the dtype the reference produced.
# fp32 leaves headroom over the ~1e-6 that reordering a few hundred multiply-adds costs.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}

SEED = 0

# A low-precision graph (bf16, fp16) is judged against torch.autocast in the same dtype on the same input: it
# passes while its error (outputs; in training gradients too) is at most this multiple of autocast's own error.
# Measured: graphopt's bf16 0.66-1.12x autocast's output error on the reference and anchor models in inference,
# 1.00x in training (outputs and gradients); OpenVINO's and Inductor's bf16 0.8-1.4x.
AUTOCAST_FACTOR = 2.0


def low_precision_floor(dtype: torch.dtype) -> float:
    """The smallest error a low-precision graph is held to: one rounding in ``dtype`` (its machine epsilon, bf16
    7.8e-3, fp16 9.8e-4). Below it no rewrite is clearly worse than autocast: autocast's own error can be far
    smaller where it lowers few ops (fp16 on a small ResNet: 2.2e-4, graphopt's BatchNorm-folded weights 4.9e-4)."""
    return float(torch.finfo(dtype).eps)


def tolerance_for(dtype: torch.dtype) -> float:
    """Accepted relative error for outputs of ``dtype`` (0 for exact types)."""
    return TOLERANCES.get(dtype, 0.0)


def smallest_normal(*dtypes: torch.dtype | None) -> float:
    """The largest of the dtypes' smallest normal numbers (below it, values are subnormal or flushed to zero)."""
    return max((torch.finfo(dtype).tiny for dtype in dtypes if dtype is not None and dtype.is_floating_point), default=0.0)


def degenerate_outputs(outputs: Any, compute_dtype: torch.dtype | None = None) -> list[str]:
    """The floating-point outputs too small to verify anything: every value zero or subnormal.

    At that scale a correct rewrite and a wrong one differ only by the rounding of
    subnormals, so a check says nothing; each entry says which output and why.
    """
    found = []
    for path, leaf in leaves_with_paths(outputs):
        if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel()):
            continue
        floor = smallest_normal(leaf.dtype, compute_dtype)
        largest = float(leaf.detach().abs().nan_to_num(posinf=0.0, neginf=0.0).max())
        if largest < floor:
            what = "all zeros" if largest == 0 else f"subnormal: its largest magnitude is {largest:.1e}, below {floor:.1e}, the smallest normal number"
            found.append(f"output{pytree.keystr(path)} is {what}")
    return found


@contextlib.contextmanager
def isolated(module: nn.Module, seed: int = SEED, state_after: dict[str, torch.Tensor] | None = None, grad: bool = False) -> Iterator[None]:
    """Run ``module`` with a fixed RNG state and restore its buffers and the global RNG afterwards.

    ``state_after``, when given, receives the buffers the run changed, with their new values.
    Autograd is off unless ``grad``.
    """
    saved = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad):
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
    """What one isolated run produced: outputs, the buffers it changed (new values) and, in training, gradients."""

    outputs: Any
    state: dict[str, torch.Tensor]
    # parameter name -> gradient of `projection_loss` (None: the parameter receives none); None when not asked for
    gradients: dict[str, torch.Tensor | None] | None = None


def projection_loss(outputs: Any) -> torch.Tensor | None:
    """A fixed random projection of every floating-point output that requires grad (None when none does).

    The projection is drawn from a generator seeded by each output's position and shape,
    so the original and the optimized graph are weighed alike.
    """
    generator = torch.Generator().manual_seed(SEED + 1)
    terms = []
    for leaf in pytree.tree_leaves(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            dtype = torch.promote_types(leaf.dtype, torch.float32)
            weights = torch.randn(leaf.shape, generator=generator, dtype=torch.float64).to(leaf.device, dtype)
            terms.append((leaf.to(dtype) * weights).sum())
    return torch.stack(terms).sum() if terms else None


def _gradients(module: nn.Module, outputs: Any) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient by name; a tied parameter under each of its names (one gradient object)."""
    names = {name: p for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    unique = list({id(p): p for p in names.values()}.values())
    loss = projection_loss(outputs)
    if loss is None or not unique:
        return dict.fromkeys(names)
    grads = torch.autograd.grad(loss, unique, allow_unused=True)
    by_id = {id(p): None if g is None else g.detach() for p, g in zip(unique, grads, strict=True)}
    return {name: by_id[id(p)] for name, p in names.items()}


def in_float64(module: nn.Module, args: tuple[Any, ...]) -> tuple[nn.Module, tuple[Any, ...]]:
    """A float64 copy of ``module`` (parameters and buffers) and of the floating-point tensors in ``args``."""

    def widen(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.detach().double().requires_grad_(leaf.requires_grad)
        return leaf

    return copy.deepcopy(module).double(), pytree.tree_map(widen, args)


def confirm_gradients(
    comparison: Comparison, original: nn.Module, graph: nn.Module, args: tuple[Any, ...], removed: Collection[str] = ()
) -> Comparison:
    """``comparison`` of float32 gradients, marked `Comparison.confirmed` when float64 finds no mismatch.

    Two correct float32 computations in different layouts round differently, and a ReLU
    input or a max-pool tie closer than that rounding falls on either side: the gradient
    of one element goes elsewhere, and after a BatchNorm's backward whole channels differ
    by percents (measured: 6.5e-2 on a small ResNet conv). In float64 the rounding is 2^29
    times finer, so a mismatch that persists there is the rewrite's. Models that do not run
    in float64 keep the float32 verdict.
    """
    if comparison.ok or comparison.max_error == float("inf"):
        return comparison
    try:
        eager, wide_args = in_float64(original, args)
        candidate, _ = in_float64(graph, args)
        expected = run_reference(eager, wide_args, gradients=True).gradients
        actual = run_reference(candidate, wide_args, gradients=True).gradients
    except Exception:
        return comparison
    assert expected is not None and actual is not None
    wide = compare_gradients(expected, actual, comparison.tolerance, removed)
    if not wide.ok:
        return comparison
    detail = f"{comparison.detail}; float64 agrees (error {wide.max_error:.1e}): a ReLU or max decision near zero rounded the other way"
    return replace(comparison, detail=detail, confirmed=True)


def run_reference(module: nn.Module, args: tuple[Any, ...], seed: int = SEED, gradients: bool = False) -> Reference:
    """Like `run_isolated`, also recording the state updates (e.g. BatchNorm running statistics).

    With ``gradients``, forward runs with autograd and the gradients of `projection_loss`
    are recorded per parameter (``.grad`` is left alone).
    """
    state: dict[str, torch.Tensor] = {}
    with isolated(module, seed, state, grad=gradients):
        outputs = module(*args)
        grads = _gradients(module, outputs) if gradients else None
    detached = pytree.tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, outputs)
    return Reference(detached, state, grads)


def autocast_errors(check: Check, module: nn.Module, dtype: torch.dtype, gradients: bool) -> tuple[float, float | None]:
    """The error of ``module`` under ``torch.autocast(dtype)`` on the inputs' device, what every PyTorch user accepts
    as that precision, against the original on ``check``: outputs (cast back to the original's dtypes) and, with
    ``gradients``, gradients (else None)."""
    devices = {leaf.device.type for leaf in pytree.tree_leaves(check.args) if isinstance(leaf, torch.Tensor)} or {"cpu"}
    with torch.autocast(devices.pop(), dtype=dtype):
        reference = run_reference(module, check.args, gradients=gradients)
    try:
        actual = pytree.tree_map(_like_expected, reference.outputs, check.expected.outputs)
    except (ValueError, TypeError):  # another output structure: compare says so
        actual = reference.outputs
    outputs = compare(check.expected.outputs, actual).max_error
    if not gradients or check.expected.gradients is None or reference.gradients is None:
        return outputs, None
    return outputs, compare_gradients(check.expected.gradients, reference.gradients, float("inf")).max_error


def _like_expected(actual: Any, expected: Any) -> Any:
    return actual.to(expected.dtype) if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) else actual


@dataclass
class Check:
    """One input a graph is verified on, and what the original model computed for it."""

    args: tuple[Any, ...]
    expected: Reference  # outputs; in training also the gradients of `projection_loss`
    description: str  # e.g. "the example inputs", "a second input (batch 9 (example: 8), ...)"
    differences: str = ""  # how it differs from the example, e.g. "batch 9 (example: 8), ... channels_last strides"


def compare_state(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> Comparison:
    """Compare two runs' buffer updates (name -> new value): the same buffers must change, alike."""
    for name in sorted(expected.keys() ^ actual.keys()):
        return Comparison(float("inf"), 0.0, f"buffer['{name}']", "changed by one run only")
    names = sorted(expected)  # module and graph list buffers in different orders
    result = compare({name: expected[name] for name in names}, {name: actual[name] for name in names})
    return Comparison(result.max_error, result.tolerance, result.where.replace("output", "buffer", 1), result.detail)


# A gradient is compared at its own scale, but no finer than this share of the largest gradient: a sum
# that cancels to near zero (the gradient of a conv bias before a BatchNorm) carries rounding noise of
# the size of its terms, not of its result (measured: 1-6x its own magnitude in fp32, 3e-6 of the largest).
GRADIENT_SCALE_FLOOR = 1e-2


def compare_gradients(
    expected: dict[str, torch.Tensor | None], actual: dict[str, torch.Tensor | None], tolerance: float, removed: Collection[str] = (), values: bool = True
) -> Comparison:
    """Compare two runs' gradients (parameter name -> gradient, None: no gradient).

    The same parameters must receive gradients, except ``removed`` ones (a pass took them
    out of the graph and accounted for them); a graph may leave out a parameter that
    receives no gradient, and all but one name of a tied parameter. With ``values``, each gradient must match
    within ``tolerance`` of its scale (see `GRADIENT_SCALE_FLOOR`); low-precision graphs
    compare which parameters receive gradients only, since their gradients are
    approximations of the fp32 ones (20-30% apart after a BatchNorm in bf16).
    """
    infinite = float("inf")
    for name, gradient in expected.items():
        if name not in actual:
            # a parameter forward never reads is left out of graphs, and a tied one may keep only one of its names
            tied = gradient is not None and any(other is gradient and alias in actual for alias, other in expected.items())
            if name not in removed and gradient is not None and not tied:
                return Comparison(infinite, tolerance, f"gradient['{name}']", "the parameter is no longer in the graph")
        elif (gradient is None) != (actual[name] is None):
            receives = "receives no gradient" if actual[name] is None else "receives a gradient"
            return Comparison(infinite, tolerance, f"gradient['{name}']", f"{receives} in the graph but {'not ' if gradient is None else ''}in the original")
    present = {name: g for name, g in expected.items() if g is not None and actual.get(name) is not None}
    if not values or not present:
        return Comparison(0.0, tolerance, "gradients")
    largest = max(float(g.abs().max()) if g.numel() else 0.0 for g in present.values())
    worst = Comparison(0.0, tolerance, "gradients")
    for name, gradient in present.items():
        other = actual[name]
        assert other is not None
        if other.shape != gradient.shape:
            return Comparison(infinite, tolerance, f"gradient['{name}']", f"shape {tuple(other.shape)} instead of {tuple(gradient.shape)}")
        if not gradient.numel():
            continue
        difference = (other.double() - gradient.double()).abs().nan_to_num(nan=infinite).max()
        scale = max(float(gradient.abs().max()), GRADIENT_SCALE_FLOOR * largest, smallest_normal(gradient.dtype) / tolerance)
        error = float(difference) / scale
        if error > worst.max_error:
            worst = Comparison(error, tolerance, f"gradient['{name}']", f"max abs diff {float(difference):.3e} at gradient scale {scale:.3e}")
    return worst


@dataclass
class Comparison:
    """The worst mismatch between two output structures."""

    max_error: float
    tolerance: float
    where: str  # path of the worst output, e.g. "output[0]"
    detail: str = ""
    mean_error: float = 0.0  # mean |actual - expected| over the worst output, relative to its scale
    confirmed: bool = False  # over the tolerance in float32 only: the same comparison in float64 passed

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance or self.confirmed


def _leaf_error(expected: Any, actual: Any, tolerance: float, compute_dtype: torch.dtype | None = None) -> tuple[float, float, float, str]:
    """(max error, mean error, tolerance, detail) for one output leaf."""
    infinite = float("inf")
    if not isinstance(expected, torch.Tensor):
        same = type(expected) is type(actual) and expected == actual
        return (0.0, 0.0, 0.0, "") if same else (infinite, infinite, 0.0, f"expected {expected!r}, got {actual!r}")
    if not isinstance(actual, torch.Tensor):
        return infinite, infinite, 0.0, f"expected a tensor, got {type(actual).__name__}"
    if expected.shape != actual.shape:
        return infinite, infinite, 0.0, f"shape {tuple(actual.shape)} instead of {tuple(expected.shape)}"
    if expected.dtype != actual.dtype:
        return infinite, infinite, 0.0, f"dtype {str(actual.dtype).removeprefix('torch.')} instead of {str(expected.dtype).removeprefix('torch.')}"
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
    # differences within the smallest normal number are the rounding of subnormals: the scale's floor admits them
    scale = expected64[finite].abs().max().clamp_min(smallest_normal(expected.dtype, compute_dtype) / (tolerance or 1.0))
    detail = f"max abs diff {float(diff.max()):.3e} at output scale {float(scale):.3e}"
    return float(diff.max() / scale), float(diff.mean() / scale), tolerance, detail


def compare(expected: Any, actual: Any, compute_dtype: torch.dtype | None = None, compute_tolerance: float | None = None) -> Comparison:
    """Compare two (nested) outputs leaf by leaf; the result names the worst leaf.

    ``compute_dtype``: the lowest precision the candidate computes in (e.g. bf16 after
    mixed precision); its tolerance (``compute_tolerance``, default `tolerance_for` it: int8's
    is the caller's accuracy budget) applies when looser than the output dtype's.
    """
    expected_spec, actual_spec = pytree.tree_structure(expected), pytree.tree_structure(actual)
    if expected_spec != actual_spec:
        return Comparison(float("inf"), 0.0, "output", f"output structure changed: {actual_spec} instead of {expected_spec}")
    expected_leaves, actual_leaves = leaves_with_paths(expected), leaves_with_paths(actual)
    worst = Comparison(0.0, 0.0, "output")
    worst_ratio = -1.0
    for (path, exp_leaf), (_, act_leaf) in zip(expected_leaves, actual_leaves, strict=True):
        tolerance = tolerance_for(exp_leaf.dtype) if isinstance(exp_leaf, torch.Tensor) else 0.0
        if compute_dtype is not None and tolerance:
            tolerance = max(tolerance, tolerance_for(compute_dtype) if compute_tolerance is None else compute_tolerance)
        error, mean_error, tolerance, detail = _leaf_error(exp_leaf, act_leaf, tolerance, compute_dtype)
        ratio = error / tolerance if tolerance else (0.0 if error == 0 else float("inf"))
        if ratio > worst_ratio:
            worst_ratio = ratio
            worst = Comparison(error, tolerance, "output" + pytree.keystr(path), detail, mean_error)
    return worst

"""Checkpoints across optimization: what the passes did to stored tensors, replayable both ways.

The optimized module keeps the original model's state_dict keys wherever a tensor still
exists. The passes that remove or rewrite stored tensors record each change as a
`StateChange` in their report (``PassReport.state_changes``), so that a checkpoint of
the original model can be loaded into the optimized module and the optimized module's
state exported for the original model:

- `DroppedBias` (``drop_conv_bias``): the bias of a conv/linear feeding a BatchNorm is
  removed and ``running_mean`` absorbs it. Original -> optimized is exact. Optimized ->
  original gives a zero bias and leaves ``running_mean`` as it is: the same function in
  train and eval mode (a bias before BatchNorm is cancelled by the mean).
- `FoldedBatchNorm` (``fold_conv_bn``): BatchNorm folded into the conv/linear before it.
  Original -> optimized re-folds the checkpoint's values exactly as the pass did.
  Optimized -> original cannot recover the separate conv and BatchNorm values; it gives
  the folded conv and an identity BatchNorm (mean ``-b'``, variance ``1 - eps``, scale 1,
  shift 0): the same outputs in eval mode only.

- `FoldedScale` (``fold_channel_scale``): a stored per-channel scale of a conv/linear
  output folded into its weight and bias. Original -> optimized folds the checkpoint's
  scale exactly as the pass did; optimized -> original gives the folded weights and a
  scale of ones: the same function.

``to_optimized`` applies the changes in the order the passes made them, ``to_original``
undoes them in reverse order. Both work on plain ``{key: tensor}`` dicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Union

import torch
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from graphopt.errors import CheckpointError

State = dict[str, torch.Tensor]


def _take(state: State, key: str) -> torch.Tensor:
    if key not in state:
        raise CheckpointError(
            f"the checkpoint has no {key!r}, which the optimized module needs to rebuild its state: pass the full "
            "state_dict() of the original model"
        )
    return state.pop(key)


@dataclass(frozen=True)
class DroppedBias:
    """``bias`` (``channels`` values) was removed; ``running_mean`` (when tracked) was lowered by it."""

    bias: str
    weight: str
    running_mean: str | None
    channels: int
    batch_norm: str

    def keys(self) -> dict[str, str]:
        """Each original key this change touches, with what became of it."""
        keys = {self.bias: f"dropped: cancelled by the mean subtraction of {self.batch_norm}"}
        if self.running_mean is not None:
            keys[self.running_mean] = f"lowered by {self.bias} (absorbs the dropped bias)"
        return keys

    def to_optimized(self, state: State) -> None:
        bias = _take(state, self.bias)
        if self.running_mean is not None:
            running_mean = _take(state, self.running_mean)
            state[self.running_mean] = running_mean - bias.to(running_mean.dtype)

    def to_original(self, state: State) -> None:
        state[self.bias] = torch.zeros(self.channels, dtype=state[self.weight].dtype, device=state[self.weight].device)


@dataclass(frozen=True)
class FoldedBatchNorm:
    """The BatchNorm whose tensors are the ``batch_norm_*`` keys was folded into ``weight`` and ``folded_bias``.

    ``bias`` is the layer's own bias before folding (None when it had none; folding then
    created ``folded_bias``). ``kind`` is ``"linear"``, ``"conv"`` or ``"conv_transpose"``.
    """

    kind: str
    weight: str
    bias: str | None
    folded_bias: str
    running_mean: str
    running_var: str
    batch_norm_weight: str | None
    batch_norm_bias: str | None
    num_batches_tracked: str | None
    eps: float

    def _batch_norm_keys(self) -> list[str]:
        keys = (self.batch_norm_weight, self.batch_norm_bias, self.running_mean, self.running_var, self.num_batches_tracked)
        return [key for key in keys if key is not None]

    def keys(self) -> dict[str, str]:
        keys = {key: f"folded into {self.weight} and {self.folded_bias}" for key in self._batch_norm_keys()}
        keys[self.weight] = "scaled by the folded BatchNorm"
        keys[self.folded_bias] = "shifted by the folded BatchNorm" if self.bias else "created by folding the BatchNorm"
        return keys

    def to_optimized(self, state: State) -> None:
        running_mean, running_var = _take(state, self.running_mean), _take(state, self.running_var)
        gamma = _take(state, self.batch_norm_weight) if self.batch_norm_weight else torch.ones_like(running_mean)
        beta = _take(state, self.batch_norm_bias) if self.batch_norm_bias else torch.zeros_like(running_mean)
        if self.num_batches_tracked:
            _take(state, self.num_batches_tracked)
        weight = _take(state, self.weight)
        bias = _take(state, self.bias) if self.bias else None
        if self.kind == "linear":
            weight, bias = fuse_linear_bn_weights(weight, bias, running_mean, running_var, self.eps, gamma, beta)
        else:
            weight, bias = fuse_conv_bn_weights(
                weight, bias, running_mean, running_var, self.eps, gamma, beta, transpose=self.kind == "conv_transpose"
            )
        state[self.weight], state[self.folded_bias] = weight.detach(), bias.detach()

    def to_original(self, state: State) -> None:
        folded_bias = state.pop(self.folded_bias)
        if self.bias:
            state[self.bias] = torch.zeros_like(folded_bias)
        # an identity BatchNorm that adds the folded bias: (y + b') / sqrt(1 - eps + eps) * 1 + 0
        state[self.running_mean] = -folded_bias
        state[self.running_var] = torch.full_like(folded_bias, 1.0 - self.eps)
        if self.batch_norm_weight:
            state[self.batch_norm_weight] = torch.ones_like(folded_bias)
        if self.batch_norm_bias:
            state[self.batch_norm_bias] = torch.zeros_like(folded_bias)
        if self.num_batches_tracked:
            state[self.num_batches_tracked] = torch.tensor(0, dtype=torch.long)


@dataclass(frozen=True)
class FoldedScale:
    """The scale stored at ``scale`` (``shape``, one value or one per output channel) was folded into ``weight`` and ``bias``."""

    weight: str
    bias: str | None
    scale: str
    shape: tuple[int, ...]

    def keys(self) -> dict[str, str]:
        keys = {self.scale: f"folded into {self.weight}" + (f" and {self.bias}" if self.bias else ""), self.weight: f"scaled by {self.scale}"}
        if self.bias:
            keys[self.bias] = f"scaled by {self.scale}"
        return keys

    def to_optimized(self, state: State) -> None:
        weight = _take(state, self.weight)
        vector = _take(state, self.scale).to(weight.dtype).reshape(-1).expand(weight.shape[0])
        state[self.weight] = weight * vector.reshape(-1, *[1] * (weight.dim() - 1))
        if self.bias:
            state[self.bias] = _take(state, self.bias) * vector

    def to_original(self, state: State) -> None:
        weight = state[self.weight]
        state[self.scale] = torch.ones(self.shape, dtype=weight.dtype, device=weight.device)


StateChange = Union[DroppedBias, FoldedBatchNorm, FoldedScale]
STATE_CHANGE_KINDS: dict[str, type[StateChange]] = {kind.__name__: kind for kind in (DroppedBias, FoldedBatchNorm, FoldedScale)}  # type: ignore[misc]


def state_change_to_dict(change: StateChange) -> dict[str, Any]:
    """``change`` as JSON-ready data, its kind included (`state_change_from_dict` rebuilds it)."""
    return {"kind_of_change": type(change).__name__, **asdict(change)}


def state_change_from_dict(data: Mapping[str, Any]) -> StateChange:
    fields = dict(data)
    kind = STATE_CHANGE_KINDS[fields.pop("kind_of_change")]
    if kind is FoldedScale:
        fields["shape"] = tuple(fields["shape"])
    return kind(**fields)


def to_optimized(state_dict: Mapping[str, torch.Tensor], changes: Sequence[StateChange]) -> State:
    """The original model's ``state_dict`` rewritten as the optimized module stores it."""
    state = dict(state_dict)
    for change in changes:
        change.to_optimized(state)
    return state


def to_original(state_dict: Mapping[str, torch.Tensor], changes: Sequence[StateChange]) -> State:
    """The optimized module's ``state_dict`` rewritten with the original model's keys (see the module docstring)."""
    state = dict(state_dict)
    for change in reversed(changes):
        change.to_original(state)
    return state


def key_map(changes: Iterable[StateChange]) -> dict[str, str]:
    """Every original key the changes touch, with what became of it (the last change wins)."""
    mapping: dict[str, str] = {}
    for change in changes:
        mapping.update(change.keys())
    return mapping

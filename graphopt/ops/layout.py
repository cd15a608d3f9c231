"""Memory layout: reshapes and permutes in every form, a tensor's layout (`layout_of`, `layout_key`), a permute's dims."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt.ops.graph import is_call_to

aten = torch.ops.aten

_RESHAPE_METHODS = {"view", "reshape", "flatten", "view_as", "reshape_as"}
_RESHAPE_TARGETS = {
    torch.flatten,
    torch.reshape,
    aten.view.default,
    aten.reshape.default,
    aten.flatten.using_ints,
    aten._unsafe_view.default,
    aten.view_as.default,
    aten.reshape_as.default,
}
_PERMUTE_METHODS = {"permute", "transpose", "movedim", "t"}
_PERMUTE_TARGETS = {torch.permute, torch.transpose, torch.movedim, aten.permute.default, aten.transpose.int, aten.movedim.int}


def is_reshape(gm: nn.Module, node: fx.Node) -> bool:
    """view/reshape/flatten in any form: they read their input in row-major (NCHW) order."""
    return is_call_to(gm, node, _RESHAPE_METHODS, _RESHAPE_TARGETS, (nn.Flatten,))


def is_permute(gm: nn.Module, node: fx.Node) -> bool:
    """permute/transpose/movedim in any form: they change which dimension is which, not the data."""
    return is_call_to(gm, node, _PERMUTE_METHODS, _PERMUTE_TARGETS)


def layout_key(value: Any) -> tuple[Any, ...] | None:
    """A tensor's shape, dtype and strides (of dims larger than 1, whose strides matter), else None.

    Two tensors with equal keys are laid out alike: one can stand in for the other.
    """
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(value.shape), value.dtype, tuple(stride for stride, size in zip(value.stride(), value.shape) if size > 1)


def permute_dims(node: fx.Node) -> list[int] | None:
    """The dims of a permute (``x.permute(0, 2, 3, 1)``, ``torch.permute(x, [...])``, ATen), made non-negative, else None."""
    if node.op == "call_method" and node.target == "permute":
        dims: Any = node.args[1:]
        dims = dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
    elif node.op == "call_function" and node.target in (torch.permute, aten.permute.default):
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dims")
    else:
        return None
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return [d % len(dims) for d in dims]


def layout_of(value: Any) -> str | None:
    """Memory layout of a 4-D/5-D tensor: "channels_last", "contiguous", "any" (both, e.g. N,C,1,1) or "strided"."""
    if not isinstance(value, torch.Tensor) or value.dim() not in (4, 5):
        return None
    channels_last = torch.channels_last if value.dim() == 4 else torch.channels_last_3d
    contiguous, last = value.is_contiguous(), value.is_contiguous(memory_format=channels_last)
    if contiguous and last:
        return "any"
    return "channels_last" if last else "contiguous" if contiguous else "strided"

"""oneDNN modules the optimized graph calls at run time: conv/linear with a weight prepacked once, post-ops fused.

`use_onednn_kernels` (the pass) plans the fusions and puts these modules in the graph;
`use_onednn_linear` calls ``torch.ops.graphopt.linear_add`` (defined here) on a linear's
own weight. This module owns what runs afterwards: the kernel calls, and how a prepacked
weight behaves in ``state_dict()`` (dense ``<path>.weight``), ``load_state_dict``
(repacked), ``copy.deepcopy`` and pickling (dense weight stored, repacked on load).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from graphopt.ops import ACTIVATIONS

mkldnn = torch.ops.mkldnn

# The function computing each activation kind oneDNN fuses, from graphopt.ops' activation table
# (relu6's row reads as hardtanh, whose own row gives F.hardtanh)
_FUNCTION_OF_KIND = {row.post_op: row.functions[0] for row in ACTIVATIONS if row.post_op == row.name}


class PostOp(NamedTuple):
    """A oneDNN eltwise post-op: its name, scalars and algorithm ("none" when no activation is fused)."""

    attr: str = "none"
    scalars: tuple[float, ...] = ()
    algorithm: str = ""


NO_POST_OP = PostOp()


def aten_post_op(attr: str, scalars: Any, algorithm: str) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...], dict[str, Any]]:
    """ATen's function computing oneDNN post-op ``attr`` (not "none"), with its arguments after the input."""
    kind = "silu" if attr == "swish" else attr  # use_onednn_kernels names silu's post-op by oneDNN's name
    return _FUNCTION_OF_KIND[kind], tuple(scalars), {"approximate": algorithm} if attr == "gelu" else {}


class WeightInStateDict(nn.Module):
    """A module whose kernel weight is not a Parameter: ``state_dict()`` shows it as ``<path>.weight`` (the dense
    float tensor `weight` gives, first, like nn.Conv2d and nn.Linear); ``load_state_dict`` hands it to `load_weight`."""

    @property
    def weight(self) -> torch.Tensor:
        raise NotImplementedError

    def weight_shape(self) -> torch.Size:
        raise NotImplementedError

    def load_weight(self, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "weight"
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key not in state_dict:
            missing_keys.append(key)
        elif state_dict[key].shape != self.weight_shape():
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}, the shape in current model is {tuple(self.weight_shape())}.")
        else:
            self.load_weight(state_dict[key].detach())


class Prepacked(WeightInStateDict):
    """A oneDNN op with a prepacked weight: dense in state_dict, deepcopy and pickles; packed when running."""

    packed_weight: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, post_op: PostOp, binary: bool) -> None:
        super().__init__()
        if isinstance(bias, nn.Parameter) or bias is None:
            self.register_parameter("bias", bias)
        else:
            self.register_buffer("bias", bias)
        self.post_op, self.binary = post_op, binary
        self.scalars = list(post_op.scalars)  # the kernels take a list: built once, not per call
        self.pack(weight)

    def pack(self, weight: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight (unpacked on each access)."""
        return self.packed_weight.to_dense()

    def weight_shape(self) -> torch.Size:
        return self.packed_weight.shape

    def load_weight(self, weight: torch.Tensor) -> None:
        self.pack(weight.to(self.packed_weight.dtype))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["packed_weight"] = self.weight  # opaque mkldnn tensors can be neither copied nor pickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        dense = state.pop("packed_weight")
        super().__setstate__(state)
        self.pack(dense)


Windows = list[tuple[int, int, int, int]]  # a conv's (kernel, pad, stride, dilation) per spatial dimension


def conv_windows(weight: torch.Tensor, padding: list[int], stride: list[int], dilation: list[int]) -> Windows:
    """The (kernel, pad, stride, dilation) of each spatial dimension of a conv with ``weight``."""
    return list(zip(weight.shape[2:], padding, stride, dilation))


def holds_conv_result(x: torch.Tensor, other: torch.Tensor, dtype: torch.dtype, out_channels: int, windows: Windows) -> bool:
    """Whether ``other`` can take a conv's result of ``dtype`` in place: that shape and dtype, stored densely in
    channels_last (the layout oneDNN writes for a channels_last ``x``), and not ``x``'s memory.

    ``windows``: `conv_windows`.
    """
    memory_format = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if other.dtype != dtype or not x.is_contiguous(memory_format=memory_format) or not other.is_contiguous(memory_format=memory_format):
        return False
    if other.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return False
    spatial = [(size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for size, (kernel, pad, stride, dilation) in zip(x.shape[2:], windows)]
    return list(other.shape) == [x.shape[0], out_channels, *spatial]


class OneDNNConv(Prepacked):
    """conv2d/conv3d (+ add) (+ activation) by ``torch.ops.mkldnn._convolution_pointwise`` on a prepacked weight.

    ``into_other`` (set by `compute_in_place` where the add's other operand is not read
    again): the conv + add accumulates into that operand (oneDNN's sum post-op,
    ``_convolution_pointwise_.binary``) whenever it can hold the result, instead of writing
    a new tensor.
    """

    into_other = False

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, padding: list[int], stride: list[int], dilation: list[int],
        groups: int, input_size: list[int], post_op: PostOp = NO_POST_OP, binary: bool = False,
    ) -> None:
        self.padding, self.stride, self.dilation, self.groups = padding, stride, dilation, groups
        self.input_size = input_size  # oneDNN chooses the packed layout for this input shape; other shapes work too
        self.out_channels = weight.shape[0]
        self.windows = conv_windows(weight, padding, stride, dilation)
        super().__init__(weight, bias, post_op, binary)

    def holds_result(self, x: torch.Tensor, other: torch.Tensor) -> bool:
        """Whether ``other`` can take conv(x) + other in place (`holds_conv_result`, in ``x``'s dtype)."""
        return holds_conv_result(x, other, x.dtype, self.out_channels, self.windows)

    def pack(self, weight: torch.Tensor) -> None:
        self.packed_weight = mkldnn._reorder_convolution_weight(weight.detach(), self.padding, self.stride, self.dilation, self.groups, self.input_size)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        attr, _, algorithm = self.post_op
        if other is None:
            return mkldnn._convolution_pointwise(x, self.packed_weight, self.bias, self.padding, self.stride, self.dilation, self.groups, attr, self.scalars, algorithm)
        unary = None if attr == "none" else attr
        geometry = (self.packed_weight, self.bias, self.padding, self.stride, self.dilation, self.groups)
        if self.into_other and self.holds_result(x, other):
            return mkldnn._convolution_pointwise_.binary(other, x, *geometry, "add", None, unary, self.scalars, algorithm or None)
        return mkldnn._convolution_pointwise.binary(x, other, *geometry, "add", None, unary, self.scalars, algorithm or None)

    def extra_repr(self) -> str:
        fused = [*(["add"] if self.binary else []), *([self.post_op.attr] if self.post_op.attr != "none" else [])]
        into = ", into_other=True" if self.into_other else ""
        return f"{tuple(self.packed_weight.shape)}, stride={self.stride}, padding={self.padding}, groups={self.groups}, fused={fused}{into}"


def fused_linear_add(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(x, weight, bias) + other`` by oneDNN's fused kernel (``weight`` dense or prepacked).

    The kernel adds same-shape tensors only: where ``other`` broadcasts (a (1, tokens, dim)
    table fitted a batch of 1 when the fusion was planned), the add runs after the kernel.
    """
    if other.shape != (*x.shape[:-1], weight.shape[0]):
        return mkldnn._linear_pointwise(x, weight, bias, "none", [], "") + other
    return mkldnn._linear_pointwise.binary(x, other, weight, bias, "add")


# The same as a torch op, for graphs (`use_onednn_linear`): torch.fx, pickling and torch.export
# see one opaque call instead of tracing into the shape check.
@torch.library.custom_op("graphopt::linear_add", mutates_args=(), schema="(Tensor x, Tensor other, Tensor weight, Tensor? bias) -> Tensor")
def linear_add(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return fused_linear_add(x, other, weight, bias)


@linear_add.register_fake
def _linear_add_result(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(torch.broadcast_shapes((*x.shape[:-1], weight.shape[0]), other.shape))


class OneDNNLinear(Prepacked):
    """linear (+ activation, or + add) by ``torch.ops.mkldnn._linear_pointwise`` on a prepacked weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, post_op: PostOp = NO_POST_OP, binary: bool = False) -> None:
        self.rows = rows  # input rows (product of leading dims) the weight is packed for
        super().__init__(weight, bias, post_op, binary)

    def pack(self, weight: torch.Tensor) -> None:
        self.packed_weight = mkldnn._reorder_linear_weight(weight.detach(), self.rows)

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        if other is None:
            attr, _, algorithm = self.post_op
            return mkldnn._linear_pointwise(x, self.packed_weight, self.bias, attr, self.scalars, algorithm)
        return fused_linear_add(x, other, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        fused = [*(["add"] if self.binary else []), *([self.post_op.attr] if self.post_op.attr != "none" else [])]
        return f"{tuple(self.packed_weight.shape)}, fused={fused}"


def prepacked_modules(module: nn.Module) -> list[str]:
    """Names of the submodules of ``module`` that run oneDNN kernels on prepacked weights."""
    return [name for name, submodule in module.named_modules() if isinstance(submodule, Prepacked)]

"""int8 modules the optimized graph calls at run time: conv/linear on oneDNN's int8 kernels, weights prepacked once.

`quantize_int8` (the pass) puts these modules in place of the `OneDNNConv` / `OneDNNLinear`
modules `use_onednn_kernels` made. Each one takes and returns float tensors, like the
module it replaces:

- the input is quantized per tensor to uint8 with the scale and zero point calibrated
  for it;
- the weight is quantized per output channel, symmetric, to int8, and prepacked once
  (``onednn.qconv_prepack`` / ``qlinear_prepack``);
- ``onednn.qconv_pointwise`` / ``qlinear_pointwise`` computes in int32 and writes float32,
  with the activation fused where oneDNN's int8 kernels take it; a conv's residual add
  (with a ReLU or nothing after it) is fused too, ``onednn.qconv2d_pointwise.binary``
  with oneDNN's sum post-op, which accumulates into the other operand: into ``other``
  itself where `compute_in_place` set ``into_other`` (``other`` is not read again) and it
  holds the result, else into a copy. A linear's add, and an activation the kernels do
  not take, run after the kernel in float32;
- where every reader of the result is an int8 op reading it as its input, or an int8
  conv adding into it (conv -> conv, a residual block's output -> the next block),
  `quantize_int8` sets ``output_quantization`` to their input scale and zero point: the
  kernel then writes uint8, which they take as it is (no float tensor in between). A conv
  that adds into a uint8 ``other`` (``accum_quantization``: its scale and zero point)
  writes uint8 too, or, where its own result must be float, adds into ``other``
  dequantized.

On CPUs without VNNI or AMX (AVX2 only, e.g. AMD Zen 2), oneDNN multiplies uint8 by int8
with ``vpmaddubsw``, which saturates a pair of products at 16 bits: activations then use
7 bits (0..127), the "reduce_range" of PyTorch's x86 quantization. `activation_levels`
finds out which by running a conv whose exact result such saturation would change.

``state_dict()`` keeps the float module's keys (``weight``: the int8 weight times its scales);
``copy.deepcopy`` and pickling store the int8 weight and repack it on load. ``graphopt.save`` and
``graphopt.export_onnx`` refuse graphs with these modules.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from graphopt.runtime.onednn import NO_POST_OP, PostOp, WeightInStateDict, aten_post_op, conv_windows, holds_conv_result

onednn = torch.ops.onednn

# the activations oneDNN's int8 conv takes as post-ops (others run after the kernel)
CONV_POST_OPS = frozenset({"none", "relu", "hardtanh", "hardswish", "swish"})
LINEAR_POST_OPS = frozenset({"none", "relu"})
# the activations oneDNN's int8 conv takes after a fused add (sum post-op)
CONV_ADD_POST_OPS = frozenset({"none", "relu"})


@functools.cache
def activation_levels() -> int:
    """How many uint8 levels activations may use on this CPU: 256, or 128 where oneDNN's int8 products saturate."""
    channels = 64
    x = torch.full((1, channels, 1, 1), 255, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    weight = torch.full((1, channels, 1, 1), 127, dtype=torch.int8)
    scales = torch.ones(1)
    packed = onednn.qconv_prepack(weight, scales, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, list(x.shape))
    y = onednn.qconv_pointwise(x, 1.0, 0, packed, scales, torch.zeros(1, dtype=torch.long), None, [1, 1], [0, 0], [1, 1], 1, 1.0, 0, torch.float32, "none", [], "")
    return 256 if float(y.flatten()[0]) == 255 * 127 * channels else 128


def has_int8_dot_products() -> bool:
    """Whether this CPU's int8 products do not saturate (VNNI or AMX: `activation_levels` is 256): there oneDNN's int8
    kernels run at about twice bf16's rate; without them (AVX2's ``vpmaddubsw``) about at float32's."""
    return activation_levels() == 256


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output channel): symmetric per-channel quantization."""
    dims = tuple(range(1, weight.dim()))
    scales = (weight.detach().abs().amax(dim=dims).float() / 127).clamp_min(1e-12)
    shape = (-1,) + (1,) * (weight.dim() - 1)
    quantized = torch.clamp(torch.round(weight.detach().float() / scales.view(shape)), -127, 127).to(torch.int8)
    return quantized, scales


def quantize_tensor(x: torch.Tensor, scale: float, zero_point: int, max_level: int) -> torch.Tensor:
    """Float ``x`` as uint8 levels: round(x / scale) + zero_point, clamped to 0..max_level."""
    return torch.mul(x, 1.0 / scale).add_(zero_point).round_().clamp_(0, max_level).to(torch.uint8)


class Int8Op(WeightInStateDict):
    """A conv or linear on oneDNN's int8 kernels: quantizes its float input, returns float32.

    ``state_dict()`` has ``<path>.weight`` (the int8 weight times its scales, float32) and
    ``<path>.bias``, as the float module had; ``load_state_dict`` quantizes and repacks.
    """

    packed_weight: torch.Tensor
    post_ops: frozenset[str] = frozenset()
    add_post_ops: frozenset[str] = frozenset()  # the activations the kernel takes after a fused add
    output_quantization: tuple[float, int] | None = None  # (scale, zero point): write uint8 for int8 readers

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: float, input_zero_point: int, post_op: PostOp, binary: bool) -> None:
        super().__init__()
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.input_scale, self.input_zero_point = float(input_scale), int(input_zero_point)
        self.input_max = activation_levels() - 1  # the largest uint8 level an input may take on this CPU
        self.post_op, self.binary = post_op, binary
        self.adds_in_kernel = binary and post_op.attr in self.add_post_ops
        # the activation the kernel runs; an add, or an activation it does not take, runs after it in float32
        fused = post_op if post_op.attr in (self.add_post_ops if binary else self.post_ops) else NO_POST_OP
        self.kernel_post_op, self.scalars = fused, list(fused.scalars)
        self.after = None if post_op.attr == "none" or fused is post_op else aten_post_op(*post_op)
        self.set_weight(weight)

    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (float) and prepack it."""
        self.qweight, self.weight_scale = quantize_weight(weight)
        self.weight_zero_point = torch.zeros(self.weight_scale.numel(), dtype=torch.long)
        self.pack()

    def pack(self) -> None:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The weight the kernel computes with, as float32."""
        return self.qweight.float() * self.weight_scale.view((-1,) + (1,) * (self.qweight.dim() - 1))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as uint8 with this op's input scale and zero point (a uint8 ``x`` already is: an int8 op wrote it)."""
        return x if x.dtype == torch.uint8 else quantize_tensor(x, self.input_scale, self.input_zero_point, self.input_max)

    @property
    def output(self) -> tuple[float, int, torch.dtype | None]:
        """The kernel's output scale, zero point and dtype (None: uint8)."""
        if self.output_quantization is None:
            return 1.0, 0, torch.float32
        return *self.output_quantization, None

    def finish(self, y: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        """The add and the activation the kernel did not run; a uint8 result kept within the levels its readers take."""
        if y.dtype == torch.uint8:
            return y.clamp_(max=self.input_max) if self.input_max < 255 else y
        if other is not None and not self.adds_in_kernel:
            y = y + other
        if self.after is not None:
            function, args, kwargs = self.after
            y = function(y, *args, **kwargs)
        return y

    def weight_shape(self) -> torch.Size:
        return self.qweight.shape

    def load_weight(self, weight: torch.Tensor) -> None:
        self.set_weight(weight)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__().copy()
        del state["packed_weight"]  # opaque mkldnn tensors can be neither copied nor pickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.pack()

    def extra_repr(self) -> str:
        fused = [*(["add"] if self.binary else []), *([self.post_op.attr] if self.post_op.attr != "none" else [])]
        output = ", uint8 output" if self.output_quantization is not None else ""
        return f"{tuple(self.qweight.shape)}, input scale={self.input_scale:.3g} zero_point={self.input_zero_point}, fused={fused}{output}"


class Int8Conv(Int8Op):
    """conv2d (+ add) (+ activation) by ``onednn.qconv_pointwise``: uint8 input, int8 weight, float32 result.

    With a fused add (``conv(x, other)``), by ``onednn.qconv2d_pointwise.binary``, which
    accumulates into ``other`` (or a copy of it, unless ``into_other``).
    """

    post_ops = CONV_POST_OPS
    add_post_ops = CONV_ADD_POST_OPS
    into_other = False  # set by compute_in_place where ``other`` is not read again: the add accumulates into it
    accum_quantization: tuple[float, int] | None = None  # (scale, zero point) of a uint8 ``other``: an int8 conv wrote it

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, padding: list[int], stride: list[int], dilation: list[int], groups: int,
        input_size: list[int], input_scale: float, input_zero_point: int, post_op: PostOp = NO_POST_OP, binary: bool = False,
    ) -> None:  # fmt: skip
        self.padding, self.stride, self.dilation, self.groups, self.input_size = padding, stride, dilation, groups, input_size
        self.windows = conv_windows(weight, padding, stride, dilation)
        super().__init__(weight, bias, input_scale, input_zero_point, post_op, binary)

    def pack(self) -> None:
        self.packed_weight = onednn.qconv_prepack(
            self.qweight, self.weight_scale, self.input_scale, self.input_zero_point, self.stride, self.padding, self.dilation, self.groups, self.input_size
        )

    def accumulator(self, qx: torch.Tensor, other: torch.Tensor, float_result: bool) -> tuple[torch.Tensor, float, int]:
        """The tensor the fused add accumulates into (and overwrites), with its scale and zero point.

        The kernel adds float into a float result and uint8 into a uint8 one: ``other`` itself where ``into_other``
        and it can hold the result (`holds_conv_result`); else a channels_last copy, or a uint8 ``other``
        dequantized for a float result.
        """
        if other.dtype == torch.uint8:
            assert self.accum_quantization is not None, "a uint8 operand of an int8 conv's add without its quantization"
            scale, zero_point = self.accum_quantization
            if float_result:
                return other.to(torch.float32, memory_format=torch.channels_last).sub_(zero_point).mul_(scale), 1.0, 0
            dtype = torch.uint8
        else:
            scale, zero_point, dtype = 1.0, 0, torch.float32
        if self.into_other and holds_conv_result(qx, other, dtype, self.qweight.shape[0], self.windows):
            return other, scale, zero_point
        return other.to(dtype, memory_format=torch.channels_last, copy=True), scale, zero_point

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        qx = self.quantize(x.contiguous(memory_format=torch.channels_last))
        attr, _, algorithm = self.kernel_post_op
        quantized = (qx, self.input_scale, self.input_zero_point, self.packed_weight, self.weight_scale, self.weight_zero_point)
        geometry = (self.stride, self.padding, self.dilation, self.groups)
        if other is None or not self.adds_in_kernel:
            y = onednn.qconv_pointwise(*quantized, self.bias, *geometry, *self.output, attr, self.scalars, algorithm or "")
            return self.finish(y, other)
        # a float operand of a uint8 result (quantize_int8 does not plan one): the sum in float32, quantized after
        requantize = other.dtype != torch.uint8 and self.output_quantization is not None
        output = (1.0, 0, torch.float32) if requantize else self.output
        accum, accum_scale, accum_zero_point = self.accumulator(qx, other, float_result=requantize or self.output_quantization is None)
        y = onednn.qconv2d_pointwise.binary(
            *quantized, accum, self.bias, *geometry, *output, accum_scale, accum_zero_point, "sum", 1.0, attr, self.scalars, algorithm or "",
        )  # fmt: skip
        if requantize:
            return quantize_tensor(y, *self.output_quantization, self.input_max)  # type: ignore[misc]
        return self.finish(y, None)


class Int8Linear(Int8Op):
    """linear (+ add) (+ activation) by ``onednn.qlinear_pointwise``: uint8 input, int8 weight, float32 result."""

    post_ops = LINEAR_POST_OPS

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, input_scale: float, input_zero_point: int, post_op: PostOp = NO_POST_OP, binary: bool = False
    ) -> None:
        self.rows = rows
        super().__init__(weight, bias, input_scale, input_zero_point, post_op, binary)

    def pack(self) -> None:
        self.packed_weight = onednn.qlinear_prepack(self.qweight, [self.rows, self.qweight.shape[1]])

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        attr, _, algorithm = self.kernel_post_op
        y = onednn.qlinear_pointwise(
            self.quantize(x.contiguous()), self.input_scale, self.input_zero_point, self.packed_weight, self.weight_scale, self.weight_zero_point,
            self.bias, *self.output, attr, self.scalars, algorithm or "none",
        )  # fmt: skip
        return self.finish(y, other)


def int8_modules(module: nn.Module) -> list[str]:
    """Names of the submodules of ``module`` that run oneDNN's int8 kernels."""
    return [name for name, submodule in module.named_modules() if isinstance(submodule, Int8Op)]

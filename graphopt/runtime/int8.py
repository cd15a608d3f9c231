"""int8 modules the optimized graph calls at run time: conv/linear on oneDNN's int8 kernels, weights prepacked once.

`quantize_int8` (the pass) puts these modules in place of the `OneDNNConv` / `OneDNNLinear`
modules `use_onednn_kernels` made. Each one takes and returns float tensors, like the
module it replaces:

- the input is quantized per tensor to uint8 with the scale and zero point calibrated
  for it;
- the weight is quantized per output channel, symmetric, to int8, and prepacked once
  (``onednn.qconv_prepack`` / ``qlinear_prepack``);
- ``onednn.qconv_pointwise`` / ``qlinear_pointwise`` computes in int32 and writes float32,
  with the activation fused where oneDNN's int8 kernels take it; a residual add, and an
  activation they do not take, run after the kernel in float32;
- where every reader of the result is an int8 op reading it as its input (conv -> conv),
  `quantize_int8` sets ``output_quantization`` to their input scale and zero point: the
  kernel then writes uint8, which they take as it is (no float tensor in between).

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

from graphopt.runtime.onednn import NO_POST_OP, PostOp, WeightInStateDict, aten_post_op

onednn = torch.ops.onednn

# the activations oneDNN's int8 conv takes as post-ops (others run after the kernel)
CONV_POST_OPS = frozenset({"none", "relu", "hardtanh", "hardswish", "swish"})
LINEAR_POST_OPS = frozenset({"none", "relu"})


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


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output channel): symmetric per-channel quantization."""
    dims = tuple(range(1, weight.dim()))
    scales = (weight.detach().abs().amax(dim=dims).float() / 127).clamp_min(1e-12)
    shape = (-1,) + (1,) * (weight.dim() - 1)
    quantized = torch.clamp(torch.round(weight.detach().float() / scales.view(shape)), -127, 127).to(torch.int8)
    return quantized, scales


class Int8Op(WeightInStateDict):
    """A conv or linear on oneDNN's int8 kernels: quantizes its float input, returns float32.

    ``state_dict()`` has ``<path>.weight`` (the int8 weight times its scales, float32) and
    ``<path>.bias``, as the float module had; ``load_state_dict`` quantizes and repacks.
    """

    packed_weight: torch.Tensor
    post_ops: frozenset[str] = frozenset()
    output_quantization: tuple[float, int] | None = None  # (scale, zero point): write uint8 for int8 readers

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, input_scale: float, input_zero_point: int, post_op: PostOp, binary: bool) -> None:
        super().__init__()
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.input_scale, self.input_zero_point = float(input_scale), int(input_zero_point)
        self.input_max = activation_levels() - 1  # the largest uint8 level an input may take on this CPU
        self.post_op, self.binary = post_op, binary
        # the activation the kernel runs; an add, or an activation it does not take, runs after it in float32
        fused = post_op if post_op.attr in self.post_ops and not binary else NO_POST_OP
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
        if x.dtype == torch.uint8:
            return x
        levels = torch.mul(x, 1.0 / self.input_scale).add_(self.input_zero_point).round_().clamp_(0, self.input_max)
        return levels.to(torch.uint8)

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
        if other is not None:
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
    """conv2d (+ add) (+ activation) by ``onednn.qconv_pointwise``: uint8 input, int8 weight, float32 result."""

    post_ops = CONV_POST_OPS

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, padding: list[int], stride: list[int], dilation: list[int], groups: int,
        input_size: list[int], input_scale: float, input_zero_point: int, post_op: PostOp = NO_POST_OP, binary: bool = False,
    ) -> None:  # fmt: skip
        self.padding, self.stride, self.dilation, self.groups, self.input_size = padding, stride, dilation, groups, input_size
        super().__init__(weight, bias, input_scale, input_zero_point, post_op, binary)

    def pack(self) -> None:
        self.packed_weight = onednn.qconv_prepack(
            self.qweight, self.weight_scale, self.input_scale, self.input_zero_point, self.stride, self.padding, self.dilation, self.groups, self.input_size
        )

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        qx = self.quantize(x.contiguous(memory_format=torch.channels_last))
        attr, _, algorithm = self.kernel_post_op
        y = onednn.qconv_pointwise(
            qx, self.input_scale, self.input_zero_point, self.packed_weight, self.weight_scale, self.weight_zero_point, self.bias,
            self.stride, self.padding, self.dilation, self.groups, *self.output, attr, self.scalars, algorithm or "",
        )  # fmt: skip
        return self.finish(y, other)


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

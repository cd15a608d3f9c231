"""The pass registry: every pass graphopt can run, with its stable name and the modes it serves.

Each pass lives in its own module of this package (named like the pass) and follows
the contract in `graphopt.passes.base`. ``exact`` passes change numerics only by
floating-point rounding and run by default; the others are opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphopt.passes.base import MODES, Mode, PassContext, PassFunction, PassResult
from graphopt.passes.drop_conv_bias import drop_conv_bias
from graphopt.passes.fold_conv_bn import fold_conv_bn
from graphopt.passes.remove_dropout import remove_dropout
from graphopt.passes.to_channels_last import to_channels_last
from graphopt.passes.use_attention_kernel import use_attention_kernel
from graphopt.passes.use_low_precision import use_low_precision
from graphopt.passes.use_onednn_kernels import use_onednn_kernels


@dataclass(frozen=True)
class PassInfo:
    """A registered pass."""

    name: str
    function: PassFunction
    modes: tuple[Mode, ...]
    description: str
    exact: bool = True
    measured: bool = False  # its benefit depends on model and hardware: kept only if measured faster when asked


REGISTRY: dict[str, PassInfo] = {
    info.name: info
    for info in (
        PassInfo("remove_dropout", remove_dropout, ("inference",), "remove dropout and identity ops that do nothing at inference"),
        PassInfo(
            "use_attention_kernel",
            use_attention_kernel,
            ("inference", "training"),
            "compute hand-written attention and nn.MultiheadAttention self-attention with F.scaled_dot_product_attention",
        ),
        PassInfo("fold_conv_bn", fold_conv_bn, ("inference",), "fold eval-mode BatchNorm into the preceding conv/conv-transpose/linear"),
        PassInfo("drop_conv_bias", drop_conv_bias, ("training", "inference"), "drop the bias of a conv/linear feeding a BatchNorm (exact, fewer parameters)"),
        PassInfo(
            "to_channels_last",
            to_channels_last,
            ("inference", "training"),
            "run 2-D/3-D convolutions in channels_last, converting layouts only where an op needs it",
            measured=True,
        ),
        PassInfo(
            "use_low_precision",
            use_low_precision,
            ("inference", "training"),
            "run conv/linear/matmul/attention in bf16 or fp16 and sensitive ops in fp32 (optimize(precision=...))",
            exact=False,
        ),
        PassInfo(
            "use_onednn_kernels",
            use_onednn_kernels,
            ("inference",),
            "run conv/linear (+ activation, + residual add) as oneDNN fused CPU kernels with weights prepacked once",
        ),
    )
}

__all__ = ["MODES", "REGISTRY", "Mode", "PassContext", "PassInfo", "PassResult"]

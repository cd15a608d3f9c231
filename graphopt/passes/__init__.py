"""The pass registry: every pass graphopt can run, with its stable name and the modes it serves.

Each pass lives in its own module of this package (named like the pass) and follows
the contract in `graphopt.passes.base`. ``exact`` passes change numerics only by
floating-point rounding and run by default; the others are opt-in.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphopt.passes.base import MODES, Mode, PassContext, PassFunction, PassResult
from graphopt.passes.as_tensor import as_tensor
from graphopt.passes.compute_in_place import compute_in_place
from graphopt.passes.create_on_device import create_on_device
from graphopt.passes.drop_conv_bias import drop_conv_bias
from graphopt.passes.extract_pointwise_regions import extract_pointwise_regions
from graphopt.passes.fold_channel_scale import fold_channel_scale
from graphopt.passes.fold_conv_bn import fold_conv_bn
from graphopt.passes.pad_channels import pad_channels
from graphopt.passes.remove_dropout import remove_dropout
from graphopt.passes.remove_redundant_transfers import remove_redundant_transfers
from graphopt.passes.report_sync_points import report_sync_points
from graphopt.passes.to_channels_last import to_channels_last
from graphopt.passes.use_attention_kernel import use_attention_kernel
from graphopt.passes.use_global_pool_kernel import use_global_pool_kernel
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
        PassInfo(
            "report_sync_points",
            report_sync_points,
            ("inference", "training"),
            "list host synchronisation points in forward (.item(), .cpu(), .tolist(), data-dependent shapes) with source lines; report only",
        ),
        PassInfo("create_on_device", create_on_device, ("inference", "training"), "create tensors with the device/dtype they are moved to, instead of creating and copying"),
        PassInfo("as_tensor", as_tensor, ("inference", "training"), "torch.tensor(x) of a tensor in the graph becomes torch.as_tensor(x): no copy when dtype/device match"),
        PassInfo(
            "remove_redundant_transfers",
            remove_redundant_transfers,
            ("inference", "training"),
            "remove no-op and round-trip .to()/.cpu()/.cuda() moves and casts; host-to-device copies made non_blocking",
        ),
        PassInfo("remove_dropout", remove_dropout, ("inference",), "remove dropout and identity ops that do nothing at inference"),
        PassInfo(
            "use_attention_kernel",
            use_attention_kernel,
            ("inference", "training"),
            "compute hand-written attention and nn.MultiheadAttention self-attention with F.scaled_dot_product_attention",
        ),
        PassInfo("fold_conv_bn", fold_conv_bn, ("inference",), "fold eval-mode BatchNorm into the preceding conv/conv-transpose/linear"),
        PassInfo(
            "fold_channel_scale",
            fold_channel_scale,
            ("inference",),
            "fold a stored per-channel scale of a conv/linear output (layer scale) into the weights",
        ),
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
            "use_global_pool_kernel",
            use_global_pool_kernel,
            ("inference",),
            "global average pooling of bf16/fp16 channels_last CPU tensors by ATen's pooling kernel instead of a float32 copy and mean",
        ),
        PassInfo(
            "compute_in_place",
            compute_in_place,
            ("inference",),
            "write add/mul/div into an operand that is not read again instead of allocating a new tensor (run last)",
        ),
        PassInfo(
            "pad_channels",
            pad_channels,
            ("inference",),
            "zero-pad conv/linear channel counts to multiples of 8 for fp16/bf16 tensor cores (exact; opt-in: passes=[...])",
        ),
        PassInfo(
            "extract_pointwise_regions",
            extract_pointwise_regions,
            ("inference", "training"),
            "gather connected pointwise ops into regions that optimize(fuse=...) compiles into one kernel each",
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

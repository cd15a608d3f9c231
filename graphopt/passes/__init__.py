"""The pass registry: every pass graphopt can run, and everything the rest of graphopt needs to know about it.

Each pass lives in its own module of this package (named like the pass) and follows
the contract in `graphopt.passes.base`. `PassInfo` is the ONE place where a pass's
name and its metadata appear: the modes it serves, the presets that run it, how it
orders against the others, whether it is exact, whether ONNX export keeps it, whether
it changes stored tensors. `graphopt.pipeline` derives every pass list from it (the
presets, the passes an ``optimize`` call runs, tune's candidates, ONNX export's subset,
the benchmark's variants); no other module spells a pass name.

``REGISTRY`` is in run order: a preset runs its passes in this order, and so does any
list the pipeline builds (``passes=[...]`` keeps the caller's order, except for the
passes marked ``runs_last``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from graphopt.passes.base import MODES, Mode, PassContext, PassFunction, PassResult
from graphopt.passes.as_tensor import as_tensor
from graphopt.passes.compute_in_place import compute_in_place
from graphopt.passes.create_on_device import create_on_device
from graphopt.passes.drop_conv_bias import drop_conv_bias
from graphopt.passes.extract_pointwise_regions import extract_pointwise_regions
from graphopt.passes.fold_channel_scale import fold_channel_scale
from graphopt.passes.fold_conv_bn import fold_conv_bn
from graphopt.passes.pad_channels import pad_channels
from graphopt.passes.quantize_int8 import quantize_int8
from graphopt.passes.remove_dropout import remove_dropout
from graphopt.passes.remove_redundant_transfers import remove_redundant_transfers
from graphopt.passes.report_sync_points import report_sync_points
from graphopt.passes.to_channels_last import to_channels_last
from graphopt.passes.use_attention_kernel import use_attention_kernel
from graphopt.passes.use_global_pool_kernel import use_global_pool_kernel
from graphopt.passes.use_low_precision import use_low_precision
from graphopt.passes.use_onednn_kernels import use_onednn_kernels
from graphopt.passes.use_onednn_linear import use_onednn_linear


@dataclass(frozen=True)
class PassInfo:
    """A registered pass and the facts about it that the pipeline, tune, ONNX export and the benchmark use."""

    name: str
    function: PassFunction
    modes: tuple[Mode, ...]
    description: str
    presets: tuple[Mode, ...] = ()  # the mode presets that run it by default; otherwise it is opt-in
    exact: bool = True  # changes numerics by rounding only; False: verified with the low dtype's tolerance
    measured: bool = False  # its benefit depends on model and hardware: with memory_format="auto", undone only if measured clearly slower
    preset_only_measured: bool = False  # in its presets only with memory_format="auto" (measured); otherwise opt-in (passes=)
    changes_state: bool = False  # rewrites stored tensors (values, shapes, dtypes or keys); see docs/writing-a-pass.md
    layout: bool = False  # changes memory formats: memory_format="preserve" leaves it out
    lowers_precision: bool = False  # runs exactly when optimize(precision=...) asks for bf16/fp16, before the layout passes
    quantizes: bool = False  # runs exactly when optimize(precision="int8") asks for it, with the cpu_kernels passes it builds on
    after_precision: bool = False  # must see the dtypes the precision pass chooses: runs after it
    cpu_kernels: bool = False  # swaps ops for CPU-specific kernels: tune's "+ oneDNN" candidates and the benchmark add it
    runs_last: bool = False  # runs after all others, whatever order passes= gives (in registry order among such passes)
    fuse: Literal["any", "without", "regions"] = "any"  # "without": left out with optimize(fuse=...); "regions": makes the regions fuse= compiles
    onnx: Literal["exported", "left out", "inexpressible"] = "exported"  # what export_onnx does with it: "inexpressible" is also refused in passes=


REGISTRY: dict[str, PassInfo] = {
    info.name: info
    for info in (
        PassInfo(
            "report_sync_points",
            report_sync_points,
            MODES,
            "list host synchronisation points in forward (.item(), .cpu(), .tolist(), data-dependent shapes) with source lines; report only",
            presets=MODES,
        ),
        # dropout before folding, so that BatchNorms behind a removed identity are seen by fold_conv_bn
        PassInfo("remove_dropout", remove_dropout, ("inference",), "remove dropout and identity ops that do nothing at inference", presets=("inference",)),
        PassInfo(
            "use_attention_kernel",
            use_attention_kernel,
            MODES,
            "compute hand-written attention and nn.MultiheadAttention self-attention with F.scaled_dot_product_attention",
            presets=MODES,
        ),
        PassInfo(
            "create_on_device",
            create_on_device,
            MODES,
            "create tensors with the device/dtype they are moved to, instead of creating and copying",
            presets=MODES,
            changes_state=True,
        ),
        PassInfo(
            "as_tensor", as_tensor, MODES, "torch.tensor(x) of a tensor in the graph becomes torch.as_tensor(x): no copy when dtype/device match", presets=MODES
        ),
        PassInfo(
            "remove_redundant_transfers",
            remove_redundant_transfers,
            MODES,
            "remove no-op and round-trip .to()/.cpu()/.cuda() moves and casts; host-to-device copies made non_blocking",
            presets=MODES,
        ),
        PassInfo(
            "fold_conv_bn",
            fold_conv_bn,
            ("inference",),
            "fold eval-mode BatchNorm into the preceding conv/conv-transpose/linear",
            presets=("inference",),
            changes_state=True,
        ),
        PassInfo(
            "fold_channel_scale",
            fold_channel_scale,
            ("inference",),
            "fold a stored per-channel scale of a conv/linear output (layer scale) into the weights",
            presets=("inference",),
            changes_state=True,
        ),
        # opt-in: exact under plain SGD only, and the optimizer is unknown when optimizing (see its module docstring)
        PassInfo(
            "drop_conv_bias",
            drop_conv_bias,
            ("training", "inference"),
            "drop the bias of a conv/linear feeding a BatchNorm (fewer parameters; training stays exact under plain SGD "
            "without weight decay only; opt-in: passes=[...])",
            changes_state=True,
        ),
        # after the exact rewrites, before the layout and kernel choices that depend on each value's dtype
        PassInfo(
            "use_low_precision",
            use_low_precision,
            MODES,
            "run conv/linear/matmul/attention in bf16 or fp16 and sensitive ops in fp32 (optimize(precision=...))",
            exact=False,
            changes_state=True,
            lowers_precision=True,
        ),
        PassInfo(
            "to_channels_last",
            to_channels_last,
            MODES,
            "run 2-D/3-D convolutions in channels_last, converting layouts only where an op needs it",
            presets=MODES,
            measured=True,
            layout=True,
            after_precision=True,
        ),
        PassInfo(
            "use_global_pool_kernel",
            use_global_pool_kernel,
            ("inference",),
            "global average pooling of bf16/fp16 channels_last CPU tensors by ATen's pooling kernel instead of a float32 copy and mean",
            presets=("inference",),
            after_precision=True,
        ),
        PassInfo(
            "use_onednn_kernels",
            use_onednn_kernels,
            ("inference",),
            "run conv/linear (+ activation, + residual add) as oneDNN fused CPU kernels with weights prepacked once "
            "(by default unless measured slower)",
            presets=("inference",),
            measured=True,
            preset_only_measured=True,
            changes_state=True,
            after_precision=True,
            cpu_kernels=True,
            fuse="without",
            onnx="inexpressible",
        ),
        # on the modules use_onednn_kernels made, before in-place writes look at them
        PassInfo(
            "quantize_int8",
            quantize_int8,
            ("inference",),
            "run convs/linears on oneDNN's int8 kernels, calibrated, keeping in float32 the layers over the accuracy budget "
            "or not faster in int8 (optimize(precision='int8', calibration=...))",
            exact=False,
            changes_state=True,
            after_precision=True,
            quantizes=True,
            fuse="without",
            onnx="inexpressible",
        ),
        # after use_onednn_kernels: when both run, the prepacked kernels take the linears first
        PassInfo(
            "use_onednn_linear",
            use_onednn_linear,
            ("inference",),
            "run large CPU linears (+ activation, or + residual add) as oneDNN fused kernels on their own weights unless measured slower",
            presets=("inference",),
            after_precision=True,
            onnx="left out",
        ),
        PassInfo(
            "pad_channels",
            pad_channels,
            ("inference",),
            "zero-pad conv/linear channel counts to multiples of 8 for fp16/bf16 tensor cores (exact; opt-in: passes=[...])",
            changes_state=True,
        ),
        # in-place writes last: passes after it would not match a.add_(b) as an add; with fuse= the compiler plans the buffers
        PassInfo(
            "compute_in_place",
            compute_in_place,
            ("inference",),
            "write add/mul/div into an operand that is not read again instead of allocating a new tensor (run last)",
            presets=("inference",),
            after_precision=True,
            runs_last=True,
            fuse="without",
            onnx="left out",
        ),
        # regions last: they are made of the final graph's ops, and other passes do not look inside them
        PassInfo(
            "extract_pointwise_regions",
            extract_pointwise_regions,
            MODES,
            "gather connected pointwise ops into regions that optimize(fuse=...) compiles into one kernel each",
            runs_last=True,
            fuse="regions",
        ),
    )
}

__all__ = ["MODES", "REGISTRY", "Mode", "PassContext", "PassInfo", "PassResult"]

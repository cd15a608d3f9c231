"""fold_conv_bn: fold an inference-mode BatchNorm into the conv or linear layer that feeds it.

Pattern: ``ConvNd | ConvTransposeNd -> BatchNormNd`` and ``Linear -> BatchNorm1d``, in
module, functional and ATen form. With ``s = gamma / sqrt(running_var + eps)`` per
output channel::

    W' = W * s     (scaled along the output-channel axis)
    b' = (b - running_mean) * s + beta

computed by ``torch.nn.utils.fusion.fuse_conv_bn_weights`` / ``fuse_linear_bn_weights``.
The BatchNorm node disappears and its users read the conv's output. Each fold is
recorded as a `graphopt.checkpoint.FoldedBatchNorm`, so an original checkpoint can be
folded the same way (``OptimizedModule.load_original_state_dict``).

Preconditions, each a recorded skip reason when it fails:
- the BatchNorm normalises with running statistics (eval mode, track_running_stats);
- the BatchNorm's input is the conv's only use (a conv also read elsewhere must keep
  its unfolded output) and the conv's parameters are not shared or tied;
- weights and statistics are stored floating-point tensors, not computed in the graph;
- a Linear feeds BatchNorm1d on a 2-D ``(N, C)`` tensor (on 3-D input BatchNorm1d
  normalises a different axis than Linear's output features);
- grouped transposed convolutions are left alone (their weight layout puts output
  channels in groups that ``fuse_conv_bn_weights`` does not handle).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from graphopt.checkpoint import FoldedBatchNorm
from graphopt.ops import ParameterUsage
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.passes.conv_bn_pairs import conv_bn_pairs
from graphopt.report import PassReport, describe


def fold_conv_bn(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fold eval-mode BatchNorm into the preceding Conv/ConvTranspose/Linear."""
    report = PassReport("fold_conv_bn")
    dropped: list[str] = []
    for node, bn, producer, reason in conv_bn_pairs(gm, ParameterUsage(gm)):
        if reason is None and bn.training:
            reason = "BatchNorm uses batch statistics (training mode or track_running_stats=False)"
        if reason is None and producer is not None and producer.transposed and producer.groups > 1:
            reason = "grouped transposed convolution: folding is not supported"
        if reason is not None:
            report.skip(node, reason)
            continue
        assert producer is not None and producer.weight is not None and bn.output is not None
        assert bn.running_mean is not None and bn.running_var is not None
        # a BatchNorm without affine parameters scales by 1 and shifts by 0
        gamma = bn.weight if bn.weight is not None else torch.ones_like(bn.running_mean)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_mean)
        if producer.kind == "linear":
            weight, bias = fuse_linear_bn_weights(producer.weight, producer.bias, bn.running_mean, bn.running_var, bn.eps, gamma, beta)
        else:
            weight, bias = fuse_conv_bn_weights(
                producer.weight, producer.bias, bn.running_mean, bn.running_var, bn.eps, gamma, beta,
                transpose=producer.transposed,
            )
        own_bias = producer.bias_target
        producer.set_weight(gm, weight)
        producer.set_bias(gm, bias)
        assert producer.weight_target is not None and producer.bias_target is not None
        report.state_changes.append(
            FoldedBatchNorm(
                kind="linear" if producer.kind == "linear" else "conv_transpose" if producer.transposed else "conv",
                weight=producer.weight_target,
                bias=own_bias,
                folded_bias=producer.bias_target,
                running_mean=bn.targets["running_mean"],
                running_var=bn.targets["running_var"],
                batch_norm_weight=bn.targets.get("weight"),
                batch_norm_bias=bn.targets.get("bias"),
                num_batches_tracked=bn.targets.get("num_batches_tracked"),
                eps=bn.eps,
            )
        )
        bn.output.replace_all_uses_with(producer.node)
        if bn.output is not node:  # tuple-returning form: erase the getitem, then the op
            gm.graph.erase_node(bn.output)
        if bn.module is None:
            dropped += [str(arg.target) for arg in node.all_input_nodes if arg.op == "get_attr"]
        report.rewrite(producer.node, f"folded {describe(node)} into {producer.kind}")
        gm.graph.erase_node(node)
    return finish(gm, bool(report.rewrites), report, dict.fromkeys(dropped))

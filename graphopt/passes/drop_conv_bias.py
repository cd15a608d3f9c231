"""drop_conv_bias: remove the bias of a conv or linear layer that feeds a BatchNorm.

Pattern: ``ConvNd | ConvTransposeNd | Linear (bias) -> BatchNorm``, any graph form.

In training mode BatchNorm subtracts the batch mean, so a per-channel constant added
before it cancels exactly: the bias only costs memory, compute and an optimizer state
(playbook: disable bias for convolutions directly followed by a batch norm). In eval
mode BatchNorm subtracts ``running_mean`` instead, so the pass also sets
``running_mean -= bias``. That identity survives the statistics' updates: a momentum
update ``(1-m)(rm - b) + m(mean - b)`` and the cumulative average both keep the offset.
Outputs and the gradients of the remaining parameters are unchanged; the parameter count
drops. Each dropped bias is recorded as a `graphopt.checkpoint.DroppedBias`, so
checkpoints of the original model load into the optimized one and back.

Opt-in (``passes=[...]``), in both modes: the result stays exact after optimizer steps
only if the optimizer would have left the original's bias where it was. Plain SGD
without weight decay does (the bias's gradient is zero up to rounding). Weight decay
pulls the original's bias towards zero, and Adam-style optimizers (Adam, AdamW,
RMSprop, ...) normalise its gradient, rounding noise, into steps of about the learning
rate: the original's bias and ``running_mean`` drift while the optimized model has no
bias to move (after 8 AdamW steps at lr=1e-2, eval outputs differ by about 1e-2 of
their scale). graphopt cannot know the optimizer when optimizing, so no preset runs
this pass; in training mode its report carries a note saying so.

Preconditions (recorded skip reasons): the conv's only use is the BatchNorm, its
parameters are not shared, the statistics are stored float tensors not shared with
another BatchNorm, channel counts agree, a Linear feeds a 2-D BatchNorm1d input.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt.checkpoint import DroppedBias
from graphopt.ops import ParameterUsage
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.passes.conv_bn_pairs import conv_bn_pairs
from graphopt.report import PassReport, describe


TRAINING_CAVEAT = (
    "training stays exact under plain SGD without weight decay only: with weight decay or an adaptive optimizer "
    "(Adam, AdamW, RMSprop, ...) the original's biases would have moved, so training differs from the original's"
)


def drop_conv_bias(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Drop the bias of a conv/linear layer feeding a BatchNorm, keeping eval mode exact."""
    report = PassReport("drop_conv_bias")
    usage = ParameterUsage(gm)
    for node, bn, producer, reason in conv_bn_pairs(gm, usage):
        if producer is None or producer.bias_target is None:
            continue  # no bias to drop: nothing to report
        if reason is None and bn.running_mean is not None and usage.is_shared(bn.running_mean):
            reason = "running_mean is shared with another BatchNorm"
        if reason is not None:
            report.skip(node, reason)
            continue
        assert producer.bias is not None and producer.weight_target is not None
        report.state_changes.append(
            DroppedBias(producer.bias_target, producer.weight_target, bn.running_mean_target, producer.bias.numel(), describe(node))
        )
        if bn.running_mean is not None:
            with torch.no_grad():
                bn.running_mean.sub_(producer.bias.detach().to(bn.running_mean.dtype))
        producer.remove_bias(gm)
        report.rewrite(producer.node, f"dropped the bias before {describe(node)}")
    if report.rewrites and ctx.mode == "training":
        report.notes.append(TRAINING_CAVEAT)
    return finish(gm, bool(report.rewrites), report)

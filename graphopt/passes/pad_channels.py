"""pad_channels: zero-pad conv/linear channel counts to multiples of 8 for fp16/bf16 tensor cores.

Pattern: a conv (or linear) whose output channels are not a multiple of 8, feeding
another conv of the same rank (or linear) directly or through activations applied to
each element (ReLU, GELU, SiLU, sigmoid, ...)::

    W1' = [W1; 0]   b1' = [b1; 0]      (zero output channels appended to the producer)
    W2' = [W2, 0]                      (zero input channels appended to the consumer)

The padded channels carry ``f(0)``, a finite number, and the consumer multiplies them by
zero weights: its output is unchanged, up to summation order. The model's inputs and
outputs keep their shapes; only the tensor between the two layers grows. Tensor cores
(fp16/bf16 on NVIDIA GPUs) need channel counts that are multiples of 8; on a CPU the
padding is extra work, so the pass is opt-in: ``optimize(..., passes=[..., "pad_channels"])``.

Inference only: training would give the consumer's padded weights non-zero gradients
(``f(0) != 0`` for sigmoid or GELU-like activations), and the padding would stop being exact.

Guards, each a recorded skip: the output has other users or reaches the model's output
(its shape would change), the next op mixes channels otherwise (a reshape, a norm,
pooling into a flatten, ...), grouped or transposed convs, shared or tied weights,
weights computed in the graph, modules that override forward().
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt.ops import ParameterUsage, WeightedOpView, is_unary_pointwise, weighted_op_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport, describe

MULTIPLE = 8


def _consumer(gm: fx.GraphModule, producer: WeightedOpView) -> tuple[WeightedOpView | None, str | None]:
    """The conv/linear that reads ``producer``'s output through per-element activations only, or why there is none."""
    value = producer.node
    while True:
        users = list(value.users)
        if len(users) != 1:
            return None, f"{value.name} has {len(users)} users: padding would change what they see"
        user = users[0]
        if user.op == "output":
            return None, "its output channels are returned by the model"
        consumer = weighted_op_view(gm, user)
        if consumer is not None:
            if consumer.input is not value:
                return None, f"{describe(user)} reads it as weight or bias, not as input"
            return consumer, None
        if not is_unary_pointwise(gm, user) or user.args[0] is not value:
            return None, f"{describe(user)} is not a per-element activation between two conv/linear layers"
        value = user


def _unpaddable(view: WeightedOpView, usage: ParameterUsage) -> str | None:
    if view.unsupported is not None:
        return view.unsupported
    if view.transposed or view.groups != 1:
        return f"{view.kind} with groups={view.groups}" if not view.transposed else "transposed convolution"
    if view.weight is None or not view.weight.is_floating_point():
        return "weight is not a stored floating-point tensor"
    return usage.sharing(view)


def _pad(tensor: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = extra
    return torch.cat([tensor.detach(), tensor.new_zeros(shape)], dim=dim)


def _set_channels(view: WeightedOpView, attribute: str, count: int) -> None:
    if view.module is not None:
        name = {"out": "out_features", "in": "in_features"} if isinstance(view.module, nn.Linear) else {"out": "out_channels", "in": "in_channels"}
        setattr(view.module, name[attribute], count)


def pad_channels(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Zero-pad conv/linear output channels (and the next layer's input channels) to multiples of 8."""
    report = PassReport("pad_channels")
    usage = ParameterUsage(gm)
    for node in list(gm.graph.nodes):
        producer = weighted_op_view(gm, node)
        if producer is None or producer.weight is None:
            continue
        channels = producer.weight.shape[0]
        if channels % MULTIPLE == 0:
            continue
        consumer, reason = _consumer(gm, producer)
        reason = reason or _unpaddable(producer, usage)
        if consumer is not None and reason is None:
            if consumer.spatial_dims != producer.spatial_dims:
                reason = f"{producer.kind} feeds a {consumer.kind}"
            else:
                reason = _unpaddable(consumer, usage)
        if reason is not None:
            report.skip(node, f"{channels} output channels not padded: {reason}")
            continue
        assert consumer is not None and producer.weight is not None and consumer.weight is not None
        padded = -(-channels // MULTIPLE) * MULTIPLE
        producer.set_weight(gm, _pad(producer.weight, 0, padded - channels))
        if producer.bias is not None:
            producer.set_bias(gm, _pad(producer.bias, 0, padded - channels))
        consumer.set_weight(gm, _pad(consumer.weight, 1, padded - channels))
        _set_channels(producer, "out", padded)
        _set_channels(consumer, "in", padded)
        report.rewrite(node, f"{producer.kind} output channels {channels} -> {padded} (zero-padded; {describe(consumer.node)} input too)")
    return finish(gm, bool(report.rewrites), report)

"""Shared matcher of the BatchNorm passes: a conv/linear layer whose only use is a BatchNorm.

`conv_bn_pairs` yields each BatchNorm with the layer feeding it, or the reason the pair
cannot be rewritten in place; `fold_conv_bn` and `drop_conv_bias` add their own guards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.fx as fx

from graphopt.ops import BatchNormView, ParameterUsage, WeightedOpView, batch_norm_view, tensor_meta, weighted_op_view


def conv_bn_pairs(
    gm: fx.GraphModule, usage: ParameterUsage
) -> Iterator[tuple[fx.Node, BatchNormView, WeightedOpView | None, str | None]]:
    """Yield ``(node, batch_norm, producer, reason)``; ``reason`` is None when the pair is rewritable."""
    for node in list(gm.graph.nodes):
        bn = batch_norm_view(gm, node)
        if bn is None:
            continue
        producer = weighted_op_view(gm, bn.input) if isinstance(bn.input, fx.Node) else None
        if producer is None:
            yield node, bn, None, "input does not come from a conv or linear layer"
        else:
            yield node, bn, producer, _pair_problem(bn, producer, usage)


def _pair_problem(bn: BatchNormView, producer: WeightedOpView, usage: ParameterUsage) -> str | None:
    if bn.unsupported or producer.unsupported:
        return bn.unsupported or producer.unsupported
    if bn.output is None:
        return "BatchNorm's saved statistics are used by other ops"
    if len(producer.node.users) > 1:
        return f"{producer.kind} output has {len(producer.node.users)} users; a rewrite would change the others"
    sharing = usage.sharing(producer)
    if sharing:
        return sharing
    assert producer.weight is not None
    tensors = (producer.weight, producer.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var)
    if not all(t is None or t.is_floating_point() for t in tensors):
        dtypes = sorted({str(t.dtype) for t in tensors if t is not None})
        return f"non-floating-point parameters ({', '.join(dtypes)})"
    out_channels = producer.weight.shape[1] * producer.groups if producer.transposed else producer.weight.shape[0]
    if bn.num_features is not None and bn.num_features != out_channels:
        return f"BatchNorm has {bn.num_features} features but the {producer.kind} has {out_channels} output channels"
    if producer.kind == "linear":
        meta = tensor_meta(producer.node)
        if meta is None:
            return "the linear output's rank is unknown (no shape information)"
        if len(meta[0]) != 2:
            return f"BatchNorm1d on a {len(meta[0])}-D linear output normalises another axis than the linear's features"
    return None

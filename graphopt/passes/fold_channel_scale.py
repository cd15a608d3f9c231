"""fold_channel_scale: fold a stored per-channel scale that multiplies a conv/linear output into its weights.

Pattern (inference): ``s * op(x)`` or ``op(x) * s`` where ``op`` is a conv or linear,
optionally followed by permutes, and ``s`` is a stored tensor that varies only along
the op's output channels (or not at all): ConvNeXt's and CaiT/DeiT-III's layer scale
(``layer_scale * block(x)``, ``x * self.gamma``), a fixed per-channel gain. With the
scale as a vector ``s_c`` over output channels::

    W' = W * s_c   (along the output-channel axis)      b' = b * s_c

The multiply disappears: one pass over the activation less, and under
``precision="bf16"`` the op's low-precision output no longer meets an fp32 parameter,
so the casts to and from fp32 around it go too. The result differs from the original
by floating-point rounding only. Each fold is recorded as a
`graphopt.checkpoint.FoldedScale`, so an original checkpoint loads into the optimized
module (``OptimizedModule.load_original_state_dict``).

Preconditions, each a recorded skip reason when it fails:
- the scale is a stored floating-point tensor of the op's weight dtype and device;
- it varies only along the dimension that holds the op's output channels after the
  permutes, and does not broadcast the product to a larger shape;
- the op's output (and each permute's) is read only by the next node of the pattern;
- conv (not transposed) or linear, with stored, unshared weights.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt.checkpoint import FoldedScale
from graphopt.ops import ParameterUsage, WeightedOpView, arithmetic_operands, get_attr, permute_dims, weighted_op_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport, describe

def _scaled_op(gm: fx.GraphModule, value: fx.Node) -> tuple[WeightedOpView, list[fx.Node], list[list[int]]] | None:
    """The conv/linear whose output reaches ``value`` through permutes only, the permute nodes and their dims; else None."""
    permutes: list[fx.Node] = []
    permutations: list[list[int]] = []
    node = value
    while (dims := permute_dims(node)) is not None and isinstance(node.args[0], fx.Node):
        permutes.insert(0, node)
        permutations.insert(0, dims)
        node = node.args[0]
    view = weighted_op_view(gm, node)
    return (view, permutes, permutations) if view is not None else None


def _channel_dim(view: WeightedOpView, permutations: list[list[int]]) -> int | None:
    """Where the op's output channels are after the permutes, counted from the end (None when unknown)."""
    if view.kind == "linear":
        rank, dim = None, -1
    else:
        rank, dim = view.spatial_dims + 2, 1
    for dims in permutations:
        if rank is not None and len(dims) != rank:
            return None
        rank = len(dims)
        dim = dims.index(dim % rank)
    return dim - rank if rank is not None else dim


def _scale_vector(scale: torch.Tensor, channel_dim: int, channels: int) -> torch.Tensor | None:
    """``scale`` as a vector over the output channels when it varies along ``channel_dim`` only, else None."""
    if scale.dim() == 0:
        return scale.expand(channels)
    if -channel_dim > scale.dim():
        return None if scale.numel() != 1 else scale.reshape(()).expand(channels)
    others = [size for i, size in enumerate(scale.shape) if i != scale.dim() + channel_dim]
    if any(size != 1 for size in others) or scale.shape[channel_dim] not in (1, channels):
        return None
    return scale.reshape(-1).expand(channels)


def _plan(
    gm: fx.GraphModule, mul: fx.Node, scale_node: fx.Node, found: tuple[WeightedOpView, list[fx.Node], list[list[int]]], usage: ParameterUsage
) -> str | tuple[WeightedOpView, torch.Tensor]:
    """Why ``mul`` cannot be folded into the op ``found`` (see `_scaled_op`), or that op with the scale as a vector over its output channels."""
    view, permutes, permutations = found
    chain = [view.node, *permutes]
    for node, reader in zip(chain, [*chain[1:], mul]):
        if list(node.users) != [reader]:
            return f"{describe(node)} is also read elsewhere: its unscaled value is needed"
    if view.unsupported is not None:
        return view.unsupported
    if view.transposed:
        return "transposed convolution: not folded"
    if view.weight is None or view.weight_target is None:
        return "the weight is computed in the graph, not stored"
    sharing = usage.sharing(view)
    if sharing is not None:
        return sharing
    scale = get_attr(gm, str(scale_node.target))
    if usage.reads(str(scale_node.target)) > 1 or usage.is_shared(scale):
        return f"the scale {scale_node.target} is also read elsewhere"
    if not isinstance(scale, torch.Tensor) or scale.dtype != view.weight.dtype or scale.device != view.weight.device:
        return f"the scale is not a stored {view.weight.dtype} tensor on {view.weight.device}"
    channel_dim = _channel_dim(view, permutations)
    channels = view.weight.shape[0]
    vector = None if channel_dim is None else _scale_vector(scale, channel_dim, channels)
    if vector is None:
        return f"the scale (shape {tuple(scale.shape)}) varies along more than the {channels} output channels"
    return view, vector


def fold_channel_scale(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Fold stored per-channel scales of conv/linear outputs into the weights."""
    report = PassReport("fold_channel_scale")
    usage = ParameterUsage(gm)
    dropped: list[str] = []
    for mul in list(gm.graph.nodes):
        operands = arithmetic_operands(gm, mul, "mul")
        if operands is None or not all(isinstance(arg, fx.Node) for arg in operands):
            continue
        stored = [arg for arg in operands if arg.op == "get_attr"]
        if len(stored) != 1:
            continue
        scale_node = stored[0]
        value = operands[1] if operands[0] is scale_node else operands[0]
        found = _scaled_op(gm, value)
        if found is None:
            continue  # not a scaled conv/linear output
        plan = _plan(gm, mul, scale_node, found, usage)
        if isinstance(plan, str):
            report.skip(mul, plan)
            continue
        view, vector = plan
        assert view.weight is not None and view.weight_target is not None
        scale = get_attr(gm, str(scale_node.target))
        own_bias = view.bias_target
        view.set_weight(gm, view.weight * vector.reshape(-1, *[1] * (view.weight.dim() - 1)))
        if view.bias is not None:
            view.set_bias(gm, view.bias * vector)
        report.state_changes.append(FoldedScale(weight=view.weight_target, bias=own_bias, scale=str(scale_node.target), shape=tuple(scale.shape)))
        report.rewrite(view.node, f"folded {describe(mul)} (scale {scale_node.target}, shape {tuple(scale.shape)}) into the {view.kind}")
        mul.replace_all_uses_with(value)
        gm.graph.erase_node(mul)
        dropped.append(str(scale_node.target))
    return finish(gm, bool(report.rewrites), report, dict.fromkeys(dropped))

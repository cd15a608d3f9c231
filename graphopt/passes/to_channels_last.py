"""to_channels_last: run convolutions in channels_last (NHWC) with as few layout conversions as possible.

oneDNN and cuDNN pick faster convolution kernels for channels_last tensors, and PyTorch
keeps that layout through layout-agnostic ops (pointwise ops, BatchNorm, pooling,
padding, concatenation, residual adds, interpolation). The pass:

1. converts the weights of 2-D (and 3-D: ``channels_last_3d``) convolutions once, at
   optimize time, to the strides their gradients will have (``param.data`` is replaced,
   as ``Module.to(memory_format=...)`` does, so tied parameters stay tied), also when
   a conv reads its weight through a dtype cast (mixed-precision training);
2. runs the graph on the example inputs, following the real layout of every value, and
   inserts ``x.contiguous(memory_format=channels_last)`` only where a conv would
   receive another layout (typically once, on the graph input); the value's other
   readers (a residual add of the input, say) take the converted value too, except
   reshapes and outputs;
3. inserts ``x.contiguous()`` only before ops that need the NCHW order: ``view``,
   ``reshape`` and ``flatten`` over channel and spatial dims (``view`` would fail,
   the others copy silently), and before each output that would otherwise leave the
   model in channels_last (unless ``keep_channels_last_outputs``).

A graph with an active element-wise dropout of a 4-D/5-D tensor (training) is left as it
is: dropout draws its mask in memory order, so in channels_last the same seed would drop
other elements than the original did, as random but not the same result.

A ``(N, C, 1, 1)`` tensor is both contiguous and channels_last, so the usual
pool -> flatten -> linear head needs no conversion: a ResNet needs one conversion in
and none out. The report counts the conversions and lists the 4-D/5-D ops left in
NCHW with the reason. Whether channels_last pays depends on the model and the
hardware: with ``memory_format="auto"`` the pipeline keeps this pass only if the
rewritten graph measures faster on the example inputs. On CPU the first planning run
also times the convolutions: when they take too small a share of it for the graph to
reach that gain even at no cost (a ViT's patch embedding), the pass leaves the graph
as it is and the pipeline does not time it. The plan takes two runs of the graph in
all (plan, then confirm on the rewritten graph); the outputs and the report read the
layouts the last one recorded.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

from graphopt.ops import (
    Recorder, WeightedOpView, dropout_view, get_attr, insert_reader, is_permute, is_reshape, layout_of, tensor_meta, weighted_op_view,
)
from graphopt.passes import base
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport, describe

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}
CONVERSION = "graphopt_layout_conversion"  # node.meta key marking the conversions this pass inserts


class _LayoutPlanner(Recorder):
    """Runs the graph, records each value's layout, and plans the conversions convs and reshapes need.

    A planned conversion is simulated for the consuming op only, exactly as the rewrite
    will feed it, so one run sees the layouts of the rewritten graph.
    """

    def __init__(self, gm: fx.GraphModule, conv_ranks: dict[fx.Node, int]) -> None:
        super().__init__(gm)
        self.conv_ranks = conv_ranks
        self.to_channels_last: dict[fx.Node, list[fx.Node]] = {}  # value -> convs reading it
        self.to_contiguous: dict[fx.Node, list[fx.Node]] = {}  # value -> reshapes reading it
        self.conv_seconds = 0.0  # time the convs took in the run (CPU: ops return when done)

    def run_node(self, n: fx.Node) -> Any:
        source = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        value = self.env.get(source) if source is not None else None
        converted = None
        if isinstance(value, torch.Tensor) and value.dim() in _CHANNELS_LAST:
            if n in self.conv_ranks and value.dim() == self.conv_ranks[n] and layout_of(value) not in ("channels_last", "any"):
                converted = value.contiguous(memory_format=_CHANNELS_LAST[value.dim()])
                self.to_channels_last.setdefault(source, []).append(n)
            elif is_reshape(self.module, n) and not value.is_contiguous():
                converted = value.contiguous()
                self.to_contiguous.setdefault(source, []).append(n)
        if converted is not None:
            assert source is not None
            self.env[source] = converted
        started = time.perf_counter()
        try:
            result = super().run_node(n)
        finally:
            if converted is not None:
                self.env[source] = value
        if n in self.conv_ranks:
            self.conv_seconds += time.perf_counter() - started
        if isinstance(result, torch.Tensor):
            n.meta["tensor_meta"] = _extract_tensor_metadata(result)
            n.meta["graphopt_layout"] = layout_of(result)
        return result


def _plan(gm: fx.GraphModule, args: tuple[Any, ...], conv_ranks: dict[fx.Node, int]) -> tuple[_LayoutPlanner, float]:
    """The planner after one run of ``gm`` on ``args``, and the run's seconds."""
    planner = _LayoutPlanner(gm, conv_ranks)
    started = time.perf_counter()
    planner.run_on(args)
    return planner, time.perf_counter() - started


def _cannot_pay(planner: _LayoutPlanner, run_seconds: float) -> str | None:
    """Why channels_last cannot make the graph `MIN_MEASURED_GAIN` faster, from the first planning run (on CPU).

    The convolutions are what channels_last speeds up; when they take so small a share of
    the run that the graph would not reach that gain even if they took no time at all,
    timing the rewritten graph (several runs) cannot keep it.
    """
    share = planner.conv_seconds / max(run_seconds, 1e-9)
    if share >= 1 - 1 / base.MIN_MEASURED_GAIN:
        return None
    return (
        f"convolutions take {share:.1%} of a run on the example inputs: channels_last could not make the graph "
        f"{base.MIN_MEASURED_GAIN:.2f}x faster even if they took no time, so it is left out without timing"
    )


def _insert_conversion(gm: fx.GraphModule, value: fx.Node, users: list[fx.Node], memory_format: torch.memory_format | None) -> fx.Node:
    """``value.contiguous(memory_format=...)`` right after ``value``, read by ``users`` instead of it."""
    kwargs = {"memory_format": memory_format} if memory_format is not None else {}
    return insert_reader(gm, value, "contiguous", (), kwargs, users, CONVERSION)


def _cast_stored_weight(gm: fx.GraphModule, conv: WeightedOpView) -> torch.Tensor | None:
    """The stored weight a conv reads through a dtype cast (``use_low_precision`` in training), else None.

    ``.to(dtype)`` keeps the strides of a dense tensor, so storing the weight in
    channels_last makes the cast one channels_last too, with no conversion per call.
    """
    cast = conv.arguments.get("weight") if conv.arguments is not None else None
    if not (isinstance(cast, fx.Node) and cast.op == "call_method" and cast.target == "to" and isinstance(cast.args[0], fx.Node)):
        return None
    source = cast.args[0]
    if source.op != "get_attr" or len(cast.args) != 2 or not isinstance(cast.args[1], torch.dtype) or cast.kwargs:
        return None
    value = get_attr(gm, str(source.target))
    return value if isinstance(value, torch.Tensor) and value.dim() == conv.spatial_dims + 2 else None


def _draws_in_memory_order(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is an active element-wise dropout of a tensor that could be in channels_last.

    A per-channel dropout draws a (N, C, 1, 1) mask, the same in any layout.
    """
    dropout = dropout_view(gm, node)
    if dropout is None or not dropout.active or not dropout.per_element:
        return False
    meta = tensor_meta(dropout.input) if isinstance(dropout.input, fx.Node) else None
    return meta is None or len(meta[0]) in _CHANNELS_LAST


def to_channels_last(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Run 2-D/3-D convolutions in channels_last, converting layouts only where an op needs it."""
    report = PassReport("to_channels_last")
    random_order = [node for node in gm.graph.nodes if _draws_in_memory_order(gm, node)]
    if random_order:
        for node in random_order:
            unknown = dropout_view(gm, node).unsupported  # type: ignore[union-attr]
            report.skip(
                node,
                "active dropout of a 4-D/5-D tensor draws its mask in memory order: in channels_last the same seed "
                "would drop other elements than the original, which no check can tell from a wrong result"
                + (f" (read as active: {unknown})" if unknown else ""),
            )
        return finish(gm, False, report)
    conv_ranks: dict[fx.Node, int] = {}
    stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its data before the pass)
    for node in gm.graph.nodes:
        conv = weighted_op_view(gm, node)
        if conv is None or conv.spatial_dims not in (2, 3):
            continue
        conv_ranks[node] = conv.spatial_dims + 2
        weight = conv.weight if conv.weight is not None else _cast_stored_weight(gm, conv)
        if weight is None:
            report.skip(node, "weight computed in the graph: converted on every call, not once")
        elif id(weight) not in stored:
            stored[id(weight)] = (weight, weight.data)
            # clone, not contiguous(): a 1x1 kernel is already "channels_last" with NCHW strides,
            # but its gradients come back with channels_last strides, and DDP warns on the mismatch
            weight.data = weight.data.clone(memory_format=_CHANNELS_LAST[weight.dim()])
    if not conv_ranks:
        report.notes.append("no 2-D or 3-D convolutions: nothing to gain from channels_last")
        return finish(gm, False, report)

    to_channels_last = to_contiguous = 0
    for round_number in range(len(conv_ranks) + 1):  # every round settles at least one value; the last finds nothing
        planner, run_seconds = _plan(gm, ctx.example_inputs, conv_ranks)
        reason = _cannot_pay(planner, run_seconds) if round_number == 0 and ctx.measure and ctx.device.type == "cpu" else None
        if reason is not None:
            for weight, data in stored.values():
                weight.data = data
            report.notes.append(reason)
            return finish(gm, False, report)
        if not planner.to_channels_last and not planner.to_contiguous:
            break  # the last run saw the rewritten graph: its layouts are in every node's meta
        for value, convs in planner.to_channels_last.items():
            # every reader but reshapes and outputs takes the converted value, so layout-agnostic
            # ops beside the conv (a residual add of the input) stay in channels_last too
            readers = [u for u in value.users if u.op != "output" and not is_reshape(gm, u) and not u.meta.get(CONVERSION)]
            conversion = _insert_conversion(gm, value, readers, _CHANNELS_LAST[conv_ranks[convs[0]]])
            report.rewrite(conversion, f"{value.name} to channels_last for {', '.join(describe(u) for u in readers)}")
            to_channels_last += 1
        for value, reshapes in planner.to_contiguous.items():
            conversion = _insert_conversion(gm, value, reshapes, None)
            report.rewrite(conversion, f"{value.name} back to contiguous for {', '.join(describe(u) for u in reshapes)} (needs NCHW order)")
            to_contiguous += 1
    else:
        _plan(gm, ctx.example_inputs, conv_ranks)  # the layouts of the rewritten graph, for the outputs and the report
    report.notes.append(f"{len(stored)} conv weights stored in channels_last")
    outputs_converted = 0 if ctx.keep_channels_last_outputs else _restore_output_layouts(gm, report)
    report.notes.append(
        f"layout conversions: {to_channels_last} to channels_last, "
        f"{to_contiguous} back to contiguous inside, {outputs_converted} on outputs"
    )
    _report_nchw_ops(gm, conv_ranks, report)
    return finish(gm, True, report)


def _restore_output_layouts(gm: fx.GraphModule, report: PassReport) -> int:
    """Give channels_last outputs back their contiguous layout (from the last planning run); return how many needed it."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    leaves = [leaf for leaf in pytree.tree_leaves(output.args) if isinstance(leaf, fx.Node)]
    converted = 0
    for leaf in dict.fromkeys(leaves):
        if leaf.meta.get("graphopt_layout") == "channels_last":
            conversion = _insert_conversion(gm, leaf, [output], None)
            report.rewrite(conversion, f"{leaf.name} back to contiguous for the model's output")
            converted += 1
    return converted


def _report_nchw_ops(gm: fx.GraphModule, conv_ranks: dict[fx.Node, int], report: PassReport) -> None:
    """Record the ops of the rewritten graph that leave channels_last, and why (layouts from the last planning run,
    which the output conversions do not change).

    Permutes are not listed: a permuted channels_last tensor is a contiguous NHWC one
    (ConvNeXt's LayerNorm runs on it without a copy).
    """
    for node in gm.graph.nodes:
        if node.meta.get(CONVERSION) or node.op not in ("call_function", "call_method", "call_module"):
            continue
        input_layouts = {arg.meta.get("graphopt_layout") for arg in node.all_input_nodes}
        if node in conv_ranks and input_layouts.isdisjoint({"channels_last", "any"}):
            report.skip(node, "conv input is not channels_last")
        elif (
            node.meta.get("graphopt_layout") in ("contiguous", "strided")
            and "channels_last" in input_layouts
            and not is_permute(gm, node)
        ):
            report.skip(node, "returns NCHW from a channels_last input (mixed layouts, or no NHWC kernel): a silent copy")

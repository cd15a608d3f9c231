"""extract_pointwise_regions: gather connected elementwise ops into submodules for a fusion backend.

Pattern: maximal connected regions of pointwise ops (activations, arithmetic, bias adds,
layer scales, dtype casts: `graphopt.ops.pointwise_view`) in any graph form. A region is
not only a chain: it may have several inputs (``relu(x + identity)``), branch and join
(``x * sigmoid(x)``), pass through views and permutes (ConvNeXt's ``x + gamma * x.permute(...)``),
and have several outputs. torch.fx's ``CapabilityBasedPartitioner``
proposes the regions and keeps each convex (no path leaves a region and comes back), and
``fuse_by_partitions`` extracts each as a ``call_module`` of a parameter-free GraphModule
named ``pointwise_region_<i>``. Stored tensors a region reads (a bias, a layer scale) stay
outside it as region inputs, so ``state_dict`` keys do not change.

Why: a pointwise op reads and writes whole tensors, so a chain of them is memory-bound;
one fused kernel reads the region's inputs once and writes its outputs once. The report
gives, per region, the bytes moved unfused (every op reads its tensor inputs and writes
its output) and fused (region inputs read once, region outputs written once). Fusing two
or more connected ops always saves at least one read of a value made inside the region,
so a region with several outputs still moves fewer bytes; no region is refused for that.

Extraction alone changes no numerics (the pass is exact); `graphopt.backends.fuse_compile`
then compiles each region with torch.compile or TorchScript.

Guards, each recorded as a skip on the op:
- a lone pointwise op between non-pointwise ops: nothing to fuse it with;
- an in-place op whose input is read again afterwards, or is a graph input or a stored
  tensor: the write is visible outside, so the op stays as it is. In-place ops whose input
  nothing else reads are computed out of place inside the region (the same values);
- an op that does not produce a floating-point tensor (e.g. ``operator.mul`` on sizes).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.shape_prop import ShapeProp
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from graphopt import verify
from graphopt.ops import (
    PointwiseView,
    interpreter_inputs,
    is_permute,
    is_reshape,
    pointwise_view,
    tensor_meta,
)
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport, target_name

REGION_PREFIX = "pointwise_region_"


class _PointwiseSupport(OperatorSupportBase):
    """Which nodes may join a region; the reason for each pointwise op that may not."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.views: dict[fx.Node, PointwiseView] = {}
        self.layout: set[fx.Node] = set()  # views and permutes: free inside a region, not worth one on their own
        self.refused: dict[fx.Node, str] = {}

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: fx.Node) -> bool:
        if node.op != "call_module" and (is_reshape(self.gm, node) or is_permute(self.gm, node)):
            if tensor_meta(node) is None:
                return False
            self.layout.add(node)
            return True
        view = pointwise_view(self.gm, node)
        if view is None:
            return False
        meta = tensor_meta(node)
        if meta is None or not meta[1].is_floating_point:
            self.refused[node] = "does not compute a floating-point tensor"
            return False
        if view.in_place:
            written = node.args[0] if node.args else None
            if view.form == "aten" or not isinstance(written, fx.Node):
                self.refused[node] = "in-place ATen op: left as it is"
                return False
            if written.op in ("placeholder", "get_attr"):
                self.refused[node] = f"in-place op on {written.name}, a graph input or stored tensor: the write is visible outside, so it stays"
                return False
            if len(written.users) > 1:
                self.refused[node] = f"in-place op on {written.name}, which is read again: the write is visible, so it stays"
                return False
        self.views[node] = view
        return True


def _bytes(value: object) -> int:
    if not isinstance(value, fx.Node):
        return 0
    meta = tensor_meta(value)
    if meta is None:
        return 0
    shape, dtype = meta
    return shape.numel() * dtype.itemsize


def _trim(nodes: set[fx.Node], layout: set[fx.Node]) -> set[fx.Node]:
    """``nodes`` without the views/permutes at its edges (they only move work from the ops around them)."""
    nodes = set(nodes)
    while edges := {
        node
        for node in nodes & layout
        if all(arg not in nodes for arg in node.all_input_nodes) or all(user not in nodes for user in node.users)
    }:
        nodes -= edges
    return nodes


def _traffic(nodes: set[fx.Node], layout: set[fx.Node]) -> tuple[int, int]:
    """Bytes read and written by ``nodes`` run one op at a time (views are free), and as one fused region."""
    unfused = sum(_bytes(node) + sum(_bytes(arg) for arg in node.all_input_nodes) for node in nodes - layout)
    inputs = {arg for node in nodes for arg in node.all_input_nodes if arg not in nodes}
    outputs = [node for node in nodes if any(user not in nodes for user in node.users)]
    return unfused, sum(map(_bytes, inputs)) + sum(map(_bytes, outputs))


def _op_name(view: PointwiseView, gm: fx.GraphModule) -> str:
    node = view.node
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    return target_name(node.target)


def extract_pointwise_regions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Extract each maximal region of two or more connected pointwise ops as a submodule."""
    report = PassReport("extract_pointwise_regions")
    with verify.isolated(gm):
        ShapeProp(gm).propagate(*interpreter_inputs(gm, ctx.example_inputs))
    support = _PointwiseSupport(gm)
    partitions: list[Partition] = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=False).propose_partitions()
    regions = [_trim(set(partition.nodes), support.layout) for partition in partitions]
    # a lone op once the views around it are left out is no region
    kept = [(nodes, *_traffic(nodes, support.layout)) for nodes in regions if len(nodes - support.layout) >= 2]
    in_region = {node for nodes, _, _ in kept for node in nodes}
    for node in gm.graph.nodes:
        if node in support.refused:
            report.skip(node, support.refused[node])
        elif node in support.views and node not in in_region:
            report.skip(node, "a lone pointwise op between non-pointwise ops: nothing to fuse it with")
    if not kept:
        return finish(gm, False, report)
    prefix = REGION_PREFIX
    while any(name.startswith(prefix) for name in gm._modules):
        prefix = "_" + prefix  # a graph that already has regions (optimized twice)
    descriptions = []
    for nodes, unfused, fused in kept:
        ordered = [node for node in gm.graph.nodes if node in nodes]
        ops = [_op_name(support.views[node], gm) for node in ordered if node in support.views]
        for node in ordered:
            if node in support.views and (support.views[node].in_place or node.op == "call_module"):
                support.views[node].to_function(gm)  # regions hold plain functions, computed out of place
        descriptions.append(f"{len(ops)} ops ({', '.join(ops)}); about {unfused / 1e6:.2f} MB moved unfused, {fused / 1e6:.2f} MB fused")
    fuse_by_partitions(gm, [dict.fromkeys(nodes) for nodes, _, _ in kept], prefix=prefix)
    for index, description in enumerate(descriptions):
        region_node = next(node for node in gm.graph.nodes if node.op == "call_module" and node.target == f"{prefix}{index}")
        report.rewrite(region_node, f"{prefix}{index}: {description}")
    report.notes.append(f"{len(kept)} pointwise regions extracted for fusion ({len(in_region - support.layout)} ops)")
    return finish(gm, True, report)

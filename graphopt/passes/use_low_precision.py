"""use_low_precision: run compute-heavy ops in bf16/fp16 and sensitive ops in fp32, with explicit casts.

torch.fx drops ``with torch.autocast(...)`` blocks, so precision must be written into the
graph. This pass writes it as explicit ``x.to(dtype)`` casts rather than autocast
regions: the graph then says exactly what runs in which dtype (and the report and
graph diffs show it), it exports to ONNX as plain casts, an exception in forward cannot
leave autocast switched on, and inference weights can be cast once instead of per call.

Policy (override with ``optimize(..., low_precision_ops=..., fp32_ops=...)``):

| family | dtype | why |
|---|---|---|
| conv, linear, matmul, bmm, baddbmm (addmm), scaled_dot_product_attention | low precision | compute-bound: tensor cores / AMX do the work |
| softmax, log_softmax | fp32 | exp of large values and normalisation over long rows |
| instance_norm | fp32 | mean/variance statistics |
| exp, log, pow | fp32 | range and accuracy of transcendentals |
| sum, mean, norm, cumsum | fp32 | long accumulations |
| loss functions | fp32 | small differences of large values |
| batch_norm, layer_norm, group_norm | as its input | their kernels take low-precision input with fp32 parameters and keep the statistics in fp32 (fp32 where the device has no such kernel) |
| other ops reading fp32 parameters (unknown modules, layer scales) | fp32 | the parameters stay fp32 |
| everything else (pointwise, pooling, reshapes) | as its inputs | mixed inputs promote to fp32 |
| ops with no low-precision kernel on the device (avg_pool3d in bf16 on CPU) | fp32 | found when planning |

Casts are planned by running the graph on the example inputs with the planned casts
applied, so every cast is needed and none is missing; each value is cast once per dtype
however many ops read it. Module calls of conv/linear become their functional form so
their weights are graph values (names and state_dict keys stay). Inference: weights
read only by low-precision ops are stored in the low dtype once (the fp32 values stay
available from ``OptimizedModule.fp32_weights()``). Training: parameters stay fp32 and
are cast per call, so gradients and optimizer state are fp32 (autocast semantics).
Outputs are cast back to the dtype the model returned.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from graphopt.ops import Recorder, batch_norm_view, get_attr, insert_reader, precision_family, record, replace_tensor, weighted_op_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport, describe

DEFAULT_LOW_PRECISION_OPS = frozenset({"conv", "linear", "matmul", "bmm", "baddbmm", "scaled_dot_product_attention"})
DEFAULT_FP32_OPS = frozenset(
    {"softmax", "log_softmax", "instance_norm", "exp", "log", "pow", "sum", "mean", "norm", "cumsum", "loss"}
)
# normalizations whose kernels read low-precision input with fp32 parameters, statistics in fp32 (batch_norm via its view)
_MIXED_NORMS = frozenset({"layer_norm", "group_norm"})
CAST = "graphopt_cast"  # node.meta key marking the casts this pass inserts
_LOW = (torch.bfloat16, torch.float16)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _mixed_norm(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A normalization whose kernel takes low-precision input with fp32 parameters and statistics."""
    return batch_norm_view(gm, node) is not None or precision_family(gm, node) in _MIXED_NORMS


def _reads_fp32_parameters(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A module with fp32 parameters, or an op fed a stored fp32 tensor: low-precision inputs would not match."""
    if node.op == "call_module":
        return any(p.dtype == torch.float32 for p in gm.get_submodule(str(node.target)).parameters())
    return any(arg.op == "get_attr" and _floating(get_attr(gm, str(arg.target))) and get_attr(gm, str(arg.target)).dtype == torch.float32 for arg in node.all_input_nodes)


class _PrecisionPlanner(Recorder):
    """Runs the graph with planned casts applied to each op's inputs, records dtypes, FLOPs and casts."""

    def __init__(self, gm: fx.GraphModule, wanted: dict[fx.Node, torch.dtype], low: torch.dtype) -> None:
        super().__init__(gm)
        self.wanted, self.low = wanted, low
        self.casts: dict[tuple[fx.Node, torch.dtype], list[fx.Node]] = {}
        self.flops = {"low": 0.0, "fp32": 0.0}

    def run_node(self, n: fx.Node) -> Any:
        wanted = self.wanted.get(n)
        reads_low = any(_floating(self.env.get(a)) and self.env[a].dtype == self.low for a in n.all_input_nodes)
        computes = n.op in ("call_module", "call_function", "call_method") and not n.meta.get(CAST)
        # normalization kernels take low-precision input with fp32 statistics and parameters
        if wanted is None and computes and reads_low and not _mixed_norm(self.module, n) and _reads_fp32_parameters(self.module, n):
            wanted = torch.float32
        try:
            result = self._run_with(n, wanted)
        except (NotImplementedError, RuntimeError):
            if not (wanted is None and computes and reads_low):
                raise
            # no low-precision kernel for this op on this device (e.g. avg_pool3d in bf16 on CPU): fp32 it is
            result = self._run_with(n, torch.float32)
        self._count_flops(n, result)
        if isinstance(result, torch.Tensor):
            n.meta["graphopt_dtype"] = result.dtype
        return result

    def _run_with(self, n: fx.Node, wanted: torch.dtype | None) -> Any:
        """Run ``n`` with its floating inputs cast to ``wanted`` (planning those casts), or as they are."""
        saved: dict[fx.Node, Any] = {}
        planned: list[tuple[fx.Node, torch.dtype]] = []
        if wanted is not None:
            for arg in n.all_input_nodes:
                value = self.env.get(arg)
                if not _floating(value) or value.dtype == wanted:
                    continue
                if wanted == torch.float32 and value.dtype not in _LOW:
                    continue  # fp32 ops only lift low-precision inputs (fp64 stays fp64)
                saved[arg] = value
                self.env[arg] = value.to(wanted)
                planned.append((arg, wanted))
        try:
            result = super().run_node(n)
        finally:
            self.env.update(saved)
        for key in planned:  # only once the op ran with them
            self.casts.setdefault(key, []).append(n)
        return result

    def _count_flops(self, n: fx.Node, result: Any) -> None:
        family = precision_family(self.module, n)
        if family is None or not isinstance(result, torch.Tensor):
            return
        operands = [self.env[a] for a in n.all_input_nodes if isinstance(self.env.get(a), torch.Tensor)]
        if family in ("conv", "linear") and len(operands) >= 2:
            view = weighted_op_view(self.module, n)
            weight = operands[1]
            if view is not None and view.transposed:
                flops = 2.0 * operands[0].numel() * weight[0].numel()
            elif family == "conv":
                flops = 2.0 * result.numel() * weight[0].numel()
            else:
                flops = 2.0 * result.numel() * weight.shape[-1]
        elif family in ("matmul", "bmm", "baddbmm") and operands:
            flops = 2.0 * result.numel() * operands[-2 if family == "baddbmm" else 0].shape[-1]
        elif family == "scaled_dot_product_attention" and len(operands) >= 3:
            query, key = operands[0], operands[1]
            flops = 4.0 * query.numel() * key.shape[-2]
        else:
            return
        self.flops["low" if result.dtype in _LOW else "fp32"] += flops


def use_low_precision(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Cast compute-heavy ops to ``ctx.precision``, keep sensitive ops in fp32, restore output dtypes."""
    report = PassReport("use_low_precision")
    low = ctx.precision
    assert low is not None, "use_low_precision needs optimize(..., precision='bf16' or 'fp16')"
    original_outputs = [leaf.dtype if _floating(leaf) else None for leaf in pytree.tree_leaves(record(gm, ctx.example_inputs))]

    wanted: dict[fx.Node, torch.dtype] = {}
    for node in list(gm.graph.nodes):
        family = precision_family(gm, node)
        if family in ctx.low_precision_ops:
            view = weighted_op_view(gm, node)
            if view is not None and view.unsupported:
                report.skip(node, f"{view.unsupported}: kept in fp32")
                continue
            if view is not None and view.module is not None:
                view.to_function(gm)
                node = view.node
            wanted[node] = low
        elif family in ctx.fp32_ops:
            wanted[node] = torch.float32
    if not any(dtype == low for dtype in wanted.values()):
        report.notes.append("no op of the low-precision families: nothing to gain")
        return finish(gm, False, report)
    if ctx.mode == "inference":
        _store_weights_in_low_precision(gm, wanted, low, report)

    planner = _PrecisionPlanner(gm, wanted, low)
    planner.run_on(ctx.example_inputs)
    for (value, dtype), readers in planner.casts.items():
        cast = insert_reader(gm, value, "to", (dtype,), {}, readers, CAST)
        direction = "to fp32 for" if dtype == torch.float32 else f"to {str(low).removeprefix('torch.')} for"
        report.rewrite(cast, f"{value.name} {direction} {', '.join(describe(r) for r in readers)}")
    _restore_output_dtypes(gm, ctx.example_inputs, original_outputs, report)

    low_ops = sum(1 for dtype in wanted.values() if dtype == low)
    total = planner.flops["low"] + planner.flops["fp32"]
    share = 100.0 * planner.flops["low"] / total if total else 0.0
    report.notes.append(
        f"{low_ops} ops in {str(low).removeprefix('torch.')}, {len(wanted) - low_ops} kept in fp32 by policy, "
        f"{len(planner.casts)} casts; {share:.1f}% of conv/linear/matmul FLOPs in low precision"
    )
    return finish(gm, True, report)


def _store_weights_in_low_precision(gm: fx.GraphModule, wanted: dict[fx.Node, torch.dtype], low: torch.dtype, report: PassReport) -> None:
    """Inference: store each weight read only by low-precision ops in ``low`` once, keeping the fp32 value aside."""
    fp32_weights: dict[str, torch.Tensor] = gm.meta.setdefault("graphopt_fp32_weights", {})
    readers: dict[str, set[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            readers.setdefault(str(node.target), set()).update(node.users)
    for target, users in readers.items():
        value = get_attr(gm, target)
        if not _floating(value) or value.dtype != torch.float32 or not users or any(wanted.get(u) != low for u in users):
            continue
        fp32_weights[target] = value.detach().clone()
        replace_tensor(gm, target, value.to(low))
    report.notes.append(f"{len(fp32_weights)} weights stored in {str(low).removeprefix('torch.')} once (fp32 values kept aside)")


def _restore_output_dtypes(gm: fx.GraphModule, args: tuple[Any, ...], original: list[torch.dtype | None], report: PassReport) -> None:
    """Cast each output back to the dtype the model returned."""
    outputs = pytree.tree_leaves(record(gm, args))
    output = next(node for node in gm.graph.nodes if node.op == "output")
    done: set[fx.Node] = set()
    for leaf, value, dtype in zip(pytree.tree_leaves(output.args), outputs, original, strict=True):
        if isinstance(leaf, fx.Node) and leaf not in done and dtype is not None and _floating(value) and value.dtype != dtype:
            done.add(leaf)
            cast = insert_reader(gm, leaf, "to", (dtype,), {}, [output], CAST)
            report.rewrite(cast, f"{leaf.name} back to {str(dtype).removeprefix('torch.')} for the model's output")

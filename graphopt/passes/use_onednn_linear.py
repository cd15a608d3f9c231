"""use_onednn_linear: run large linears (+ activation, or + residual add) as oneDNN fused kernels on their own weights.

Patterns (CPU inference, float32 or bfloat16)::

    linear(x, W, b) [-> act]          -> mkldnn._linear_pointwise(x, W, b, act)
    linear(x, W, b) -> add(., other)  -> graphopt.linear_add(x, other, W, b)  (mkldnn._linear_pointwise.binary)

``act``: the activations `use_onednn_kernels` fuses (GELU, ReLU, SiLU, ...). ATen runs a
linear as an MKL GEMM, then the bias is added in it, then GELU or the residual add runs
as a separate pass over the output; oneDNN computes the GEMM and applies bias, activation
or add while the output is still in cache. Which GEMM is faster depends on the CPU and the
shapes (Intel's own extension for PyTorch kept MKL for float32 linears by default), so each
distinct linear (input and weight shapes, fused op) is timed on the example values, the
ATen ops against the fused kernel, in paired rounds (`graphopt.timing.compare_latency`, at
most about half a second each; where the graph's stored tensors exceed the CPU's caches, as a
language model's do, over enough copies of the weight to exceed them: at few rows the kernels
then stream the weight from memory, and the faster one in cache is often the slower one there),
and the kernel is used unless it is clearly slower (a
difference within the measurement noise keeps the pass's choice, so that runs on a loaded machine
agree); the report gives the figures. On BERT-base (batch 8, sequence 128, AMD EPYC Zen 2, 2 threads) the default
preset ran 1.02-1.09x faster than eager with it, 1.00-1.01x without (docs/benchmarks.md).
Results differ from ATen's by float32 rounding.

Unlike `use_onednn_kernels` (opt-in), nothing is prepacked: the kernel reads the model's
own weight and bias (``get_attr``), so ``parameters()``, ``state_dict()``, copies, tied
weights, torch.export and optimizing the result again see the model's tensors unchanged.
Prepacking gains a little more on top; when both passes run, `use_onednn_kernels` runs
first and takes the linears.

Preconditions, each a recorded skip reason:
- inference mode; oneDNN available and enabled; the weight a stored CPU tensor, float32
  or bfloat16 (bfloat16 needs oneDNN bf16 support on this CPU);
- at least ``MIN_WEIGHT_ELEMENTS`` weight elements (e.g. 768x768): oneDNN's per-call
  overhead makes small linears slower (measured 0.1-0.5x for 32x64 to 256x256 weights);
- on the example inputs the fused op returns the dtype, shape and layout of the ops it
  replaces within the dtype's tolerance; an activation or add that does not is left out
  of the fusion and the report says why;
- the fused kernel is not clearly slower than ATen's ops on the example values (else, with an
  activation or add, the linear alone is timed the same way).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from graphopt import timing
from graphopt.ops import WeightedOpView
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.passes.use_onednn_kernels import Fusion, describe_fusion, kernel_guard, plan_fusions, report_left_out, settle_fusions
from graphopt.runtime.onednn import PostOp, aten_post_op, fused_linear_add
from graphopt.report import PassReport

MIN_WEIGHT_ELEMENTS = 2**19
MEASURE_BUDGET_S = 0.5  # per distinct linear
# more stored tensors than a CPU's caches hold: a linear's weight is read from memory at every call, and is timed so
CACHE_BYTES = 64 * 2**20

LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
LINEAR_ADD = torch.ops.graphopt.linear_add.default

# The timer is a module attribute so that tests can replace it with a deterministic one.
compare_latency: Callable[..., timing.Comparison] = timing.compare_latency


@dataclass(frozen=True)
class _Linear:
    """The kernel a fusion becomes, as a callable for the trial on the example inputs."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    post_op: PostOp
    binary: bool

    def __call__(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        if other is not None:
            return fused_linear_add(x, other, self.weight, self.bias)
        attr, scalars, algorithm = self.post_op
        return LINEAR_POINTWISE(x, self.weight, self.bias, attr, list(scalars), algorithm)

    def aten(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        """The same with ATen's ops, as the graph ran it."""
        y = F.linear(x, self.weight, self.bias)
        if other is not None:
            return y + other
        if self.post_op.attr == "none":
            return y
        function, args, kwargs = aten_post_op(*self.post_op)
        return function(y, *args, **kwargs)

    def key(self, x: torch.Tensor) -> tuple[Any, ...]:
        return (tuple(x.shape), x.dtype, tuple(self.weight.shape), self.bias is not None, self.post_op, self.binary)


def _build(fusion: Fusion, length: int, x: torch.Tensor) -> _Linear:
    assert fusion.view.weight is not None
    binary = length >= 2 and fusion.other is not None
    post_op = fusion.post_op if length == len(fusion.nodes) else PostOp()
    return _Linear(fusion.view.weight, fusion.view.bias, post_op, binary)


def _guard(view: WeightedOpView, ctx: PassContext) -> str | None:
    """Why ``view`` stays an ATen linear, or None."""
    reason = kernel_guard(view, ctx)
    if reason is not None:
        return reason
    assert view.weight is not None
    if view.weight.numel() < MIN_WEIGHT_ELEMENTS:
        shape = "x".join(map(str, view.weight.shape))
        return f"{shape} weight: under {MIN_WEIGHT_ELEMENTS} elements oneDNN's per-call overhead outweighs its gain"
    return None


def _describe(kernel: _Linear, x: torch.Tensor) -> str:
    rows = x.numel() // x.shape[-1]
    fused = "+ add" if kernel.binary else "" if kernel.post_op.attr == "none" else f"+ {kernel.post_op.attr}"
    return " ".join(filter(None, ["x".join(map(str, kernel.weight.shape)), "linear", fused, f"at {rows} rows"]))


def _figures(kernel: _Linear, x: torch.Tensor, measured: timing.Comparison) -> str:
    """One linear's timing for the report: a measurement that is not clear says so, and one within the noise says the kernel stays."""
    figures = f"{_describe(kernel, x)}: oneDNN {measured.ratio:.2f}x ATen's speed"
    if measured.verdict != "clear":
        figures += f" ({measured.verdict}: {measured.describe()})"
    if not measured.settled:
        figures += ", kept (within the measurement noise: the pass's choice stands unless oneDNN is clearly slower)"
    return figures


class _Timings:
    """Times each distinct linear once: the fused kernel against ATen's ops, on the example values.

    Timed alone, a linear's weight stays in the CPU's caches from one call to the next. In a graph whose stored tensors
    exceed `CACHE_BYTES` (a language model's), each call reads it from memory instead, and at few rows the kernels are
    then limited by how fast they stream the weight, not by arithmetic: there each kernel is timed in turn on enough
    copies of the weight to exceed the caches."""

    def __init__(self, stored_bytes: int) -> None:
        self.measured: dict[tuple[Any, ...], timing.Comparison] = {}
        self.figures: list[str] = []
        self.from_memory = stored_bytes > CACHE_BYTES

    def refusal(self, kernel: _Linear, x: torch.Tensor, other: torch.Tensor | None) -> str | None:
        """Why ``kernel`` is not used (ATen's ops are clearly faster), or None."""
        key = kernel.key(x)
        if key not in self.measured:
            copies = -(-CACHE_BYTES // kernel.weight.nbytes) if self.from_memory else 1
            kernels = [kernel, *(dataclasses.replace(kernel, weight=kernel.weight.clone()) for _ in range(copies - 1))]
            with torch.inference_mode():
                self.measured[key] = compare_latency(
                    lambda: [each.aten(x, other) for each in kernels][-1], lambda: [each(x, other) for each in kernels][-1], budget_s=MEASURE_BUDGET_S, asks="slower"
                )
            self.figures.append(_figures(kernel, x, self.measured[key]))
        measured = self.measured[key]
        if not measured.slower:
            return None
        return f"ATen's ops are faster here ({_describe(kernel, x)}: oneDNN {measured.ratio:.2f}x their speed)"


def use_onednn_linear(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace large linear (+ add | + activation) by oneDNN fused kernels on the stored weights unless measured slower."""
    report = PassReport("use_onednn_linear")
    fusions = plan_fusions(gm, report, lambda view: _guard(view, ctx), kinds=("linear",))
    if not fusions:
        return finish(gm, False, report)
    timings = _Timings(sum(tensor.nbytes for tensor in itertools.chain(gm.parameters(), gm.buffers())))
    settle_fusions(gm, fusions, ctx.example_inputs, _build, timings.refusal)
    if timings.figures:
        report.notes.append(f"measured on the example values: {'; '.join(timings.figures)}")
    fused = 0
    for fusion in fusions:
        view, kernel = fusion.view, fusion.kernel
        if kernel is None:
            report.skip(view.node, str(fusion.reason))
            continue
        report_left_out(report, fusion)
        replaced = fusion.nodes[: fusion.length]
        end = replaced[-1]
        read = [node for node in view.node.all_input_nodes if node.op == "get_attr"]
        with gm.graph.inserting_before(end):
            weight = gm.graph.get_attr(str(view.weight_target))
            bias = gm.graph.get_attr(view.bias_target) if view.bias_target is not None else None
            if kernel.binary:
                call = gm.graph.call_function(LINEAR_ADD, (view.input, fusion.other, weight, bias))
            else:
                attr, scalars, algorithm = kernel.post_op
                call = gm.graph.call_function(LINEAR_POINTWISE, (view.input, weight, bias, attr, list(scalars), algorithm))
        call.meta.update(end.meta)
        end.replace_all_uses_with(call)
        for node in [*reversed(replaced), *read]:
            if not node.users:
                gm.graph.erase_node(node)
        report.rewrite(call, describe_fusion(fusion, "on the stored weight"))
        fused += len(replaced) > 1
    if report.rewrites:
        report.notes.append(f"{len(report.rewrites)} linear(s) run by oneDNN on their stored weights, {fused} with an activation or residual add fused")
    return finish(gm, bool(report.rewrites), report)

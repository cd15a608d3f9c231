"""quantize_int8: run convs and linears on oneDNN's int8 kernels, calibrated, each layer within the accuracy budget.

Runs with ``optimize(precision="int8", calibration=...)`` (CPU inference), after
`use_onednn_kernels`, on the `OneDNNConv` / `OneDNNLinear` modules it made (so the fused
activation and residual add come with them)::

    OneDNNConv(x[, other])    -> Int8Conv(x[, other])     onednn.qconv_pointwise, uint8 x int8 -> float32
    OneDNNLinear(x[, other])  -> Int8Linear(x[, other])   onednn.qlinear_pointwise

Static post-training quantization, the scheme oneDNN's x86 int8 kernels expect:
- weights: per output channel, symmetric int8 (`graphopt.runtime.int8.quantize_weight`);
- activations: per tensor, affine uint8, from a histogram of each layer's input over the
  ``calibration`` batches (``torch.ao.quantization.HistogramObserver``, which picks the
  range that minimizes the quantization error rather than the raw min/max). On CPUs
  without VNNI/AMX activations use 7 bits (`graphopt.runtime.int8.activation_levels`).

The accuracy budget (``ctx.accuracy``, relative to the output's scale): every layer (but
those not faster in int8, below) goes to int8 together, passing uint8 to each other
(below), and the output error is measured on the example inputs (held out from the
calibration batches unless the caller passed them there too) and on every calibration
batch. Within the budget, that is the result: no layer is measured alone (on ResNet-50
that was half of the pass's time). Over it, each layer's error is measured alone, in int8
with every other layer in float32, on the example inputs; layers whose error alone exceeds
the budget stay in float32, and while the layers left together exceed the budget, the one
with the largest error alone goes back to float32. The report says for every layer whether
it runs in int8, its error alone where measured, and why it was kept.

Speed: int8 is only worth its error where it is faster. On CPUs without int8 dot products
(no VNNI/AMX, `graphopt.runtime.int8.has_int8_dot_products`), where int8 convolutions run
about as fast as float32's, each layer within the budget alone is timed on its input from
the example inputs, int8 (its input quantized) against its float32 kernel, in paired rounds
(`graphopt.timing.compare_latency`, at most about `LAYER_TIMING_BUDGET_S` each); one not clearly
`MIN_MEASURED_GAIN` times faster (beyond the measurement noise) stays in float32, with both times in the report, before
the layers share the budget. With them the kernels are about twice as fast, and a layer
timed alone, reading and writing float32, says little about it in the graph, where int8
layers pass uint8 to each other (below). Either way, once the layers are chosen the whole
graph is timed, int8 layers against float32 (at most about `GRAPH_TIMING_BUDGET_S`): int8 stays only
if the graph is clearly `MIN_MEASURED_GAIN` times faster, and the report gives both times (and says
when the measurement was close or disturbed by other processes' load).

A conv's residual add (then a ReLU, or nothing) runs in its int8 kernel (oneDNN's sum
post-op, accumulating into the other operand). Then an int8 layer whose every reader is an
int8 layer reading it as its input, or an int8 conv adding into it (conv -> conv, a
residual block's output -> the next block's convs), writes uint8 with their input scale:
no float tensor and no separate quantization between them. On ResNet-50 the residual
stream itself stays uint8.

Preconditions, each a recorded skip reason: float32 weights; conv2d (oneDNN's int8
conv here is 2-D); the input a finite float32 tensor on the calibration batches. A
calibration batch the model fails on raises `InvalidInputsError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import HistogramObserver

from graphopt import verify
from graphopt.errors import InvalidInputsError, error_summary
from graphopt.ops import set_attr
from graphopt.passes.base import MIN_MEASURED_GAIN, PassContext, PassResult, finish
from graphopt.report import PassReport
from graphopt.runtime.int8 import Int8Conv, Int8Linear, Int8Op, activation_levels, has_int8_dot_products
from graphopt.runtime.onednn import OneDNNConv, OneDNNLinear
from graphopt.timing import Comparison, compare_latency

LAYER_TIMING_BUDGET_S = 0.2  # seconds spent timing one layer, int8 against float32 (CPUs without int8 dot products)
GRAPH_TIMING_BUDGET_S = 2.0  # seconds spent timing the graph with its int8 layers against the float32 graph


@dataclass(eq=False)
class Layer:
    """A oneDNN conv/linear call that may run in int8."""

    node: fx.Node
    path: str
    float_module: OneDNNConv | OneDNNLinear
    observer: HistogramObserver  # of its input
    accum_observer: HistogramObserver | None  # of the tensor a conv + add adds into
    int8_module: Int8Op | None = None
    error: float | None = None  # the output's error with this layer alone in int8 (measured only when all together are over the budget)
    times: Comparison | None = None  # its float32 kernel (baseline) against its int8 one on the example
    reason: str | None = None  # why it stays in float32


def _guard(module: OneDNNConv | OneDNNLinear) -> str | None:
    if module.packed_weight.dtype != torch.float32:
        return f"{str(module.packed_weight.dtype).removeprefix('torch.')} weight: int8 quantizes float32 layers"
    if isinstance(module, OneDNNConv) and len(module.stride) != 2:
        return "conv3d: oneDNN's int8 convolution is used for conv2d only"
    return None


def _observer() -> HistogramObserver:
    return HistogramObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=activation_levels() - 1)


def _calibrate(gm: fx.GraphModule, layers: list[Layer], batches: tuple[tuple[Any, ...], ...]) -> None:
    """Feed every layer's input (and the tensor a conv + add adds into) on the calibration batches to its observers."""

    def observe(layer: Layer) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            if isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32:
                layer.observer(args[0].detach())
            if layer.accum_observer is not None and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.float32:
                layer.accum_observer(args[1].detach())

        return hook

    handles = [layer.float_module.register_forward_pre_hook(observe(layer)) for layer in layers]
    try:
        with torch.no_grad(), verify.isolated(gm):
            for index, batch in enumerate(batches):
                try:
                    gm(*batch)
                except Exception as error:
                    raise InvalidInputsError(
                        f"calibration batch {index} fails in the model ({error_summary(error)}): give batches the model accepts, like the example inputs"
                    ) from error
    finally:
        for handle in handles:
            handle.remove()


def _int8_module(layer: Layer) -> Int8Op:
    scale, zero_point = layer.observer.calculate_qparams()
    module = layer.float_module
    weight, bias = module.weight, module.bias
    if isinstance(module, OneDNNConv):
        return Int8Conv(
            weight, bias, module.padding, module.stride, module.dilation, module.groups, module.input_size,
            float(scale), int(zero_point), module.post_op, module.binary,
        )  # fmt: skip
    return Int8Linear(weight, bias, module.rows, float(scale), int(zero_point), module.post_op, module.binary)


def _error(gm: fx.GraphModule, checks: list[tuple[tuple[Any, ...], Any]]) -> float:
    """The largest output error over ``checks`` (arguments, float32 outputs), relative to each output's scale."""
    with torch.no_grad(), verify.isolated(gm):
        return max(verify.compare(expected, gm(*args)).max_error for args, expected in checks)


def _use(gm: fx.GraphModule, layer: Layer, int8: bool) -> None:
    set_attr(gm, layer.path, layer.int8_module if int8 else layer.float_module)


def _speedups(gm: fx.GraphModule, layers: list[Layer], args: tuple[Any, ...]) -> dict[Layer, Comparison]:
    """Each layer's float32 kernel against its int8 one, on its input from a run of ``args``."""
    timed: dict[Layer, Comparison] = {}

    def time_on_input(layer: Layer) -> Any:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            int8 = layer.int8_module
            assert int8 is not None
            timed[layer] = compare_latency(
                lambda: module.forward(*inputs), lambda: int8(*inputs), threshold=MIN_MEASURED_GAIN, budget_s=LAYER_TIMING_BUDGET_S, asks="faster"
            )

        return hook

    handles = [layer.float_module.register_forward_pre_hook(time_on_input(layer)) for layer in layers]
    try:
        with torch.no_grad(), verify.isolated(gm):
            gm(*args)
    finally:
        for handle in handles:
            handle.remove()
    return timed


def _graph_times(gm: fx.GraphModule, chosen: list[Layer], args: tuple[Any, ...]) -> Comparison:
    """A call of the graph on ``args`` with every chosen layer in float32 (baseline) against all of them in int8."""

    def run(int8: bool) -> None:
        for layer in chosen:
            _use(gm, layer, int8)
        gm(*args)

    try:
        with torch.no_grad(), verify.isolated(gm):
            return compare_latency(lambda: run(False), lambda: run(True), threshold=MIN_MEASURED_GAIN, budget_s=GRAPH_TIMING_BUDGET_S, asks="faster")
    finally:
        for layer in chosen:
            _use(gm, layer, True)


def _chain(chosen: list[Layer]) -> list[Layer]:
    """Let each int8 layer whose every reader is an int8 layer reading it as input, or an int8 conv adding into it,
    write uint8 for them; the ones that do.

    Its scale and zero point are the input quantization of the readers that read it as input (all the same: they
    observed the same tensor), or, read only by a conv adding into it, the range that conv observed for it; the convs
    that add into it get them as ``accum_quantization``. A conv that adds into another tensor writes uint8 only where
    that tensor is uint8 too.
    """
    by_node = {layer.node: layer for layer in chosen}
    planned: dict[Layer, tuple[tuple[float, int], list[Layer]]] = {}  # layer -> its uint8 quantization, the convs adding into it
    for layer in chosen:
        module = layer.int8_module
        assert module is not None
        if (module.binary and not module.adds_in_kernel) or module.after is not None:
            continue  # a float add or activation runs after the kernel
        readers = [by_node.get(user) for user in layer.node.users]
        if not readers or None in readers:
            continue
        as_input = [reader for reader in readers if reader.node.args[:1] == (layer.node,) and layer.node not in reader.node.args[1:]]  # type: ignore[union-attr]
        adding = [reader for reader in readers if _adds_into(reader, layer.node)]  # type: ignore[arg-type]
        if len(as_input) + len(adding) != len(readers):
            continue
        quantizations = {(reader.int8_module.input_scale, reader.int8_module.input_zero_point) for reader in as_input}  # type: ignore[union-attr]
        if not as_input and len(adding) == 1 and adding[0].accum_observer is not None:  # only added into: its own range
            scale, zero_point = adding[0].accum_observer.calculate_qparams()
            quantizations = {(float(scale), int(zero_point))}
        if len(quantizations) == 1:
            planned[layer] = (quantizations.pop(), adding)
    # a conv that adds into a float tensor writes float: its kernel adds float into float and uint8 into uint8 only
    while unplanned := [layer for layer in planned if layer.int8_module.binary and by_node.get(layer.node.args[1]) not in planned]:  # type: ignore[union-attr]
        for layer in unplanned:
            del planned[layer]
    for layer, (quantization, adding) in planned.items():
        layer.int8_module.output_quantization = quantization  # type: ignore[union-attr]
        for reader in adding:
            reader.int8_module.accum_quantization = quantization  # type: ignore[union-attr]
    return list(planned)


def _adds_into(reader: Layer, node: fx.Node) -> bool:
    """Whether ``reader`` is an int8 conv whose kernel adds its result into ``node`` (and reads ``node`` no other way)."""
    module = reader.int8_module
    return isinstance(module, Int8Conv) and module.adds_in_kernel and reader.node.args[1:] == (node,) and reader.node.args[0] is not node


def _unchain(chosen: list[Layer]) -> None:
    """Undo `_chain`: every chosen layer reads and writes float32 again."""
    for layer in chosen:
        module = layer.int8_module
        assert module is not None
        module.output_quantization = None
        if isinstance(module, Int8Conv):
            module.accum_quantization = None


def _speed(times: Comparison, what: str) -> str:
    """``1.20x <what> on the example (2.00 ms against 2.40 ms)``, flagged when the measurement was close or disturbed."""
    flag = "" if times.verdict == "clear" else f", {times.verdict}: {times.concern()}"
    return f"{times.ratio:.2f}x {what} on the example ({times.candidate_s * 1e3:.2f} ms against {times.baseline_s * 1e3:.2f} ms{flag})"


def _too_slow(times: Comparison) -> str:
    """Why int8 stays out at this speed."""
    if times.high < MIN_MEASURED_GAIN:
        return f"int8 stays only {MIN_MEASURED_GAIN:.2f}x faster or more"
    return f"int8 stays only clearly {MIN_MEASURED_GAIN:.2f}x faster or more, beyond the measurement noise; float32 is the default"


def _kind(layer: Layer) -> str:
    parts = ["conv" if isinstance(layer.float_module, OneDNNConv) else "linear", *(["add"] if layer.float_module.binary else [])]
    return " + ".join(parts + ([layer.float_module.post_op.attr] if layer.float_module.post_op.attr != "none" else []))


def quantize_int8(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Swap oneDNN conv/linear modules for int8 ones, calibrated, keeping in float32 the layers over the accuracy budget."""
    report = PassReport("quantize_int8")
    if ctx.accuracy is None or not ctx.calibration:
        report.notes.append("runs with optimize(precision='int8', calibration=...) only")
        return finish(gm, False, report)
    layers: list[Layer] = []
    for node in gm.graph.nodes:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if not isinstance(module, (OneDNNConv, OneDNNLinear)):
            continue
        reason = _guard(module)
        if reason is not None:
            report.skip(node, reason)
        else:
            layers.append(Layer(node, str(node.target), module, _observer(), _observer() if isinstance(module, OneDNNConv) and module.binary else None))
    if not layers:
        report.notes.append("no oneDNN conv/linear to quantize (use_onednn_kernels makes them: it must run before this pass)")
        return finish(gm, False, report)

    _calibrate(gm, layers, ctx.calibration)
    with torch.no_grad(), verify.isolated(gm):
        # each layer alone is measured on the example; the layers together also on the calibration batches
        checks = [(args, gm(*args)) for args in (ctx.example_inputs, *ctx.calibration)]
    for layer in layers:
        if not torch.isfinite(layer.observer.min_val):
            layer.reason = "its input was never a finite float32 tensor on the calibration batches"
        else:
            layer.int8_module = _int8_module(layer)

    # speed before the budget: a layer that does not pay in int8 should not take its share of the budget from one that does
    if not has_int8_dot_products():
        fast = [layer for layer in layers if layer.reason is None]
        for layer, times in _speedups(gm, fast, ctx.example_inputs).items():
            layer.times = times
            if not times.faster:
                layer.reason = f"int8 measured {_speed(times, 'its float32 kernel')}; {_too_slow(times)}"

    # every layer in int8 first, passing uint8 where they can: where that is within the budget, no layer is measured alone
    chosen = [layer for layer in layers if layer.reason is None]
    for layer in chosen:
        _use(gm, layer, True)
    chained = _chain(chosen)
    total = _error(gm, checks) if chosen else 0.0
    if total > ctx.accuracy:  # over: each layer's error alone says which go back to float32, the worst first
        _unchain(chosen)
        for layer in chosen:
            _use(gm, layer, False)
        for layer in chosen:
            _use(gm, layer, True)
            layer.error = _error(gm, checks[:1])
            _use(gm, layer, False)
            if layer.error > ctx.accuracy:
                layer.reason = f"alone in int8 it changes the output by {layer.error:.1e} of its scale, over accuracy={ctx.accuracy:g}"
        chosen = sorted((layer for layer in chosen if layer.reason is None), key=lambda layer: layer.error or 0.0)
        for layer in chosen:
            _use(gm, layer, True)
        chained = _chain(chosen)
        total = _error(gm, checks) if chosen else 0.0
    while chosen and total > ctx.accuracy:
        _unchain(chosen)
        worst = chosen.pop()
        _use(gm, worst, False)
        worst.reason = (
            f"alone in int8 it changes the output by {worst.error or 0.0:.1e} of its scale; with it the int8 layers together "
            f"exceeded accuracy={ctx.accuracy:g}, and it had the largest error of them"
        )
        chained = _chain(chosen)
        total = _error(gm, checks) if chosen else 0.0
    if chosen:
        graph_times = _graph_times(gm, chosen, ctx.example_inputs)
        speed = _speed(graph_times, "the float32 graph")
        if not graph_times.faster:
            _unchain(chosen)
            for layer in chosen:
                _use(gm, layer, False)
                layer.reason = f"the graph with its int8 layers measured {speed}; {_too_slow(graph_times)}"
            report.notes.append(f"int8 left out: with its {len(chosen)} int8 layers the graph measured {speed}")
            chosen, chained, total = [], [], 0.0
        else:
            report.notes.append(f"with its {len(chosen)} int8 layers the graph runs {speed}")
    for layer in layers:
        if layer.reason is not None:
            report.skip(layer.node, f"kept in float32: {layer.reason}")
        else:
            op = "onednn.qconv_pointwise" if isinstance(layer.int8_module, Int8Conv) else "onednn.qlinear_pointwise"
            output = ", uint8 output for its int8 readers" if layer in chained else ""
            speed = f"; {_speed(layer.times, 'its float32 kernel')}" if layer.times is not None else ""
            alone = f"alone it changes the output by {layer.error:.1e} of its scale" if layer.error is not None else "not measured alone: all together were within the budget"
            report.rewrite(layer.node, f"{_kind(layer)} -> {op} (int8{output}; {alone}{speed})")
    report.notes.append(
        f"{len(chosen)} of {len(layers)} convs/linears in int8 (activations: {activation_levels()} levels, calibrated on "
        f"{len(ctx.calibration)} batches; {len(chained)} write uint8 straight to int8 readers); output error at most {total:.1e} "
        f"of its scale on the example inputs and the calibration batches, accuracy={ctx.accuracy:g}"
    )
    return finish(gm, bool(chosen), report)


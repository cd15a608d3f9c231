"""use_onednn_kernels: run conv/linear (+ activation, + residual add) as oneDNN fused kernels, weights prepacked once.

Patterns (CPU inference, float32 or bfloat16; runs after use_low_precision and to_channels_last)::

    conv2d/3d(x, W, b) [-> act]                    -> mkldnn._convolution_pointwise(x, W_packed, b, ..., act)
    conv2d/3d(x, W, b) -> add(., other) [-> act]   -> mkldnn._convolution_pointwise.binary(x, other, W_packed, b, ..., "add", act)
    linear(x, W, b) [-> act]                       -> mkldnn._linear_pointwise(x, W_packed, b, act)
    linear(x, W, b) -> add(., other)               -> mkldnn._linear_pointwise.binary(x, other, W_packed, b, "add")

``act``: relu, relu6/hardtanh, silu, gelu (exact or tanh), hardswish, sigmoid, tanh, hardsigmoid, leaky_relu.
ATen's conv reorders the weight into oneDNN's blocked layout on every call and runs the
activation and the residual add as separate passes over memory. Here the weight is
reordered once, at optimize time, for the example input's shape
(``mkldnn._reorder_convolution_weight`` / ``_reorder_linear_weight``, what Inductor's CPU
freezing does), and the pointwise ops run as oneDNN post-ops of the same kernel.
The conv is computed by the same oneDNN primitive ATen uses, so float32 results match
ATen's (linear: to float32 rounding); a fused add rounds bf16 once instead of twice.

Each fused op becomes a call of a `OneDNNConv` / `OneDNNLinear` module (`graphopt.runtime.onednn`) holding the
prepacked weight (an opaque mkldnn tensor, not a Parameter). It takes the place of the
module that held the weights (the ``nn.Conv2d``, or export's holder), so names stay:

- ``state_dict()`` has ``<path>.weight`` (unpacked to a dense tensor when saved) and
  ``<path>.bias`` as before; ``load_state_dict`` repacks.
- ``parameters()``/``buffers()`` list the biases only: a prepacked weight has no autograd.
- ``copy.deepcopy`` and pickling store the dense weight and repack on load.
- ONNX has no such ops: ``graphopt.export_onnx`` leaves this pass out.

Preconditions, each a recorded skip reason:
- inference mode; oneDNN available and enabled; weights on the CPU, float32 or bfloat16
  (bfloat16 needs oneDNN bf16 support on this CPU);
- conv2d/conv3d (oneDNN weight prepacking has no conv1d), not transposed, numeric padding;
- weights are stored tensors, not shared with another op, the module called once;
  stride, padding, dilation and groups are constants, not graph values (forward() arguments);
- on the example inputs the fused op returns the dtype, shape and memory layout of the
  ops it replaces, within the dtype's tolerance (oneDNN returns channels_last for an NCHW
  input: the pass pays off with ``memory_format="channels_last"``). An activation or add
  that does not pass this check is left out of the fusion and the report says why.
An activation or an add is fused only when it is the conv/linear output's only reader, an
activation only when its parameters are constants (else a recorded skip).

The planning (`plan_fusions`, `settle_fusions`) is shared with `use_onednn_linear`, which
runs large linears on oneDNN without prepacking, by default.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch.nn.modules.utils import _ntuple

from graphopt import verify
from graphopt.ops import (
    ActivationView,
    ParameterUsage,
    WeightedOpView,
    activation_view,
    arithmetic_operands,
    layout_key,
    record,
    set_attr,
    weighted_op_view,
)
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.runtime.onednn import NO_POST_OP, OneDNNConv, OneDNNLinear, PostOp, Prepacked
from graphopt.report import PassReport, describe

mkldnn = torch.ops.mkldnn
_DTYPES = (torch.float32, torch.bfloat16)


def _post_op(view: ActivationView) -> PostOp:
    """The oneDNN post-op computing the activation ``view`` (supported: its parameters are constants)."""
    parameters = view.parameters
    if view.kind == "hardtanh":
        return PostOp("hardtanh", (float(parameters["min_val"]), float(parameters["max_val"])))
    if view.kind == "leaky_relu":
        return PostOp("leaky_relu", (float(parameters["negative_slope"]),))
    if view.kind == "gelu":
        return PostOp("gelu", (), str(parameters["approximate"]))
    return PostOp("swish" if view.kind == "silu" else view.kind)


class Kernel(Protocol):
    """What runs a fusion: ``kernel(x)`` or ``kernel(x, other)``, with the post-op and whether the add is fused."""

    post_op: PostOp
    binary: bool

    def __call__(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class Fusion:
    """A conv/linear and the add/activation that may join it; settled on the example inputs (shared with `use_onednn_linear`)."""

    view: WeightedOpView
    nodes: list[fx.Node]  # the op, then an add and/or an activation, each the previous one's only reader
    other_index: int | None  # which argument of the add (nodes[1]) is the other operand
    post_op: PostOp
    values: dict[fx.Node, Any] = field(default_factory=dict)  # example values of the op's input, `other` and each node
    kernel: Kernel | None = None
    length: int = 0  # how many of `nodes` the kernel replaces
    reason: str | None = None  # why the longest fusion (or any) was refused
    unfused_activation: ActivationView | None = None  # the activation after the op that cannot join it (unsupported)

    @property
    def other(self) -> fx.Node | None:
        """The add's other operand, read from the graph (an earlier rewrite may have replaced it)."""
        return None if self.other_index is None else self.nodes[1].args[self.other_index]  # type: ignore[return-value]


Builder = Callable[[Fusion, int, torch.Tensor], Kernel]  # the kernel running a fusion's first n nodes, for input x
Acceptor = Callable[[Kernel, torch.Tensor, torch.Tensor | None], str | None]  # why not take an accurate kernel, or None


def _conv_geometry(view: WeightedOpView) -> tuple[Any, Any, Any]:
    """(padding, stride, dilation) of a conv, each a list per spatial dim (padding may be a string)."""
    expand = _ntuple(view.spatial_dims)
    if view.module is not None:
        module = view.module
        padding = module.padding if isinstance(module.padding, str) else list(expand(module.padding))
        return padding, list(expand(module.stride)), list(expand(module.dilation))
    assert view.arguments is not None
    padding = view.arguments.get("padding")
    padding = padding if isinstance(padding, str) else list(expand(0 if padding is None else padding))
    stride, dilation = view.arguments.get("stride"), view.arguments.get("dilation")
    return padding, list(expand(1 if stride is None else stride)), list(expand(1 if dilation is None else dilation))


def kernel_guard(view: WeightedOpView, ctx: PassContext) -> str | None:
    """Why ``view`` cannot run as a oneDNN op on this machine, or None (shared with `use_onednn_linear`)."""
    if ctx.mode != "inference":
        return "training mode: oneDNN's fused kernels have no gradient (inference only)"
    if not torch.backends.mkldnn.is_available():
        return "oneDNN (torch.backends.mkldnn) is not available in this torch build"
    if not torch.backends.mkldnn.enabled:
        return "oneDNN is disabled (torch.backends.mkldnn.enabled is False)"
    if view.unsupported is not None:
        return view.unsupported
    assert view.weight is not None
    if view.weight.device.type != "cpu":
        return f"weight on {view.weight.device.type}: oneDNN kernels run on the CPU only"
    if view.weight.dtype not in _DTYPES:
        return f"{str(view.weight.dtype).removeprefix('torch.')} weight: oneDNN fused kernels are used for float32 and bfloat16 only"
    if view.weight.dtype == torch.bfloat16 and not bf16_supported():
        return "this CPU has no oneDNN bfloat16 kernels"
    return None


def _guard(view: WeightedOpView, ctx: PassContext, usage: ParameterUsage) -> str | None:
    """Why ``view`` cannot run as a prepacked oneDNN op, or None."""
    reason = kernel_guard(view, ctx)
    if reason is not None:
        return reason
    if view.transposed:
        return "transposed convolution: not prepacked"
    if view.spatial_dims == 1:
        return "conv1d: oneDNN weight prepacking supports conv2d and conv3d only"
    if view.arguments is not None and (unknown := view.arguments.not_constant("stride", "padding", "dilation")):
        return unknown  # the kernel is built for one geometry
    if view.spatial_dims and isinstance(_conv_geometry(view)[0], str):
        return f"padding={_conv_geometry(view)[0]!r}: only numeric padding is prepacked"
    return usage.sharing(view)


def bf16_supported() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (AVX-512 or AMX)."""
    return bool(mkldnn._is_mkldnn_bf16_supported())


def _only_reader(node: fx.Node, claimed: set[fx.Node]) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0] not in claimed else None


def _plan(gm: fx.GraphModule, view: WeightedOpView, claimed: set[fx.Node]) -> Fusion:
    """The longest fusion the graph allows: op [-> add] [-> activation] (linear: an add or an activation)."""
    nodes, other_index, post_op = [view.node], None, NO_POST_OP
    reader = _only_reader(view.node, claimed)
    operands = arithmetic_operands(gm, reader, "add") if reader is not None else None
    if operands is not None and all(isinstance(arg, fx.Node) for arg in operands) and operands[0] is not operands[1]:
        nodes.append(reader)  # type: ignore[arg-type]
        other_index = 1 if operands[0] is view.node else 0
        reader = _only_reader(reader, claimed) if view.kind != "linear" else None  # oneDNN linear+add takes no activation
    activation = activation_view(gm, reader) if reader is not None else None
    if activation is not None and activation.input is nodes[-1]:
        if activation.unsupported is not None:
            return Fusion(view, nodes, other_index, post_op, unfused_activation=activation)
        nodes.append(activation.node)
        post_op = _post_op(activation)
    return Fusion(view, nodes, other_index, post_op)


def plan_fusions(
    gm: fx.GraphModule, report: PassReport, guard: Callable[[WeightedOpView], str | None], kinds: tuple[str, ...] | None = None
) -> list[Fusion]:
    """The longest fusion of each conv/linear (of ``kinds``, default all) that ``guard`` admits; its reason is recorded as a skip otherwise."""
    fusions: list[Fusion] = []
    claimed: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        view = weighted_op_view(gm, node)
        if view is None or (kinds is not None and view.kind not in kinds):
            continue
        reason = guard(view)
        if reason is not None:
            report.skip(node, reason)
            continue
        fusion = _plan(gm, view, claimed)
        if fusion.unfused_activation is not None:
            report.skip(fusion.unfused_activation.node, f"not fused into the {view.kind}: {fusion.unfused_activation.unsupported}")
        claimed.update(fusion.nodes)
        fusions.append(fusion)
    return fusions


def _build(fusion: Fusion, length: int, x: torch.Tensor) -> Prepacked:
    """The module running the first ``length`` nodes of ``fusion``, its weight packed for input ``x``."""
    view = fusion.view
    binary = length >= 2 and fusion.other is not None
    post_op = fusion.post_op if length == len(fusion.nodes) else NO_POST_OP
    weight = view.weight
    assert weight is not None
    if view.kind == "linear":
        return OneDNNLinear(weight, view.bias, math.prod(x.shape[:-1]), post_op, binary)
    padding, stride, dilation = _conv_geometry(view)
    return OneDNNConv(weight, view.bias, padding, stride, dilation, view.groups, list(x.shape), post_op, binary)


def _settle(fusion: Fusion, build: Builder, accept: Acceptor | None) -> None:
    """Choose the longest fusion that reproduces the graph's values on the example inputs (or none)."""
    x = fusion.values[fusion.view.input]
    if not isinstance(x, torch.Tensor) or x.dtype != fusion.view.weight.dtype:  # type: ignore[union-attr]
        fusion.reason = f"input is {getattr(x, 'dtype', type(x).__name__)}, weight {fusion.view.weight.dtype}: no fused kernel"  # type: ignore[union-attr]
        return
    # with an add, the shortest fusion is the op alone; an activation without an add goes with the op or not at all
    lengths = [len(fusion.nodes), 1] if fusion.other is None else list(range(len(fusion.nodes), 0, -1))
    for length in dict.fromkeys(lengths):
        expected = fusion.values[fusion.nodes[length - 1]]
        other = fusion.values[fusion.other] if length > 1 and fusion.other is not None else None
        if other is not None and (not isinstance(other, torch.Tensor) or {other.dtype, expected.dtype} != {x.dtype} or other.shape != expected.shape):
            described = f"{other.dtype} {tuple(other.shape)}" if isinstance(other, torch.Tensor) else type(other).__name__
            reason = (
                f"the add's other operand is {described}, the {fusion.view.kind}'s output {x.dtype} {tuple(expected.shape)}: "
                "oneDNN adds same-shape, same-dtype tensors only"
            )
            fusion.reason = fusion.reason or reason
            continue
        try:
            kernel = build(fusion, length, x)
            actual = kernel(x) if other is None else kernel(x, other)
        except RuntimeError as error:
            reason = f"oneDNN refused it ({str(error).splitlines()[0]})"
        else:
            error_value = float((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30))
            if layout_key(expected) != layout_key(actual):
                reason = (
                    f"oneDNN returns {actual.dtype} with strides {actual.stride()} where the graph has {expected.dtype} with "
                    f"{expected.stride()} (an NCHW input gets a channels_last result: use memory_format='channels_last')"
                )
            elif error_value > verify.tolerance_for(expected.dtype):
                reason = f"oneDNN's result differs by {error_value:.1e} relative to its scale"
            else:
                refused = accept(kernel, x, other) if accept is not None else None
                if refused is None:
                    fusion.kernel, fusion.length = kernel, length
                    return
                reason = refused
        fusion.reason = fusion.reason or reason
    fusion.reason = reason


def settle_fusions(gm: fx.GraphModule, fusions: list[Fusion], args: tuple[Any, ...], build: Builder, accept: Acceptor | None = None) -> None:
    """Run the graph on the example inputs and settle each fusion with the values its nodes see.

    ``build`` makes the kernel for a fusion's first n nodes; a kernel that reproduces the
    graph's values is taken unless ``accept(kernel, x, other)`` gives a reason not to.
    """
    fusion_of = {node: fusion for fusion in fusions for node in fusion.nodes}

    def keep_values(node: fx.Node, result: Any, values: Mapping[fx.Node, Any]) -> None:
        fusion = fusion_of.get(node)
        if fusion is None:
            return
        for arg in (fusion.view.input, fusion.other):
            if arg in node.all_input_nodes:
                fusion.values.setdefault(arg, values[arg])
        # a later in-place activation may overwrite this value: keep a copy
        fusion.values[node] = result.clone() if isinstance(result, torch.Tensor) and node is not fusion.nodes[-1] else result
        if node is fusion.nodes[-1]:
            _settle(fusion, build, accept)
            fusion.values.clear()

    record(gm, args, keep_values)


def _module_path(gm: fx.GraphModule, view: WeightedOpView) -> str:
    """Where the fused module goes: in place of the module holding only this op's weights (names stay), else beside the weight."""
    owner_path, _, weight_name = str(view.weight_target).rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    held = {name for name, _ in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]}
    ours = {str(target).rpartition(".")[2] for target in (view.weight_target, view.bias_target) if target}
    if owner_path and held <= ours and not list(owner.children()):
        return owner_path
    base, suffix = f"{weight_name}_onednn", 0
    while hasattr(owner, f"{base}{suffix or ''}"):
        suffix += 1
    return f"{owner_path}.{base}{suffix or ''}" if owner_path else f"{base}{suffix or ''}"


def report_left_out(report: PassReport, fusion: Fusion) -> None:
    """Record why the add or activation a settled fusion leaves out was not fused."""
    if fusion.length < len(fusion.nodes):
        left_out = ", ".join(describe(node) for node in fusion.nodes[fusion.length :])
        report.skip(fusion.nodes[fusion.length], f"not fused into {describe(fusion.view.node)} ({left_out}): {fusion.reason}")


def describe_fusion(fusion: Fusion, weight: str) -> str:
    """``linear + gelu -> mkldnn._linear_pointwise, <weight>``: what a settled fusion became."""
    assert fusion.kernel is not None
    parts = [fusion.view.kind, *(["add"] if fusion.kernel.binary else [])]
    if fusion.kernel.post_op.attr != "none":
        parts.append(fusion.kernel.post_op.attr)
    op = "mkldnn._linear_pointwise" if fusion.view.kind == "linear" else "mkldnn._convolution_pointwise"
    binary = ".binary" if "add" in parts else ""
    return f"{' + '.join(parts)} -> {op}{binary}, {weight}"


def use_onednn_kernels(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace conv/linear (+ add) (+ activation) by oneDNN fused kernels with prepacked weights."""
    report = PassReport("use_onednn_kernels")
    usage = ParameterUsage(gm)
    fusions = plan_fusions(gm, report, lambda view: _guard(view, ctx, usage))
    if not fusions:
        return finish(gm, False, report)
    settle_fusions(gm, fusions, ctx.example_inputs, _build)

    dropped: list[str] = []
    counts = {"conv": 0, "linear": 0, "add": 0, "activation": 0}
    for fusion in fusions:
        view = fusion.view
        module = fusion.kernel
        if module is None:
            report.skip(view.node, str(fusion.reason))
            continue
        assert isinstance(module, Prepacked)
        report_left_out(report, fusion)
        path = _module_path(gm, view)
        set_attr(gm, path, module)
        replaced = fusion.nodes[: fusion.length]
        end = replaced[-1]
        with gm.graph.inserting_before(end):
            args = (view.input, fusion.other) if module.binary else (view.input,)
            call = gm.graph.call_module(path, args)
        call.meta.update(end.meta)
        end.replace_all_uses_with(call)
        for node in reversed(replaced):
            gm.graph.erase_node(node)
        if view.module is None:
            dropped += [str(target) for target in (view.weight_target, view.bias_target) if target]
        report.rewrite(call, describe_fusion(fusion, f"weight prepacked once ({str(view.weight.dtype).removeprefix('torch.')})"))  # type: ignore[union-attr]
        counts["linear" if view.kind == "linear" else "conv"] += 1
        counts["add"] += int(module.binary)
        counts["activation"] += int(module.post_op.attr != "none")
    if report.rewrites:
        report.notes.append(
            f"{counts['conv']} convs and {counts['linear']} linears run by oneDNN with prepacked weights; "
            f"fused: {counts['activation']} activations, {counts['add']} residual adds"
        )
    return finish(gm, bool(report.rewrites), report, dict.fromkeys(dropped))

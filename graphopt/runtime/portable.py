"""The portable form of an optimized graph's oneDNN kernels, for files (`graphopt.save`, `graphopt.package`).

What the oneDNN passes leave in a graph cannot go into a torch.export archive as it is:
a prepacked weight (`OneDNNConv`, `OneDNNLinear`) is an opaque tensor with no storage,
and ``mkldnn._linear_pointwise``'s empty list of post-op scalars has no type the
serializer can write. `to_portable` replaces each with a call of a graphopt op on the
dense weight, whose arguments say everything the kernel needs:

- ``graphopt::onednn_linear(x, other, weight, bias, attr, scalars, algorithm, packed_rows)``
  (``packed_rows`` 0: ``use_onednn_linear``'s kernel on the weight as it is; otherwise an
  `OneDNNLinear` prepacked for that many input rows);
- ``graphopt::onednn_conv(x, other, weight, bias, padding, stride, dilation, groups, attr,
  scalars, algorithm, packed_input_size)`` (an `OneDNNConv`).

The dense weight and bias stay at the module path the kernel had (``<path>.weight``), so
the state_dict keys do not change. `from_portable` turns the calls back into the kernels
(prepacking again, for this CPU); ``graphopt::linear_add`` is exported as it is. The ops
compute with ATen's conv/linear, add and activation, so `ATEN_DECOMPOSITIONS` lets
``ExportedProgram.run_decompositions`` write plain ATen for AOTInductor, and `to_aten`
writes the graph with ATen's ops in their places (for ONNX export and for optimizing an
optimized module again).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.runtime.onednn import OneDNNConv, OneDNNLinear, PostOp, aten_post_op

LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default


def _post_ops(y: torch.Tensor, other: torch.Tensor | None, attr: str, scalars: Sequence[float], algorithm: str) -> torch.Tensor:
    """The add, then the activation, of a oneDNN kernel, by ATen."""
    if other is not None:
        y = y + other
    if attr == "none":
        return y
    function, args, kwargs = aten_post_op(attr, scalars, algorithm)
    return function(y, *args, **kwargs)


def _aten_linear(
    x: torch.Tensor, other: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, attr: str, scalars: Sequence[float], algorithm: str, packed_rows: int
) -> torch.Tensor:
    return _post_ops(F.linear(x, weight, bias), other, attr, scalars, algorithm)


def _aten_conv(
    x: torch.Tensor, other: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, padding: Sequence[int], stride: Sequence[int],
    dilation: Sequence[int], groups: int, attr: str, scalars: Sequence[float], algorithm: str, packed_input_size: Sequence[int],
) -> torch.Tensor:  # fmt: skip
    y = torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False, [0] * len(padding), groups)
    return _post_ops(y, other, attr, scalars, algorithm)


def _aten_linear_add(x: torch.Tensor, other: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias) + other


# The ops compute with ATen; their shapes, dtypes and layouts are ATen's, so their fake (tracing) versions are the same functions
_LINEAR_SCHEMA = "(Tensor x, Tensor? other, Tensor weight, Tensor? bias, str attr, float[] scalars, str algorithm, int packed_rows) -> Tensor"
_CONV_SCHEMA = (
    "(Tensor x, Tensor? other, Tensor weight, Tensor? bias, int[] padding, int[] stride, int[] dilation, int groups, str attr, "
    "float[] scalars, str algorithm, int[] packed_input_size) -> Tensor"
)
torch.library.custom_op("graphopt::onednn_linear", _aten_linear, mutates_args=(), schema=_LINEAR_SCHEMA).register_fake(_aten_linear)
torch.library.custom_op("graphopt::onednn_conv", _aten_conv, mutates_args=(), schema=_CONV_SCHEMA).register_fake(_aten_conv)

PORTABLE_LINEAR = torch.ops.graphopt.onednn_linear.default
PORTABLE_CONV = torch.ops.graphopt.onednn_conv.default
LINEAR_ADD = torch.ops.graphopt.linear_add.default

# graphopt's ops as ATen, for ExportedProgram.run_decompositions (AOTInductor compiles ATen only)
ATEN_DECOMPOSITIONS: dict[Any, Callable[..., torch.Tensor]] = {PORTABLE_LINEAR: _aten_linear, PORTABLE_CONV: _aten_conv, LINEAR_ADD: _aten_linear_add}


def _dense_holder(module: OneDNNConv | OneDNNLinear) -> nn.Module:
    """A plain module holding a kernel's dense weight and its bias, under the kernel's names."""
    holder = nn.Module()
    holder.register_parameter("weight", nn.Parameter(module.weight.detach().clone(), requires_grad=False))
    if isinstance(module.bias, nn.Parameter) or module.bias is None:
        holder.register_parameter("bias", module.bias)
    else:
        holder.register_buffer("bias", module.bias)
    return holder


def to_portable(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose oneDNN kernels are graphopt ops on dense weights (``gm`` is left as it is)."""
    portable = copy.deepcopy(gm)  # prepacked weights copy as dense ones (Prepacked.__getstate__), repacked
    graph = portable.graph
    kernels = {
        node.target: portable.get_submodule(node.target)
        for node in graph.nodes
        if node.op == "call_module" and isinstance(portable.get_submodule(node.target), (OneDNNConv, OneDNNLinear))
    }
    for path, module in kernels.items():
        portable.set_submodule(path, _dense_holder(module))
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target in kernels:
            module = kernels[node.target]
            x, other = node.args[0], node.args[1] if len(node.args) > 1 else None
            with graph.inserting_before(node):
                weight = graph.get_attr(f"{node.target}.weight")
                bias = graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
                attr, scalars, algorithm = module.post_op
                if isinstance(module, OneDNNConv):
                    kernel = (module.padding, module.stride, module.dilation, module.groups)
                    replacement = graph.call_function(PORTABLE_CONV, (x, other, weight, bias, *kernel, attr, list(scalars), algorithm, module.input_size))
                else:
                    replacement = graph.call_function(PORTABLE_LINEAR, (x, other, weight, bias, attr, list(scalars), algorithm, module.rows))
        elif node.op == "call_function" and node.target is LINEAR_POINTWISE:
            x, weight, bias, attr, scalars, algorithm = node.args
            with graph.inserting_before(node):
                replacement = graph.call_function(PORTABLE_LINEAR, (x, None, weight, bias, attr, [float(s) for s in scalars], algorithm or "", 0))
        else:
            continue
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    portable.recompile()
    return portable


def runs_onednn_kernels(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` calls oneDNN kernels that `to_aten` turns back into ATen's ops."""
    kernels = (OneDNNConv, OneDNNLinear)
    return any(
        (node.op == "call_module" and isinstance(gm.get_submodule(node.target), kernels))
        or (node.op == "call_function" and node.target in (LINEAR_POINTWISE, LINEAR_ADD))
        for node in gm.graph.nodes
    )


def to_aten(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` computing each oneDNN kernel with ATen's conv/linear, add and activation, on the dense weights.

    The weights keep their module paths (``<path>.weight``), so the state_dict keys do not change.
    """
    aten = to_portable(gm)
    graph = aten.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in ATEN_DECOMPOSITIONS:
            continue
        attr, scalars, algorithm = "none", (), ""
        with graph.inserting_before(node):
            if node.target is LINEAR_ADD:
                x, other, weight, bias = node.args
                y = graph.call_function(F.linear, (x, weight, bias))
            elif node.target is PORTABLE_LINEAR:
                x, other, weight, bias, attr, scalars, algorithm, _ = node.args
                y = graph.call_function(F.linear, (x, weight, bias))
            else:
                x, other, weight, bias, padding, stride, dilation, groups, attr, scalars, algorithm, _ = node.args
                conv = F.conv3d if len(padding) == 3 else F.conv2d
                y = graph.call_function(conv, (x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups))
            if other is not None:
                y = graph.call_function(operator.add, (y, other))
            if attr != "none":
                function, args, kwargs = aten_post_op(attr, scalars, algorithm)
                y = graph.call_function(function, (y, *args), kwargs)
        y.meta.update(node.meta)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
    aten.recompile()
    return aten


def _runtime_kernel(gm: fx.GraphModule, node: fx.Node) -> tuple[str, Any, tuple[Any, ...]] | None:
    """What a portable call becomes: ("call_function", target, args) or ("call_module", module path, args)."""
    if node.target is PORTABLE_LINEAR:
        x, other, weight, bias, attr, scalars, algorithm, packed_rows = node.args
        if not packed_rows:
            if other is not None:
                return "call_function", LINEAR_ADD, (x, other, weight, bias)
            return "call_function", LINEAR_POINTWISE, (x, weight, bias, attr, list(scalars), algorithm)
    elif node.target is PORTABLE_CONV:
        x, other, weight, bias, padding, stride, dilation, groups, attr, scalars, algorithm, input_size = node.args
    else:
        return None
    path = weight.target.rpartition(".")[0]
    if not isinstance(gm.get_submodule(path), (OneDNNConv, OneDNNLinear)):  # a kernel called twice is packed once
        post_op, binary = PostOp(attr, tuple(scalars), algorithm), other is not None
        if node.target is PORTABLE_LINEAR:
            module: nn.Module = OneDNNLinear(_value(gm, weight), _value(gm, bias), packed_rows, post_op, binary)
        else:
            module = OneDNNConv(_value(gm, weight), _value(gm, bias), list(padding), list(stride), list(dilation), groups, list(input_size), post_op, binary)
        gm.set_submodule(path, module)
    return "call_module", path, (x,) if other is None else (x, other)


def _value(gm: fx.GraphModule, node: fx.Node | None) -> torch.Tensor | None:
    if node is None:
        return None
    return operator.attrgetter(node.target)(gm)


def from_portable(gm: fx.GraphModule) -> None:
    """Turn ``gm``'s portable calls back into oneDNN kernels, in place (prepacking weights again)."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        kernel = _runtime_kernel(gm, node)
        if kernel is None:
            continue
        op, target, args = kernel
        with graph.inserting_before(node):
            replacement = graph.create_node(op, target, args)
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.eliminate_dead_code()  # the get_attr nodes of prepacked weights, now inside their modules
        gm.recompile()

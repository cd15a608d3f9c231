"""Convolutions (any rank, plain or transposed) and linear layers: `WeightedOpView` and `weighted_op_view`.

The view reads the op's kind, groups and stored weight and bias in every form, writes
new parameters back in their role, drops a bias, and turns a module call into the
functional call it makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from graphopt.ops.arguments import Arguments, argument_names, graph_values
from graphopt.ops.graph import Form, add_tensor, called_module, delete_attr, get_attr, replace_tensor, stored_tensor

aten = torch.ops.aten

# ATen overload -> (spatial dims, transposed); spatial dims 0 means linear. Arguments are named by the overload's schema.
_WEIGHTED_ATEN: dict[Any, tuple[int, bool | None]] = {
    aten.conv1d.default: (1, False),
    aten.conv2d.default: (2, False),
    aten.conv3d.default: (3, False),
    aten.conv1d.padding: (1, False),
    aten.conv2d.padding: (2, False),
    aten.conv3d.padding: (3, False),
    aten.conv_transpose1d.default: (1, True),
    aten.conv_transpose2d.input: (2, True),
    aten.conv_transpose3d.input: (3, True),
    # spatial dims and transposition of the generic form are read from its arguments
    aten.convolution.default: (-1, None),
    aten.linear.default: (0, False),
}
# function -> the ATen overload it calls, whose schema names its arguments (these functions have no Python signature)
_WEIGHTED_FUNCTIONS: dict[Any, Any] = {
    F.conv1d: aten.conv1d.default,
    F.conv2d: aten.conv2d.default,
    F.conv3d: aten.conv3d.default,
    F.conv_transpose1d: aten.conv_transpose1d.default,
    F.conv_transpose2d: aten.conv_transpose2d.input,
    F.conv_transpose3d: aten.conv_transpose3d.input,
    F.linear: aten.linear.default,
}
# (spatial dims, transposed) -> the conv function, for to_function
_FUNCTION_OF = {
    _WEIGHTED_ATEN[overload]: function for function, overload in _WEIGHTED_FUNCTIONS.items() if _WEIGHTED_ATEN[overload][0]
}
# What an omitted bias and groups mean. Not the schemas' defaults: an omitted stride, padding or dilation
# reads as None, which callers take for the functional default (the schema of conv2d.padding says "valid").
# aten.convolution requires every argument, so these never apply to it.
_DEFAULTS = {"bias": None, "groups": 1}
_CONV_MODULES: dict[type[nn.Module], tuple[int, bool]] = {
    nn.Conv1d: (1, False),
    nn.Conv2d: (2, False),
    nn.Conv3d: (3, False),
    nn.ConvTranspose1d: (1, True),
    nn.ConvTranspose2d: (2, True),
    nn.ConvTranspose3d: (3, True),
    nn.Linear: (0, False),
}


def _arguments(node: fx.Node, overload: Any) -> Arguments:
    return Arguments(node, argument_names(overload), _DEFAULTS)


@dataclass
class WeightedOpView:
    """A convolution (any rank, plain or transposed) or a linear layer."""

    node: fx.Node
    form: Form
    spatial_dims: int  # 0 for linear
    transposed: bool
    groups: int | None  # None when it is a graph value (``unsupported`` says so)
    weight: torch.Tensor | None  # None when the weight is computed in the graph
    bias: torch.Tensor | None
    weight_target: str | None  # attribute path of the weight, when it is a stored tensor
    bias_target: str | None
    module: nn.Module | None = None
    arguments: Arguments | None = None
    unsupported: str | None = None  # why a rewrite of this op cannot be trusted (a computed weight, graph-valued groups...)

    @property
    def kind(self) -> str:
        if self.spatial_dims == 0:
            return "linear"
        return f"conv_transpose{self.spatial_dims}d" if self.transposed else f"conv{self.spatial_dims}d"

    @property
    def input(self) -> fx.Node:
        return self.node.args[0]  # type: ignore[return-value]

    def set_weight(self, gm: fx.GraphModule, weight: torch.Tensor) -> None:
        assert self.weight_target is not None
        self.weight = replace_tensor(gm, self.weight_target, weight)

    def set_bias(self, gm: fx.GraphModule, bias: torch.Tensor) -> None:
        """Store a new bias; when there was none, create it (and its graph input) in the weight's role."""
        assert self.weight_target is not None and self.weight is not None
        if self.bias_target is not None:
            self.bias = replace_tensor(gm, self.bias_target, bias)
            return
        if self.module is not None:
            self.module.bias = nn.Parameter(bias.detach().clone(), requires_grad=self.weight.requires_grad)
            self.bias_target = f"{self.node.target}.bias"
        else:
            assert self.arguments is not None
            self.bias_target = add_tensor(gm, self.weight_target, "bias", bias.detach().clone(), self.weight)
            with gm.graph.inserting_before(self.node):
                self.arguments.set("bias", gm.graph.get_attr(self.bias_target))
        self.bias = get_attr(gm, self.bias_target)

    def to_function(self, gm: fx.GraphModule) -> None:
        """Turn a module call into the functional call it makes, reading the weights through get_attr.

        Module names, parameters and state_dict keys stay; the op's operands become graph
        values a pass can cast or rewrite. Only for supported (unmodified) modules.
        """
        assert self.module is not None and self.unsupported is None
        module, node = self.module, self.node
        if self.spatial_dims == 0:
            function, extra = F.linear, ()
        elif self.transposed:
            function = _FUNCTION_OF[(self.spatial_dims, True)]
            extra = (module.stride, module.padding, module.output_padding, module.groups, module.dilation)
        else:
            function = _FUNCTION_OF[(self.spatial_dims, False)]
            extra = (module.stride, module.padding, module.dilation, module.groups)
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
            call = gm.graph.call_function(function, (node.args[0], weight, bias, *extra))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        self.node, self.form, self.module = call, "function", None
        self.arguments = _arguments(call, _WEIGHTED_FUNCTIONS[function])

    def remove_bias(self, gm: fx.GraphModule) -> None:
        """Drop the bias: the op computes without it and the parameter leaves the module."""
        if self.module is not None:
            self.module.bias = None
        else:
            assert self.arguments is not None and self.bias_target is not None
            self.arguments.set("bias", None)
            for node in list(gm.graph.nodes):
                if node.op == "get_attr" and node.target == self.bias_target and not node.users:
                    gm.graph.erase_node(node)
            delete_attr(gm, self.bias_target)
        self.bias, self.bias_target = None, None


def _module_view(gm: fx.GraphModule, node: fx.Node) -> WeightedOpView | None:
    module = called_module(gm, node)
    base = next((cls for cls in _CONV_MODULES if isinstance(module, cls)), None)
    if base is None:
        return None
    assert module is not None
    spatial_dims, transposed = _CONV_MODULES[base]
    unsupported = None
    if parametrize.is_parametrized(module):
        unsupported = f"{type(module).__name__} '{node.target}' is parametrized"
    elif type(module).forward is not base.forward:
        unsupported = f"{type(module).__name__} '{node.target}' overrides forward()"
    elif getattr(module, "padding_mode", "zeros") != "zeros":
        unsupported = f"{type(module).__name__} '{node.target}' uses padding_mode={module.padding_mode!r}"
    return WeightedOpView(
        node=node,
        form="module",
        spatial_dims=spatial_dims,
        transposed=transposed,
        groups=getattr(module, "groups", 1),
        weight=module.weight,
        bias=module.bias,
        weight_target=f"{node.target}.weight",
        bias_target=f"{node.target}.bias" if module.bias is not None else None,
        module=module,
        unsupported=unsupported,
    )


def weighted_op_view(gm: fx.GraphModule, node: fx.Node) -> WeightedOpView | None:
    """View of a conv/conv-transpose/linear node in any form, else ``None``."""
    if node.op == "call_module":
        return _module_view(gm, node)
    if node.op != "call_function":
        return None
    if node.target in _WEIGHTED_FUNCTIONS:
        form: Form = "function"
        overload = _WEIGHTED_FUNCTIONS[node.target]
    elif node.target in _WEIGHTED_ATEN:
        form, overload = "aten", node.target
    else:
        return None
    spatial_dims, transposed = _WEIGHTED_ATEN[overload]
    arguments = _arguments(node, overload)
    weight, weight_target = stored_tensor(gm, arguments.get("weight"))
    bias, bias_target = stored_tensor(gm, arguments.get("bias"))
    if transposed is None:  # aten.convolution: read rank and kind from the arguments (a list and a bool in its schema)
        transposed = bool(arguments.get("transposed"))
        spatial_dims = len(arguments.get("stride"))
    # read here: the rest of the geometry (stride, padding, dilation) only matters to a pass that hands the op to
    # another kernel, which reads it through `arguments` and asks `arguments.not_constant` first
    unsupported = arguments.not_constant("groups", "transposed")
    if weight is None:
        unsupported = f"the weight of '{node.name}' is computed in the graph, not a stored parameter"
    elif arguments.get("bias") is not None and bias is None:
        unsupported = f"the bias of '{node.name}' is computed in the graph, not a stored parameter"
    groups = arguments.get("groups") if spatial_dims else 1
    return WeightedOpView(
        node=node,
        form=form,
        spatial_dims=spatial_dims,
        transposed=transposed,
        groups=None if graph_values(groups) else int(groups or 1),
        weight=weight,
        bias=bias,
        weight_target=weight_target,
        bias_target=bias_target,
        arguments=arguments,
        unsupported=unsupported,
    )

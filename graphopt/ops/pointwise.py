"""Elementwise ops: the activation table, the views derived from it, `pointwise_view`, `arithmetic_operands`.

`ACTIVATIONS` lists each activation once, in all its spellings, with its parameters and
the oneDNN post-op computing it. Derived from it: `activation_view` (the rows oneDNN
fuses; modules by exact type), `is_unary_pointwise` (every row; modules by
``isinstance``) and `pointwise_view`'s activation modules (exact type, rewritten as the
row's functional call). The package docstring says which view to use.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops.arguments import Arguments, argument_names, graph_values
from graphopt.ops.graph import Form, called_module, is_call_to
from graphopt.ops.transfers import is_dtype_cast

aten = torch.ops.aten


# --------------------------------------------------------------------------- the activation table


@dataclass(frozen=True)
class Activation:
    """One activation in every spelling, and what graphopt knows about it."""

    name: str
    module: type[nn.Module] | None = None
    functions: tuple[Any, ...] = ()  # torch.* and F.* functions; the first is the call its module makes
    aten: tuple[Any, ...] = ()  # out-of-place ATen overloads
    # ATen overloads only activation_view reads: the in-place ones export writes for inplace=True modules (a post-op
    # overwrites the conv's fresh output anyway) and relu6 (export decomposes it into hardtanh)
    fused_aten: tuple[Any, ...] = ()
    # call_method names. is_unary_pointwise matches all of them; activation_view and pointwise_view, which fuse or
    # rewrite the call, only `tensor_methods` (relu, sigmoid, tanh, clamp: torch.Tensor has no gelu, silu, ...)
    methods: tuple[str, ...] = ()
    parameters: dict[str, Any] = field(default_factory=dict)  # name -> default, as module attribute and call argument
    post_op: str | None = None  # the kind activation_view reports, the oneDNN post-op computing it; None: not fused
    post_op_parameters: dict[str, Any] | None = None  # fixed parameters of that post-op, instead of reading them

    @property
    def tensor_methods(self) -> tuple[str, ...]:
        """The methods torch.Tensor defines: those a view may fuse or rewrite."""
        return tuple(method for method in self.methods if hasattr(torch.Tensor, method))


# name, module, functions, aten, fused_aten, methods, then what activation_view needs
ACTIVATIONS = (
    Activation("relu", nn.ReLU, (F.relu, torch.relu), (aten.relu.default,), (aten.relu_.default,), ("relu",), post_op="relu"),
    Activation(
        "relu6", nn.ReLU6, (F.relu6,), (), (aten.relu6.default,), ("relu6",),
        post_op="hardtanh", post_op_parameters={"min_val": 0.0, "max_val": 6.0},
    ),
    Activation(
        "hardtanh", nn.Hardtanh, (F.hardtanh,), (aten.hardtanh.default,), (aten.hardtanh_.default,), (),
        parameters={"min_val": -1.0, "max_val": 1.0}, post_op="hardtanh",
    ),
    Activation("silu", nn.SiLU, (F.silu,), (aten.silu.default,), (aten.silu_.default,), ("silu",), post_op="silu"),
    Activation(
        "gelu", nn.GELU, (F.gelu,), (aten.gelu.default,), (), ("gelu",),
        parameters={"approximate": "none"}, post_op="gelu",
    ),
    Activation(
        "hardswish", nn.Hardswish, (F.hardswish,), (aten.hardswish.default,), (aten.hardswish_.default,), ("hardswish",),
        post_op="hardswish",
    ),
    Activation("sigmoid", nn.Sigmoid, (torch.sigmoid, F.sigmoid), (aten.sigmoid.default,), (), ("sigmoid",), post_op="sigmoid"),
    Activation("tanh", nn.Tanh, (torch.tanh, F.tanh), (aten.tanh.default,), (), ("tanh",), post_op="tanh"),
    Activation(
        "hardsigmoid", nn.Hardsigmoid, (F.hardsigmoid,), (aten.hardsigmoid.default,), (aten.hardsigmoid_.default,), ("hardsigmoid",),
        post_op="hardsigmoid",
    ),
    Activation(
        "leaky_relu", nn.LeakyReLU, (F.leaky_relu,), (aten.leaky_relu.default,), (aten.leaky_relu_.default,), ("leaky_relu",),
        parameters={"negative_slope": 0.01}, post_op="leaky_relu",
    ),
    Activation("elu", nn.ELU, (F.elu,), (aten.elu.default,), (), ("elu",), parameters={"alpha": 1.0}),
    Activation("mish", nn.Mish, (F.mish,), (aten.mish.default,), (), ("mish",)),
    Activation("clamp", None, (torch.clamp,), (aten.clamp.default,), (), ("clamp",)),
)  # fmt: skip

_BY_MODULE = {row.module: row for row in ACTIVATIONS if row.module is not None}
_FUSED = [row for row in ACTIVATIONS if row.post_op is not None]
_FUSED_BY_MODULE = {row.module: row for row in _FUSED if row.module is not None}
_FUSED_BY_TARGET = {target: row for row in _FUSED for target in (*row.functions, *row.aten, *row.fused_aten)}
_FUSED_BY_METHOD = {method: row for row in _FUSED for method in row.tensor_methods}
_UNARY_MODULES = tuple(_BY_MODULE)
_UNARY_TARGETS = frozenset(target for row in ACTIVATIONS for target in (*row.functions, *row.aten))
_UNARY_METHODS = frozenset(method for row in ACTIVATIONS for method in row.methods)


# --------------------------------------------------------------------------- activation_view / is_unary_pointwise


@dataclass
class ActivationView:
    """An activation oneDNN fuses as a post-op (relu, relu6/hardtanh, silu, gelu, hardswish, sigmoid, tanh, hardsigmoid, leaky_relu)."""

    node: fx.Node
    input: Any
    kind: str
    parameters: dict[str, Any]  # e.g. hardtanh's min_val/max_val, gelu's approximate
    unsupported: str | None = None  # why it cannot be fused: a parameter is a graph value (then not in ``parameters``)


def _activation(node: fx.Node, row: Activation, read: Callable[[str, Any], Any], arguments: Arguments | None = None) -> ActivationView:
    """The view of ``node`` computing ``row``, each parameter from ``read(name, default)`` (``arguments``: a call's)."""
    assert row.post_op is not None
    unsupported = arguments.not_constant(*row.parameters) if arguments is not None else None
    if row.post_op_parameters is not None:
        parameters = dict(row.post_op_parameters)
    elif unsupported is not None:
        parameters = {}
    else:
        parameters = {name: read(name, default) for name, default in row.parameters.items()}
    return ActivationView(node, node.args[0], row.post_op, parameters, unsupported)


def activation_view(gm: fx.GraphModule, node: fx.Node) -> ActivationView | None:
    """View of an activation oneDNN can fuse, in module, function, method or ATen form, else ``None``."""
    if node.op == "call_module":
        module = called_module(gm, node)
        row = _FUSED_BY_MODULE.get(type(module))  # exact types: a subclass may override forward()
        if row is None or len(node.args) != 1 or node.kwargs:
            return None
        return _activation(node, row, lambda name, default: getattr(module, name, default))
    if node.op == "call_method" and node.target in _FUSED_BY_METHOD and len(node.args) == 1 and not node.kwargs:
        return _activation(node, _FUSED_BY_METHOD[str(node.target)], lambda name, default: default)
    if node.op != "call_function" or node.target not in _FUSED_BY_TARGET or not node.args:
        return None
    row = _FUSED_BY_TARGET[node.target]
    # functions written in C (F.gelu) have no Python signature: the ATen op they call names their arguments
    arguments = Arguments(node, argument_names(node.target) or argument_names(row.aten[0]), {})
    return _activation(node, row, lambda name, default: default if arguments.get(name) is None else arguments.get(name), arguments)


def is_unary_pointwise(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An activation applied to each element on its own (ReLU, GELU, SiLU, sigmoid, clamp, ...), in any form."""
    return is_call_to(gm, node, _UNARY_METHODS, _UNARY_TARGETS, _UNARY_MODULES)


# --------------------------------------------------------------------------- pointwise_view

_POINTWISE_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.abs, torch.exp, torch.sqrt, torch.rsqrt,
    torch.pow, torch.clip, torch.maximum, torch.minimum, torch.where, torch.erf, torch.reciprocal, F.softplus,
    *(function for row in ACTIVATIONS for function in row.functions),
})  # fmt: skip
_POINTWISE_METHODS = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "exp", "sqrt", "rsqrt", "pow", "clip", "erf", "reciprocal",
    *(method for row in ACTIVATIONS for method in row.tensor_methods),
})  # fmt: skip
_UNTAGGED_POINTWISE_ATEN = frozenset({aten.hardswish.default})  # elementwise, though not tagged pointwise


@dataclass(frozen=True)
class PointwiseView:
    """An elementwise op: each output element depends only on the same element of its inputs.

    ``in_place`` ops write their result into ``node.args[0]`` (``nn.ReLU(inplace=True)``,
    ``F.relu(x, inplace=True)``, ``x.add_(y)``, ``aten.relu_``).
    """

    node: fx.Node
    form: Form
    in_place: bool

    def to_function(self, gm: fx.GraphModule) -> None:
        """Rewrite the op as an out-of-place ``call_function`` (activation modules become their functional form).

        Only exact when nothing else reads the input after the op: the caller checks that.
        """
        node = self.node
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            row = _BY_MODULE[type(module)]
            node.op, node.target = "call_function", row.functions[0]
            node.kwargs = {name: getattr(module, name) for name in row.parameters}
        elif node.op == "call_function" and "inplace" in node.kwargs:
            node.kwargs = {**node.kwargs, "inplace": False}
        elif node.op == "call_function" and self.in_place:  # inplace passed positionally
            args = list(node.args)
            args[argument_names(node.target).index("inplace")] = False
            node.args = tuple(args)


def pointwise_view(gm: fx.GraphModule, node: fx.Node) -> PointwiseView | None:
    """A view of ``node`` when it is an elementwise op (activation, arithmetic, dtype cast), else ``None``.

    The caller still checks that the op computes a tensor: ``operator.add`` also adds sizes.
    """
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if type(module) not in _BY_MODULE:  # exact types: a subclass may override forward()
            return None
        return PointwiseView(node, "module", bool(getattr(module, "inplace", False)))
    if node.op == "call_method":
        if node.target in _POINTWISE_METHODS or is_dtype_cast(node):
            return PointwiseView(node, "function", False)
        if isinstance(node.target, str) and node.target.endswith("_") and node.target[:-1] in _POINTWISE_METHODS:
            return PointwiseView(node, "function", True)
        return None
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        if torch.Tag.pointwise in node.target.tags or node.target in _UNTAGGED_POINTWISE_ATEN or is_dtype_cast(node):
            return PointwiseView(node, "aten", node.target._schema.is_mutable)
        return None
    if node.target not in _POINTWISE_FUNCTIONS:
        return None
    names = argument_names(node.target)
    index = names.index("inplace") if "inplace" in names else None
    flag = node.args[index] if index is not None and len(node.args) > index else node.kwargs.get("inplace")
    # a graph value (a forward() argument) may be True at run time: read as in place, the safe side
    return PointwiseView(node, "function", flag is True or bool(graph_values(flag)))


# --------------------------------------------------------------------------- binary arithmetic

# kind -> (methods, targets); keyword arguments (alpha, rounding_mode) are not accepted
_ARITHMETIC: dict[str, tuple[set[str], set[Any]]] = {
    "mul": ({"mul"}, {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar}),
    "div": ({"div"}, {operator.truediv, torch.div, torch.true_divide, aten.div.Tensor, aten.div.Scalar}),
    "add": ({"add"}, {operator.add, torch.add, aten.add.Tensor}),
}


def arithmetic_operands(gm: nn.Module, node: fx.Node, kind: str) -> tuple[Any, Any] | None:
    """The operands of a plain binary ``kind`` ("mul", "div", "add") with no alpha/rounding mode, else None."""
    methods, targets = _ARITHMETIC[kind]
    if len(node.args) != 2 or node.kwargs or not is_call_to(gm, node, methods, targets):
        return None
    return node.args[0], node.args[1]

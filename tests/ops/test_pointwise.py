"""The activation table: activation_view, is_unary_pointwise and pointwise_view recognise what they always have.

graphopt/ops.py (before it became a package) listed activations in six tables. The
``OLD_*`` constants below are those tables, copied; every entry must still be
recognised by the same function, with the same kind and parameters, and nothing else.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt import ops

aten = torch.ops.aten

OLD_ACTIVATION_PARAMETERS: dict[str, dict[str, Any]] = {
    "relu": {}, "silu": {}, "hardswish": {}, "sigmoid": {}, "tanh": {}, "hardsigmoid": {},
    "hardtanh": {"min_val": -1.0, "max_val": 1.0}, "gelu": {"approximate": "none"}, "leaky_relu": {"negative_slope": 0.01},
}  # fmt: skip
OLD_ACTIVATION_MODULES: dict[type[nn.Module], str] = {
    nn.ReLU: "relu", nn.ReLU6: "hardtanh", nn.Hardtanh: "hardtanh", nn.SiLU: "silu", nn.GELU: "gelu",
    nn.Hardswish: "hardswish", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Hardsigmoid: "hardsigmoid", nn.LeakyReLU: "leaky_relu",
}  # fmt: skip
# target -> (kind, argument names after the input)
OLD_ACTIVATION_FUNCTIONS: dict[Any, tuple[str, tuple[str, ...]]] = {
    F.relu: ("relu", ("inplace",)), torch.relu: ("relu", ()), aten.relu.default: ("relu", ()), aten.relu_.default: ("relu", ()),
    aten.hardtanh_.default: ("hardtanh", ("min_val", "max_val")), aten.silu_.default: ("silu", ()),
    aten.hardswish_.default: ("hardswish", ()), aten.hardsigmoid_.default: ("hardsigmoid", ()),
    aten.leaky_relu_.default: ("leaky_relu", ("negative_slope",)),
    F.relu6: ("relu6", ("inplace",)), aten.relu6.default: ("relu6", ()), F.hardtanh: ("hardtanh", ("min_val", "max_val", "inplace")),
    aten.hardtanh.default: ("hardtanh", ("min_val", "max_val")),
    F.silu: ("silu", ("inplace",)), aten.silu.default: ("silu", ()),
    F.gelu: ("gelu", ("approximate",)), aten.gelu.default: ("gelu", ("approximate",)),
    F.hardswish: ("hardswish", ("inplace",)), aten.hardswish.default: ("hardswish", ()),
    torch.sigmoid: ("sigmoid", ()), F.sigmoid: ("sigmoid", ()), aten.sigmoid.default: ("sigmoid", ()),
    torch.tanh: ("tanh", ()), F.tanh: ("tanh", ()), aten.tanh.default: ("tanh", ()),
    F.hardsigmoid: ("hardsigmoid", ("inplace",)), aten.hardsigmoid.default: ("hardsigmoid", ()),
    F.leaky_relu: ("leaky_relu", ("negative_slope", "inplace")), aten.leaky_relu.default: ("leaky_relu", ("negative_slope",)),
}  # fmt: skip
OLD_ACTIVATION_METHODS = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}
OLD_UNARY_METHODS = ("relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "mish", "clamp")
OLD_UNARY_TARGETS = (
    torch.relu, F.relu, F.relu6, F.gelu, F.silu, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.hardswish,
    F.hardsigmoid, F.leaky_relu, F.elu, F.mish, torch.clamp, F.hardtanh,
    aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.leaky_relu.default, aten.elu.default, aten.mish.default,
    aten.clamp.default, aten.hardtanh.default,
)  # fmt: skip
OLD_UNARY_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Hardtanh)
OLD_POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.abs, torch.exp, torch.sqrt, torch.rsqrt,
    torch.pow, torch.clamp, torch.clip, torch.maximum, torch.minimum, torch.where, torch.erf, torch.reciprocal,
    torch.relu, torch.sigmoid, torch.tanh,
    F.relu, F.relu6, F.gelu, F.silu, F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.leaky_relu, F.elu,
    F.softplus, F.sigmoid, F.tanh,
}  # fmt: skip
OLD_POINTWISE_METHODS = {
    "add", "sub", "mul", "div", "neg", "abs", "exp", "sqrt", "rsqrt", "pow", "clamp", "clip", "erf", "reciprocal",
    "relu", "sigmoid", "tanh",
}  # fmt: skip
# activation module -> (the functional call pointwise_view.to_function makes, its kwargs by module attribute)
OLD_ACTIVATION_CALLS: dict[type[nn.Module], tuple[Any, tuple[str, ...]]] = {
    nn.ReLU: (F.relu, ()), nn.ReLU6: (F.relu6, ()), nn.GELU: (F.gelu, ("approximate",)), nn.SiLU: (F.silu, ()),
    nn.Mish: (F.mish, ()), nn.Hardswish: (F.hardswish, ()), nn.Hardsigmoid: (F.hardsigmoid, ()),
    nn.Hardtanh: (F.hardtanh, ("min_val", "max_val")), nn.LeakyReLU: (F.leaky_relu, ("negative_slope",)),
    nn.ELU: (F.elu, ("alpha",)), nn.Sigmoid: (torch.sigmoid, ()), nn.Tanh: (torch.tanh, ()),
}  # fmt: skip

# non-default values for every parameter an activation takes
VALUES = {"min_val": -2.0, "max_val": 3.0, "approximate": "tanh", "negative_slope": 0.2, "alpha": 0.5, "inplace": False}
RELU6 = {"min_val": 0.0, "max_val": 6.0}


class SubclassedReLU(nn.ReLU):
    """A subclass may override forward(): activation_view and pointwise_view do not take it, is_unary_pointwise does."""


def module_instance(cls: type[nn.Module]) -> nn.Module:
    """``cls`` with a non-default value for each parameter of VALUES it takes."""
    names = set(inspect.signature(cls).parameters) - {"inplace"}
    return cls(**{name: VALUES[name] for name in names if name in VALUES})


def stable_id(target: Any) -> str:
    """A test id that names a function by where it lives, not by its address (the same in every process)."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', None) or type(target).__name__}.{target.__name__}"


def node_of(op: str, target: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, module: nn.Module | None = None) -> tuple[fx.GraphModule, fx.Node]:
    """A graph calling ``target`` (or ``module``) on a placeholder ``x``, with further ``args``/``kwargs``."""
    root = nn.Module()
    if module is not None:
        root.m = module
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.create_node(op, "m" if module is not None else target, (x, *args), kwargs or {})
    graph.output(node)
    return fx.GraphModule(root, graph), node


def old_kind(kind: str, parameters: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The kind and parameters the old activation_view reported for a function entry of ``kind``."""
    return ("hardtanh", RELU6) if kind == "relu6" else (kind, parameters)


# every spelling any of the tables names, and some no table names
TARGETS = {
    *OLD_ACTIVATION_FUNCTIONS, *OLD_UNARY_TARGETS, *(f for f in OLD_POINTWISE_FUNCTIONS if f.__module__ != "_operator"),
    *(target for row in ops.ACTIVATIONS for target in (*row.functions, *row.aten, *row.fused_aten)),
    aten.gelu_.default, aten.sigmoid_.default, aten.tanh_.default, aten.elu_.default, aten.mish_.default, aten.clamp_.default,
    F.softplus, F.relu_, F.hardtanh_, F.elu_, torch.relu_, aten.softplus.default,
}  # fmt: skip
METHODS = {*OLD_ACTIVATION_METHODS, *OLD_UNARY_METHODS, *OLD_POINTWISE_METHODS, "hardtanh", "softplus", "relu_", "clamp_", "sigmoid_"}
MODULES = {*OLD_ACTIVATION_MODULES, *OLD_UNARY_MODULES, *OLD_ACTIVATION_CALLS, nn.Softplus, nn.PReLU, nn.Softmax, SubclassedReLU}


# --------------------------------------------------------------------------- activation_view


@pytest.mark.parametrize("target", list(OLD_ACTIVATION_FUNCTIONS), ids=stable_id)
def test_activation_view_reads_every_old_function_entry(target: Any) -> None:
    kind, names = OLD_ACTIVATION_FUNCTIONS[target]
    view = ops.activation_view(*node_of("call_function", target))
    assert (view.kind, view.parameters) == old_kind(kind, OLD_ACTIVATION_PARAMETERS.get(kind, {}))
    assert view.input.op == "placeholder"
    given = {name: VALUES[name] for name in names}
    expected = old_kind(kind, {name: given[name] for name in OLD_ACTIVATION_PARAMETERS.get(kind, {})})
    positional = ops.activation_view(*node_of("call_function", target, tuple(given.values())))
    keyword = ops.activation_view(*node_of("call_function", target, (), given))
    assert (positional.kind, positional.parameters) == (keyword.kind, keyword.parameters) == expected


@pytest.mark.parametrize("cls", list(OLD_ACTIVATION_MODULES), ids=lambda cls: cls.__name__)
def test_activation_view_reads_every_old_module_entry(cls: type[nn.Module]) -> None:
    module = module_instance(cls)
    view = ops.activation_view(*node_of("call_module", None, module=module))
    kind = OLD_ACTIVATION_MODULES[cls]
    parameters = RELU6 if cls is nn.ReLU6 else {name: getattr(module, name) for name in OLD_ACTIVATION_PARAMETERS[kind]}
    assert (view.kind, view.parameters) == (kind, parameters)
    assert ops.activation_view(*node_of("call_module", None, (1.0,), module=module)) is None  # one input only


@pytest.mark.parametrize("method", list(OLD_ACTIVATION_METHODS))
def test_activation_view_reads_every_old_method_entry(method: str) -> None:
    view = ops.activation_view(*node_of("call_method", method))
    assert (view.kind, view.parameters) == (OLD_ACTIVATION_METHODS[method], {})
    assert ops.activation_view(*node_of("call_method", method, (), {"out": None})) is None


def test_activation_view_recognises_nothing_else() -> None:
    assert {t for t in TARGETS if ops.activation_view(*node_of("call_function", t))} == set(OLD_ACTIVATION_FUNCTIONS)
    assert {m for m in METHODS if ops.activation_view(*node_of("call_method", m))} == set(OLD_ACTIVATION_METHODS)
    assert {cls for cls in MODULES if ops.activation_view(*node_of("call_module", None, module=module_instance(cls)))} == set(OLD_ACTIVATION_MODULES)


# --------------------------------------------------------------------------- is_unary_pointwise


def test_is_unary_pointwise_recognises_exactly_the_old_entries() -> None:
    assert {t for t in TARGETS if ops.is_unary_pointwise(*node_of("call_function", t))} == set(OLD_UNARY_TARGETS)
    assert {m for m in METHODS if ops.is_unary_pointwise(*node_of("call_method", m))} == set(OLD_UNARY_METHODS)
    modules = {cls for cls in MODULES if ops.is_unary_pointwise(*node_of("call_module", None, module=module_instance(cls)))}
    assert modules == {*OLD_UNARY_MODULES, SubclassedReLU}  # by isinstance


def test_the_views_differ_where_they_always_have() -> None:
    """ELU, Mish and clamp are unary pointwise but not fused; in-place ATen ops and aten.relu6 only activation_view reads."""
    for target in (F.elu, aten.mish.default, torch.clamp):
        gm, node = node_of("call_function", target)
        assert ops.is_unary_pointwise(gm, node) and ops.activation_view(gm, node) is None
    for target in (aten.relu_.default, aten.hardtanh_.default, aten.relu6.default):
        gm, node = node_of("call_function", target)
        assert ops.activation_view(gm, node) is not None and not ops.is_unary_pointwise(gm, node)


# --------------------------------------------------------------------------- pointwise_view


def test_pointwise_view_recognises_exactly_the_old_functions_and_methods() -> None:
    functions = TARGETS - {t for t in TARGETS if isinstance(t, torch._ops.OpOverload)}
    operators = {f for f in OLD_POINTWISE_FUNCTIONS if f.__module__ == "_operator"}
    recognised = {f for f in functions | operators if ops.pointwise_view(*node_of("call_function", f, (2.0,)))}
    assert recognised == OLD_POINTWISE_FUNCTIONS
    in_place = {m + "_" for m in OLD_POINTWISE_METHODS}
    methods = {m for m in METHODS | in_place if ops.pointwise_view(*node_of("call_method", m, (2.0,)))}
    assert methods == OLD_POINTWISE_METHODS | in_place


@pytest.mark.parametrize(
    ("cls", "inplace"),
    [(cls, False) for cls in OLD_ACTIVATION_CALLS] + [(cls, True) for cls in OLD_ACTIVATION_CALLS if "inplace" in inspect.signature(cls).parameters],
    ids=lambda value: value.__name__ if isinstance(value, type) else "in_place" if value else "out_of_place",
)
def test_pointwise_view_rewrites_every_old_module_as_its_old_call(cls: type[nn.Module], inplace: bool) -> None:
    module = module_instance(cls)
    if inplace:
        module.inplace = True
    gm, node = node_of("call_module", None, module=module)
    view = ops.pointwise_view(gm, node)
    assert (view.form, view.in_place) == ("module", inplace)
    view.to_function(gm)
    function, attributes = OLD_ACTIVATION_CALLS[cls]
    assert (node.op, node.target, node.kwargs) == ("call_function", function, {name: getattr(module, name) for name in attributes})


def test_pointwise_view_takes_activation_modules_by_exact_type() -> None:
    recognised = {cls for cls in MODULES if ops.pointwise_view(*node_of("call_module", None, module=module_instance(cls)))}
    assert recognised == set(OLD_ACTIVATION_CALLS)


@pytest.mark.parametrize(
    ("target", "args", "kwargs"),
    [(F.relu, (True,), {}), (F.hardtanh, (-1.0, 1.0, True), {}), (F.leaky_relu, (), {"inplace": True})],
    ids=["relu_positional", "hardtanh_positional", "leaky_relu_keyword"],
)
def test_pointwise_view_to_function_clears_an_inplace_flag(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    gm, node = node_of("call_function", target, args, kwargs)
    view = ops.pointwise_view(gm, node)
    assert view.in_place
    view.to_function(gm)
    assert ops.call_arguments(node).get("inplace") is False


class GraphValuedActivation(nn.Module):
    """``call(x, value)``: an activation whose parameter or inplace flag is passed to forward() (a placeholder under fx)."""

    def __init__(self, call: Any) -> None:
        super().__init__()
        self.call = call

    def forward(self, x: torch.Tensor, value: Any) -> torch.Tensor:
        return self.call(x * 2, value)


@pytest.mark.parametrize(
    ("call", "argument"),
    [(lambda x, slope: F.leaky_relu(x, slope), "negative_slope"), (lambda x, low: F.hardtanh(x, low, 2.0), "min_val")],
    ids=["leaky_relu", "hardtanh"],
)
def test_activation_view_with_a_graph_valued_parameter_is_unsupported(call: Any, argument: str) -> None:
    gm = fx.symbolic_trace(GraphValuedActivation(call))
    view = next(view for node in gm.graph.nodes if (view := ops.activation_view(gm, node)) is not None)
    assert view.parameters == {}  # nothing to fuse with: the value is known only at run time
    assert view.unsupported == f"the {argument} argument of '{view.node.name}' is forward() argument 'value', not a constant: graphopt cannot read it when optimizing"


def test_pointwise_view_reads_a_graph_valued_inplace_flag_as_in_place() -> None:
    """The flag may be True at run time: reading it as in place keeps the write where a pass would drop it."""
    gm = fx.symbolic_trace(GraphValuedActivation(lambda x, flag: F.relu(x, inplace=flag)))
    relu = next(node for node in gm.graph.nodes if node.target is F.relu)
    assert ops.pointwise_view(gm, relu).in_place

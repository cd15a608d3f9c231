"""weighted_op_view: convolutions and linear layers in all three forms; reading and writing their parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from graphopt import ops
from tests.ops.helpers import FORMS, WEIGHTED_CASES, Wrap, build_weighted, export_module, graph_in, only_view, placeholder

aten = torch.ops.aten

EXPECTED_KIND = {
    "conv1d": "conv1d",
    "conv2d": "conv2d",
    "conv2d_groups": "conv2d",
    "conv2d_depthwise": "conv2d",
    "conv3d": "conv3d",
    "conv_transpose1d": "conv_transpose1d",
    "conv_transpose2d": "conv_transpose2d",
    "conv_transpose2d_groups": "conv_transpose2d",
    "linear": "linear",
}



def stored_parameters(model: nn.Module, form: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if form == "function":
        return model.weight, model.bias
    return model.layer.weight, model.layer.bias


# --------------------------------------------------------------------------- weighted_op_view


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(WEIGHTED_CASES))
def test_weighted_op_view_reads_kind_and_parameters(case: str, form: str, bias: bool) -> None:
    model, gm, x, _ = build_weighted(case, form, bias)
    _, _, _, _, spatial_dims, transposed, groups = WEIGHTED_CASES[case]
    view = only_view(gm, ops.weighted_op_view)

    assert view.form == form
    assert view.kind == EXPECTED_KIND[case]
    assert view.spatial_dims == spatial_dims
    assert view.transposed is transposed
    assert view.groups == groups
    assert view.unsupported is None
    assert view.input is placeholder(gm)

    weight, stored_bias = stored_parameters(model, form)
    if form == "aten":
        torch.testing.assert_close(view.weight, weight, rtol=0, atol=0)
    else:
        assert view.weight is weight
    assert ops.get_attr(gm, view.weight_target) is view.weight
    if bias:
        if form == "aten":
            torch.testing.assert_close(view.bias, stored_bias, rtol=0, atol=0)
        else:
            assert view.bias is stored_bias
        assert ops.get_attr(gm, view.bias_target) is view.bias
    else:
        assert view.bias is None
        assert view.bias_target is None


@pytest.mark.parametrize("form", FORMS)
def test_weighted_op_view_targets_name_the_stored_attributes(form: str) -> None:
    _, gm, _, _ = build_weighted("conv2d", form, bias=True)
    view = only_view(gm, ops.weighted_op_view)
    expected = {"module": ("layer.weight", "layer.bias"), "function": ("weight", "bias"), "aten": ("layer.weight", "layer.bias")}
    assert (view.weight_target, view.bias_target) == expected[form]
    assert view.module is (gm.layer if form == "module" else None)
    if form == "aten":
        assert view.node.target is aten.conv2d.default


def test_weighted_op_view_aten_targets() -> None:
    """Each rank exports to its own ATen overload; the view maps every one of them."""
    expected = {
        "conv1d": aten.conv1d.default,
        "conv2d": aten.conv2d.default,
        "conv3d": aten.conv3d.default,
        "conv_transpose1d": aten.conv_transpose1d.default,
        "conv_transpose2d": aten.conv_transpose2d.input,
        "linear": aten.linear.default,
    }
    for case, target in expected.items():
        _, gm, _, _ = build_weighted(case, "aten", bias=True)
        assert only_view(gm, ops.weighted_op_view).node.target is target, case


def test_weighted_op_view_conv_with_string_padding_in_aten_form() -> None:
    torch.manual_seed(0)
    gm = export_module(Wrap(nn.Conv2d(3, 4, 3, padding="same")), torch.randn(2, 3, 6, 6))
    view = only_view(gm, ops.weighted_op_view)
    assert view.node.target is aten.conv2d.padding
    assert (view.kind, view.unsupported) == ("conv2d", None)


@pytest.mark.parametrize(
    ("layer", "shape", "kind", "groups"),
    [
        (nn.Conv2d(4, 6, 3, groups=2), (2, 4, 5, 5), "conv2d", 2),
        (nn.ConvTranspose1d(4, 2, 3, groups=2), (2, 4, 6), "conv_transpose1d", 2),
        (nn.Conv3d(2, 3, 2), (1, 2, 3, 3, 3), "conv3d", 1),
    ],
    ids=["conv2d", "conv_transpose1d", "conv3d"],
)
def test_weighted_op_view_reads_generic_aten_convolution(layer: nn.Module, shape: tuple[int, ...], kind: str, groups: int) -> None:
    """Decomposed exports spell every convolution aten.convolution: rank and kind come from its arguments."""
    gm = torch.export.export(Wrap(layer).eval(), (torch.randn(shape),)).run_decompositions().module()
    view = only_view(gm, ops.weighted_op_view)
    assert view.node.target is aten.convolution.default
    assert (view.kind, view.groups, view.unsupported) == (kind, groups, None)
    torch.testing.assert_close(view.bias, layer.bias, rtol=0, atol=0)


class ConvWithOwnForward(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class ConvSubclassKeepingForward(nn.Conv2d):
    """A subclass that only adds state: it computes exactly what nn.Conv2d computes."""

    tag = "plain"


class LeafTracer(fx.Tracer):
    """Keeps user-defined conv subclasses as call_module nodes (the default tracer would inline them)."""

    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return isinstance(module, nn.Conv2d) or super().is_leaf_module(module, qualname)


def trace_with_leaf_convs(model: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(model, LeafTracer().trace(model))


def test_conv_subclass_overriding_forward_is_unsupported() -> None:
    gm = trace_with_leaf_convs(Wrap(ConvWithOwnForward(3, 4, 3)))
    view = only_view(gm, ops.weighted_op_view)
    assert view.kind == "conv2d"
    assert view.unsupported is not None
    assert "overrides forward()" in view.unsupported
    assert "layer" in view.unsupported


def test_conv_subclass_keeping_forward_is_supported() -> None:
    gm = trace_with_leaf_convs(Wrap(ConvSubclassKeepingForward(3, 4, 3)))
    view = only_view(gm, ops.weighted_op_view)
    assert view.node.op == "call_module"
    assert view.unsupported is None


class Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


@pytest.mark.parametrize(
    "parametrize_conv",
    [
        pytest.param(lambda conv: torch.nn.utils.parametrizations.weight_norm(conv), id="weight_norm"),
        pytest.param(lambda conv: parametrize.register_parametrization(conv, "weight", Doubled()), id="custom"),
    ],
)
def test_parametrized_conv_is_unsupported(parametrize_conv: Callable[[nn.Module], Any]) -> None:
    conv = nn.Conv2d(3, 4, 3)
    parametrize_conv(conv)
    gm = fx.symbolic_trace(Wrap(conv))
    view = only_view(gm, ops.weighted_op_view)
    assert view.node.op == "call_module"
    assert view.unsupported is not None and "parametrized" in view.unsupported


def test_conv_with_reflect_padding_is_unsupported() -> None:
    gm = fx.symbolic_trace(Wrap(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")))
    view = only_view(gm, ops.weighted_op_view)
    assert view.unsupported is not None and "padding_mode='reflect'" in view.unsupported


class ComputedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.w * 2)


class ComputedBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.w, self.b + 1)


@pytest.mark.parametrize("form", ["function", "aten"])
@pytest.mark.parametrize(("model_class", "role"), [(ComputedWeight, "weight"), (ComputedBias, "bias")], ids=["weight", "bias"])
def test_functional_conv_with_a_computed_parameter_is_unsupported(model_class: type[nn.Module], role: str, form: str) -> None:
    torch.manual_seed(0)
    model, x = model_class(), torch.randn(2, 3, 5, 5)
    gm = graph_in(form, model, x)
    view = only_view(gm, ops.weighted_op_view)
    assert view.kind == "conv2d"
    assert getattr(view, role) is None and getattr(view, f"{role}_target") is None
    assert view.unsupported is not None and f"the {role} of" in view.unsupported and "computed in the graph" in view.unsupported
    if role == "bias":
        assert ops.get_attr(gm, view.weight_target) is view.weight


class ConvReluNet(nn.Module):
    """A conv, then ReLU written as a module and as a function: relus must match no view."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize("form", ["module", "aten"])
def test_views_ignore_nodes_of_other_families(form: str) -> None:
    model, x = ConvReluNet().eval(), torch.randn(2, 3, 6, 6)
    gm = graph_in(form, model, x)
    weighted = only_view(gm, ops.weighted_op_view)
    norm = only_view(gm, ops.batch_norm_view)
    assert weighted.node is not norm.node
    # a conv is not a batch norm nor a dropout, and vice versa
    assert ops.batch_norm_view(gm, weighted.node) is None and ops.dropout_view(gm, weighted.node) is None
    assert ops.weighted_op_view(gm, norm.node) is None and ops.dropout_view(gm, norm.node) is None
    others = [n for n in gm.graph.nodes if n not in (weighted.node, norm.node)]
    assert any(n.op == "placeholder" for n in others) and any(n.op == "output" for n in others)
    relus = [n for n in others if "relu" in n.name]
    assert len(relus) == 2
    for node in others:
        for view_fn in (ops.weighted_op_view, ops.batch_norm_view, ops.dropout_view):
            assert view_fn(gm, node) is None, (view_fn.__name__, node.format_node())


# --------------------------------------------------------------------------- writing parameters


def reference(case: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _, _, fn, kwargs, *_ = WEIGHTED_CASES[case]
    return fn(x, weight, bias, **kwargs)


WRITE_CASES = ["conv2d", "conv2d_groups", "conv_transpose2d", "conv1d", "linear"]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", WRITE_CASES)
def test_set_weight_changes_what_the_graph_computes(case: str, form: str, bias: bool) -> None:
    _, gm, x, layer = build_weighted(case, form, bias)
    view = only_view(gm, ops.weighted_op_view)
    old_bias = None if layer.bias is None else layer.bias.detach().clone()
    new_weight = torch.randn_like(layer.weight)

    view.set_weight(gm, new_weight)
    gm.recompile()

    stored = ops.get_attr(gm, view.weight_target)
    assert isinstance(stored, nn.Parameter) and stored.requires_grad
    assert view.weight is stored
    torch.testing.assert_close(stored.detach(), new_weight, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), reference(case, x, new_weight, old_bias))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", WRITE_CASES)
def test_set_bias_changes_what_the_graph_computes(case: str, form: str, bias: bool) -> None:
    _, gm, x, layer = build_weighted(case, form, bias)
    weight = layer.weight.detach().clone()
    view = only_view(gm, ops.weighted_op_view)
    out_channels = weight.shape[1] * view.groups if view.transposed else weight.shape[0]
    new_bias = torch.randn(out_channels)

    view.set_bias(gm, new_bias)
    gm.graph.lint()
    gm.recompile()

    assert view.bias_target is not None
    stored = ops.get_attr(gm, view.bias_target)
    assert isinstance(stored, nn.Parameter)
    assert view.bias is stored
    assert dict(gm.named_parameters())[view.bias_target] is stored
    torch.testing.assert_close(stored.detach(), new_bias, rtol=0, atol=0)
    if form == "module":
        assert view.bias_target == "layer.bias"
        assert gm.layer.bias is stored
    else:
        # the op reads the parameter through a get_attr node
        bias_arg = view.arguments.get("bias")
        assert isinstance(bias_arg, fx.Node) and bias_arg.op == "get_attr"
        assert bias_arg.target == view.bias_target
    with torch.no_grad():
        torch.testing.assert_close(gm(x), reference(case, x, weight, new_bias))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", WRITE_CASES)
def test_remove_bias_drops_the_parameter(case: str, form: str) -> None:
    _, gm, x, layer = build_weighted(case, form, bias=True)
    weight = layer.weight.detach().clone()
    view = only_view(gm, ops.weighted_op_view)
    bias_target = view.bias_target
    assert bias_target in dict(gm.named_parameters())

    view.remove_bias(gm)
    gm.graph.lint()
    gm.recompile()

    assert view.bias is None and view.bias_target is None
    assert bias_target not in dict(gm.named_parameters())
    assert not any(n.op == "get_attr" and n.target == bias_target for n in gm.graph.nodes)
    again = only_view(gm, ops.weighted_op_view)
    assert again.bias is None and again.unsupported is None
    with torch.no_grad():
        torch.testing.assert_close(gm(x), reference(case, x, weight, None))


@pytest.mark.parametrize("form", FORMS)
def test_set_bias_after_remove_bias_restores_a_bias(form: str) -> None:
    _, gm, x, layer = build_weighted("conv2d", form, bias=True)
    weight = layer.weight.detach().clone()
    view = only_view(gm, ops.weighted_op_view)
    view.remove_bias(gm)
    new_bias = torch.randn(4)
    view.set_bias(gm, new_bias)
    gm.graph.lint()
    gm.recompile()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), reference("conv2d", x, weight, new_bias))


class BufferWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.randn(4, 3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.w)


def test_set_weight_and_set_bias_keep_a_buffer_a_buffer() -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(BufferWeight())
    x, new_weight, new_bias = torch.randn(1, 3, 5, 5), torch.randn(4, 3, 3, 3), torch.randn(4)
    view = only_view(gm, ops.weighted_op_view)
    view.set_weight(gm, new_weight)
    view.set_bias(gm, new_bias)
    gm.recompile()
    assert set(dict(gm.named_buffers())) == {"w", view.bias_target}
    assert not dict(gm.named_parameters())
    torch.testing.assert_close(gm(x), F.conv2d(x, new_weight, new_bias))


@pytest.mark.parametrize("form", FORMS)
def test_set_weight_and_set_bias_keep_requires_grad_of_the_weight(form: str) -> None:
    model, gm, _, layer = build_weighted("conv2d", form, bias=False)
    view = only_view(gm, ops.weighted_op_view)
    view.weight.requires_grad_(False)
    view.set_weight(gm, torch.randn_like(layer.weight))
    view.set_bias(gm, torch.randn(4))
    assert isinstance(view.weight, nn.Parameter) and isinstance(view.bias, nn.Parameter)
    assert not view.weight.requires_grad and not view.bias.requires_grad


class GraphValuedGeometry(nn.Module):
    """F.conv2d with its groups or its stride passed to forward() (fx keeps it a placeholder)."""

    def __init__(self, argument: str) -> None:
        super().__init__()
        self.argument = argument
        self.weight = nn.Parameter(torch.randn(4, 2, 3, 3))

    def forward(self, x: torch.Tensor, value: int) -> torch.Tensor:
        return F.conv2d(x, self.weight, **{"groups": 2, self.argument: value})


def test_weighted_op_view_with_graph_valued_groups_is_unsupported() -> None:
    view = only_view(fx.symbolic_trace(GraphValuedGeometry("groups")), ops.weighted_op_view)
    assert view.groups is None
    assert view.unsupported == "the groups argument of 'conv2d' is forward() argument 'value', not a constant: graphopt cannot read it when optimizing"


def test_weighted_op_view_leaves_a_graph_valued_stride_to_the_passes_that_read_it() -> None:
    """Folding a BatchNorm or casting the weight needs no stride; a pass handing the op to another kernel asks."""
    view = only_view(fx.symbolic_trace(GraphValuedGeometry("stride")), ops.weighted_op_view)
    assert view.unsupported is None and view.groups == 2
    assert view.arguments is not None
    assert view.arguments.not_constant("stride", "padding", "dilation") == (
        "the stride argument of 'conv2d' is forward() argument 'value', not a constant: graphopt cannot read it when optimizing"
    )

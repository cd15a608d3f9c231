"""Tests of graphopt.ops: each op view recognises its family in all three graph forms.

The forms are ``module`` (torch.fx.symbolic_trace of ``self.conv(x)``), ``function``
(symbolic_trace of ``F.conv2d(x, self.weight, ...)`` with the parameters stored on the
module) and ``aten`` (``torch.export.export(model, args).module()``). Models are tiny
and hand-built so that every expectation can be computed by hand.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn.utils import parametrize

from graphopt import ops

aten = torch.ops.aten

FORMS = ("module", "function", "aten")


# --------------------------------------------------------------------------- helpers


def export_module(model: nn.Module, *args: torch.Tensor) -> fx.GraphModule:
    return torch.export.export(model, args).module()


def views(gm: fx.GraphModule, view_fn: Callable[[fx.GraphModule, fx.Node], Any]) -> list[Any]:
    return [view for node in gm.graph.nodes if (view := view_fn(gm, node)) is not None]


def only_view(gm: fx.GraphModule, view_fn: Callable[[fx.GraphModule, fx.Node], Any]) -> Any:
    found = views(gm, view_fn)
    assert len(found) == 1, f"expected one match, found {[v.node.name for v in found]} in\n{gm.graph}"
    return found[0]


def placeholder(gm: fx.GraphModule) -> fx.Node:
    return next(node for node in gm.graph.nodes if node.op == "placeholder")


class Wrap(nn.Module):
    """Calls one layer: ``self.layer(x)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class Functional(nn.Module):
    """Calls ``fn(x, self.weight, self.bias, **kwargs)`` with parameters stored on this module."""

    def __init__(self, fn: Callable[..., torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None, **kwargs: Any) -> None:
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(weight.detach().clone())
        if bias is None:
            self.bias = None
        else:
            self.bias = nn.Parameter(bias.detach().clone())
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias, **self.kwargs)


# name -> (layer factory, input shape, functional, functional kwargs, spatial dims, transposed, groups)
WEIGHTED_CASES: dict[str, tuple[Callable[[bool], nn.Module], tuple[int, ...], Callable[..., torch.Tensor], dict[str, Any], int, bool, int]] = {
    "conv1d": (lambda bias: nn.Conv1d(4, 6, 3, padding=1, bias=bias), (2, 4, 8), F.conv1d, {"padding": 1}, 1, False, 1),
    "conv2d": (lambda bias: nn.Conv2d(3, 4, 3, padding=1, bias=bias), (2, 3, 6, 6), F.conv2d, {"padding": 1}, 2, False, 1),
    "conv2d_groups": (lambda bias: nn.Conv2d(4, 8, 3, groups=2, bias=bias), (2, 4, 6, 6), F.conv2d, {"groups": 2}, 2, False, 2),
    "conv2d_depthwise": (lambda bias: nn.Conv2d(4, 4, 3, groups=4, padding=1, bias=bias), (2, 4, 5, 5), F.conv2d, {"padding": 1, "groups": 4}, 2, False, 4),
    "conv3d": (lambda bias: nn.Conv3d(2, 4, 3, padding=1, bias=bias), (2, 2, 4, 4, 4), F.conv3d, {"padding": 1}, 3, False, 1),
    "conv_transpose1d": (lambda bias: nn.ConvTranspose1d(4, 2, 3, stride=2, bias=bias), (2, 4, 5), F.conv_transpose1d, {"stride": 2}, 1, True, 1),
    "conv_transpose2d": (lambda bias: nn.ConvTranspose2d(4, 2, 3, stride=2, bias=bias), (2, 4, 4, 4), F.conv_transpose2d, {"stride": 2}, 2, True, 1),
    "conv_transpose2d_groups": (lambda bias: nn.ConvTranspose2d(4, 6, 3, groups=2, bias=bias), (2, 4, 4, 4), F.conv_transpose2d, {"groups": 2}, 2, True, 2),
    "linear": (lambda bias: nn.Linear(6, 5, bias=bias), (2, 6), F.linear, {}, 0, False, 1),
}
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


def build_weighted(case: str, form: str, bias: bool, seed: int = 0) -> tuple[nn.Module, fx.GraphModule, torch.Tensor, nn.Module]:
    """(model, its graph in ``form``, an input, the layer whose parameters it uses)."""
    factory, shape, fn, kwargs, *_ = WEIGHTED_CASES[case]
    torch.manual_seed(seed)
    layer = factory(bias)
    x = torch.randn(shape)
    if form == "function":
        model: nn.Module = Functional(fn, layer.weight, layer.bias, **kwargs)
    else:
        model = Wrap(layer)
    model.eval()
    gm = export_module(model, x) if form == "aten" else fx.symbolic_trace(model)
    return model, gm, x, layer


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
def test_functional_conv_with_computed_weight_is_unsupported(form: str) -> None:
    torch.manual_seed(0)
    model, x = ComputedWeight(), torch.randn(2, 3, 5, 5)
    gm = export_module(model, x) if form == "aten" else fx.symbolic_trace(model)
    view = only_view(gm, ops.weighted_op_view)
    assert view.kind == "conv2d"
    assert view.weight is None and view.weight_target is None
    assert view.unsupported is not None and "weight" in view.unsupported and "computed in the graph" in view.unsupported


@pytest.mark.parametrize("form", ["function", "aten"])
def test_functional_conv_with_computed_bias_is_unsupported(form: str) -> None:
    torch.manual_seed(0)
    model, x = ComputedBias(), torch.randn(2, 3, 5, 5)
    gm = export_module(model, x) if form == "aten" else fx.symbolic_trace(model)
    view = only_view(gm, ops.weighted_op_view)
    assert ops.get_attr(gm, view.weight_target) is view.weight
    assert view.bias is None and view.bias_target is None
    assert view.unsupported is not None and "bias" in view.unsupported


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
    gm = export_module(model, x) if form == "aten" else fx.symbolic_trace(model)
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


# --------------------------------------------------------------------------- batch_norm_view


BN_CASES = {
    "bn1d": (lambda **kw: nn.BatchNorm1d(4, **kw), (3, 4, 5)),
    "bn1d_2d_input": (lambda **kw: nn.BatchNorm1d(4, **kw), (3, 4)),
    "bn2d": (lambda **kw: nn.BatchNorm2d(4, **kw), (3, 4, 3, 3)),
    "bn3d": (lambda **kw: nn.BatchNorm3d(4, **kw), (3, 4, 2, 2, 2)),
}


def with_statistics(bn: nn.Module) -> nn.Module:
    """Give a BatchNorm non-trivial statistics and affine parameters, so identity checks mean something."""
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.copy_(torch.randn(bn.num_features))
            bn.running_var.copy_(torch.rand(bn.num_features) + 0.5)
        if bn.weight is not None:
            bn.weight.copy_(torch.randn(bn.num_features))
            bn.bias.copy_(torch.randn(bn.num_features))
    return bn


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", list(BN_CASES))
def test_batch_norm_view_module_form(case: str, training: bool) -> None:
    torch.manual_seed(0)
    factory, _ = BN_CASES[case]
    bn = with_statistics(factory(eps=1e-3))
    gm = fx.symbolic_trace(Wrap(bn).train(training))
    view = only_view(gm, ops.batch_norm_view)

    assert view.form == "module"
    assert view.module is bn
    assert view.training is training
    assert view.eps == pytest.approx(1e-3)
    assert view.num_features == 4
    assert view.input is placeholder(gm)
    assert view.output is view.node
    assert view.weight is bn.weight and view.bias is bn.bias
    assert view.running_mean is bn.running_mean and view.running_var is bn.running_var
    assert view.running_mean_target == "layer.running_mean"
    assert ops.get_attr(gm, view.running_mean_target) is bn.running_mean
    assert view.running_mean is not None
    assert view.unsupported is None


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_batch_norm_without_running_stats_always_uses_batch_statistics(training: bool) -> None:
    gm = fx.symbolic_trace(Wrap(nn.BatchNorm2d(4, track_running_stats=False)).train(training))
    view = only_view(gm, ops.batch_norm_view)
    assert view.training is True
    assert view.running_mean is None and view.running_var is None and view.running_mean_target is None
    assert view.running_mean is None


def test_batch_norm_without_affine_parameters() -> None:
    gm = fx.symbolic_trace(Wrap(nn.BatchNorm2d(4, affine=False)).eval())
    view = only_view(gm, ops.batch_norm_view)
    assert view.weight is None and view.bias is None
    assert view.training is False and view.running_mean is not None


class FunctionalBatchNorm(nn.Module):
    def __init__(self, training: bool, affine: bool = True) -> None:
        super().__init__()
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)
        self.gamma = nn.Parameter(torch.randn(4)) if affine else None
        self.beta = nn.Parameter(torch.randn(4)) if affine else None
        self.use_batch_stats = training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, self.gamma, self.beta, training=self.use_batch_stats, eps=1e-4)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_batch_norm_view_function_form(training: bool) -> None:
    torch.manual_seed(0)
    model = FunctionalBatchNorm(training)
    gm = fx.symbolic_trace(model)
    view = only_view(gm, ops.batch_norm_view)

    assert view.form == "function"
    assert view.training is training
    assert view.eps == pytest.approx(1e-4)
    assert view.num_features == 4
    assert view.running_mean is model.mean and view.running_var is model.var
    assert view.running_mean_target == "mean"
    assert view.weight is model.gamma and view.bias is model.beta
    assert view.output is view.node and view.input is placeholder(gm)
    assert view.running_mean is not None
    assert view.unsupported is None


def test_batch_norm_view_function_form_without_affine() -> None:
    gm = fx.symbolic_trace(FunctionalBatchNorm(training=False, affine=False))
    view = only_view(gm, ops.batch_norm_view)
    assert view.weight is None and view.bias is None and view.unsupported is None


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_batch_norm_view_aten_form(training: bool) -> None:
    torch.manual_seed(0)
    bn = with_statistics(nn.BatchNorm2d(4, eps=1e-3))
    model = Wrap(bn).train(training)
    expected_mean, expected_var = bn.running_mean.clone(), bn.running_var.clone()
    gm = export_module(model, torch.randn(3, 4, 3, 3))
    view = only_view(gm, ops.batch_norm_view)

    assert view.form == "aten"
    assert view.node.target is aten.batch_norm.default
    assert view.training is training
    assert view.eps == pytest.approx(1e-3)
    assert view.num_features == 4
    torch.testing.assert_close(view.running_mean, expected_mean, rtol=0, atol=0)
    torch.testing.assert_close(view.running_var, expected_var, rtol=0, atol=0)
    torch.testing.assert_close(view.weight, bn.weight, rtol=0, atol=0)
    torch.testing.assert_close(view.bias, bn.bias, rtol=0, atol=0)
    assert ops.get_attr(gm, view.running_mean_target) is view.running_mean
    assert view.output is view.node and view.input is placeholder(gm)
    assert view.running_mean is not None
    assert view.unsupported is None


def test_batch_norm_view_aten_form_without_running_stats() -> None:
    gm = export_module(Wrap(nn.BatchNorm2d(4, track_running_stats=False)).eval(), torch.randn(3, 4, 3, 3))
    view = only_view(gm, ops.batch_norm_view)
    assert view.training is True
    assert view.running_mean is None and view.num_features is None


def test_batch_norm_view_decomposed_aten_form_points_at_the_result_item() -> None:
    torch.manual_seed(0)
    bn = with_statistics(nn.BatchNorm2d(4, eps=1e-3))
    gm = torch.export.export(Wrap(bn).eval(), (torch.randn(3, 4, 3, 3),)).run_decompositions().module()
    view = only_view(gm, ops.batch_norm_view)
    assert view.node.target is aten._native_batch_norm_legit_no_training.default
    assert view.training is False and view.eps == pytest.approx(1e-3) and view.num_features == 4
    # the op returns a tuple: the normalised tensor is the getitem(…, 0) that reads it
    assert view.output is not view.node
    assert view.output.target is operator.getitem and view.output.args == (view.node, 0)
    torch.testing.assert_close(view.running_var, bn.running_var, rtol=0, atol=0)


# --------------------------------------------------------------------------- dropout_view


@pytest.mark.parametrize(
    ("layer", "training", "active", "kind"),
    [
        (nn.Dropout(0.1), False, False, "Dropout"),
        (nn.Dropout(0.1), True, True, "Dropout"),
        (nn.Dropout(0.0), True, False, "Dropout"),
        (nn.Dropout2d(0.2), False, False, "Dropout2d"),
        (nn.Dropout2d(0.2), True, True, "Dropout2d"),
        (nn.AlphaDropout(0.2), False, False, "AlphaDropout"),
        (nn.AlphaDropout(0.2), True, True, "AlphaDropout"),
        (nn.Identity(), False, False, "identity"),
        (nn.Identity(), True, False, "identity"),
    ],
    ids=lambda value: str(value).replace(" ", ""),
)
def test_dropout_view_module_form(layer: nn.Module, training: bool, active: bool, kind: str) -> None:
    gm = fx.symbolic_trace(Wrap(layer).train(training))
    view = only_view(gm, ops.dropout_view)
    assert view.form == "module"
    assert view.active is active
    assert view.kind == kind
    assert view.input is placeholder(gm)


class FunctionalDropout(nn.Module):
    def __init__(self, call: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)


@pytest.mark.parametrize(
    ("call", "active"),
    [
        pytest.param(lambda x: F.dropout(x, 0.1, training=False), False, id="training=False"),
        pytest.param(lambda x: F.dropout(x, 0.1), True, id="default_training"),
        pytest.param(lambda x: F.dropout(x, p=0.1, training=True), True, id="training=True"),
        pytest.param(lambda x: F.dropout(x, 0.0), False, id="p=0"),
        pytest.param(lambda x: F.dropout2d(x, 0.3, False), False, id="dropout2d_positional_false"),
        pytest.param(lambda x: F.alpha_dropout(x, 0.3, True), True, id="alpha_dropout_positional_true"),
    ],
)
def test_dropout_view_function_form(call: Callable[[torch.Tensor], torch.Tensor], active: bool) -> None:
    gm = fx.symbolic_trace(FunctionalDropout(call))
    view = only_view(gm, ops.dropout_view)
    assert view.form == "function"
    assert view.active is active
    assert view.input is placeholder(gm)


@pytest.mark.parametrize(
    ("args", "kwargs", "active"),
    [
        ((0.1,), {}, True),
        ((0.1, False), {}, False),
        ((), {"p": 0.1}, True),
        ((), {}, True),
        ((0.1,), {"training": False}, False),
    ],
    ids=["p_only", "positional_false", "keyword_p", "no_arguments", "keyword_false"],
)
def test_dropout_view_applies_functional_defaults_to_hand_built_nodes(args: tuple[Any, ...], kwargs: dict[str, Any], active: bool) -> None:
    """A pass may build ``F.dropout(x, 0.1)`` itself; omitted arguments take F.dropout's defaults (training=True)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(F.dropout, (x, *args), kwargs))
    gm = fx.GraphModule(nn.Module(), graph)
    assert only_view(gm, ops.dropout_view).active is active


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_dropout_view_aten_form(training: bool) -> None:
    gm = export_module(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).train(training), torch.randn(2, 4))
    view = only_view(gm, ops.dropout_view)
    assert view.form == "aten"
    assert view.node.target is aten.dropout.default
    assert view.active is training
    assert ops.weighted_op_view(gm, view.input) is not None  # the dropout reads the linear


def test_dropout_view_aten_form_keeps_functional_training_flag_of_an_eval_model() -> None:
    """F.dropout defaults to training=True, whatever the module's mode: export bakes it in."""
    gm = export_module(FunctionalDropout(lambda x: F.dropout(x, 0.1)).eval(), torch.randn(2, 4))
    view = only_view(gm, ops.dropout_view)
    assert view.active is True


# --------------------------------------------------------------------------- Arguments and tensor_meta


class PositionalAndKeywordConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 2, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, None, 1, padding=1)


CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def test_arguments_get_reads_positional_keyword_and_default_values() -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(PositionalAndKeywordConv())
    node = only_view(gm, ops.weighted_op_view).node
    assert node.args[3] == 1 and node.kwargs == {"padding": 1}  # the premise of this test
    arguments = ops.Arguments(node, CONV_NAMES, {"dilation": 1, "groups": 1})
    assert arguments.get("input") is placeholder(gm)
    assert arguments.get("weight").op == "get_attr"
    assert arguments.get("bias") is None
    assert arguments.get("stride") == 1
    assert arguments.get("padding") == 1
    assert arguments.get("dilation") == 1
    assert arguments.get("groups") == 1
    with pytest.raises(ValueError):
        arguments.get("no_such_argument")


def test_arguments_set_writes_positional_and_keyword_values() -> None:
    torch.manual_seed(0)
    model = PositionalAndKeywordConv()
    gm = fx.symbolic_trace(model)
    node = only_view(gm, ops.weighted_op_view).node
    arguments = ops.Arguments(node, CONV_NAMES, {"dilation": 1, "groups": 1})

    arguments.set("stride", 2)  # positional
    arguments.set("padding", 2)  # already a keyword
    arguments.set("dilation", 2)  # absent: becomes a keyword
    assert node.args[3] == 2 and len(node.args) == 4
    assert node.kwargs == {"padding": 2, "dilation": 2}
    assert (arguments.get("stride"), arguments.get("padding"), arguments.get("dilation")) == (2, 2, 2)

    gm.recompile()
    x = torch.randn(1, 2, 7, 7)
    torch.testing.assert_close(gm(x), F.conv2d(x, model.weight, None, 2, 2, 2))


def test_tensor_meta_reads_export_values() -> None:
    gm = export_module(nn.Sequential(nn.Conv2d(3, 4, 3)).double(), torch.randn(2, 3, 6, 6, dtype=torch.float64))
    conv = only_view(gm, ops.weighted_op_view).node
    assert ops.tensor_meta(conv) == (torch.Size([2, 4, 4, 4]), torch.float64)
    assert ops.tensor_meta(placeholder(gm)) == (torch.Size([2, 3, 6, 6]), torch.float64)


def test_tensor_meta_reads_shape_prop_metadata() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
    conv = only_view(gm, ops.weighted_op_view).node
    assert ops.tensor_meta(conv) is None  # nothing recorded before shape propagation
    ShapeProp(gm).propagate(torch.randn(1, 3, 5, 7))
    assert "val" not in conv.meta  # the premise: this is ShapeProp's metadata, not export's
    assert ops.tensor_meta(conv) == (torch.Size([1, 4, 3, 5]), torch.float32)
    assert ops.tensor_meta(placeholder(gm)) == (torch.Size([1, 3, 5, 7]), torch.float32)


def test_tensor_meta_is_none_without_metadata() -> None:
    gm = fx.symbolic_trace(Wrap(nn.Linear(3, 2)))
    assert all(ops.tensor_meta(node) is None for node in gm.graph.nodes)


# --------------------------------------------------------------------------- ParameterUsage


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.conv(x))


class TiedConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class FunctionalWeightReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.conv2d(x, self.w, padding=1), self.w, padding=1)


class TwoConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def sharing_messages(gm: fx.GraphModule) -> list[str | None]:
    usage = ops.ParameterUsage(gm)
    return [usage.sharing(view) for view in views(gm, ops.weighted_op_view)]


def test_sharing_reports_a_module_called_twice() -> None:
    messages = sharing_messages(fx.symbolic_trace(CalledTwice()))
    assert len(messages) == 2
    assert all(m is not None and "'conv'" in m and "called at 2 places" in m for m in messages)


def test_sharing_reports_tied_weights() -> None:
    messages = sharing_messages(fx.symbolic_trace(TiedConvs()))
    assert len(messages) == 2
    assert messages[0] is not None and "tied" in messages[0] and "b.weight" in messages[0]
    assert messages[1] is not None and "tied" in messages[1] and "a.weight" in messages[1]


def test_sharing_reports_a_functional_weight_read_by_two_ops() -> None:
    messages = sharing_messages(fx.symbolic_trace(FunctionalWeightReadTwice()))
    assert len(messages) == 2
    assert all(m is not None and "'w'" in m and "also read by another op" in m for m in messages)


@pytest.mark.parametrize("model_class", [CalledTwice, TiedConvs, FunctionalWeightReadTwice])
def test_sharing_is_reported_in_aten_form(model_class: type[nn.Module]) -> None:
    torch.manual_seed(0)
    messages = sharing_messages(export_module(model_class(), torch.randn(1, 4, 5, 5)))
    assert len(messages) == 2 and all(messages), messages


@pytest.mark.parametrize("form", FORMS)
def test_sharing_is_none_for_ordinary_layers(form: str) -> None:
    torch.manual_seed(0)
    if form == "function":
        _, gm, _, _ = build_weighted("conv2d", "function", bias=True)
    else:
        model = TwoConvs()
        gm = export_module(model, torch.randn(1, 4, 5, 5)) if form == "aten" else fx.symbolic_trace(model)
    messages = sharing_messages(gm)
    assert messages and messages == [None] * len(messages)


def test_is_shared_distinguishes_tied_from_own_parameters() -> None:
    gm = fx.symbolic_trace(TiedConvs())
    usage = ops.ParameterUsage(gm)
    assert usage.is_shared(gm.a.weight)
    assert not usage.is_shared(gm.a.bias)

"""Shared helpers of the graphopt.ops tests: tiny models in each of the three graph forms.

The forms are ``module`` (torch.fx.symbolic_trace of ``self.conv(x)``), ``function``
(symbolic_trace of ``F.conv2d(x, self.weight, ...)`` with the parameters stored on the
module) and ``aten`` (``torch.export.export(model, args).module()``). Models are tiny
and hand-built so that every expectation can be computed by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

FORMS = ("module", "function", "aten")


def export_module(model: nn.Module, *args: torch.Tensor) -> fx.GraphModule:
    return torch.export.export(model, args).module()


def graph_in(form: str, model: nn.Module, *args: torch.Tensor) -> fx.GraphModule:
    """``model``'s graph: exported for the "aten" form, else symbolically traced."""
    return export_module(model, *args) if form == "aten" else fx.symbolic_trace(model)


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
    gm = graph_in(form, model, x)
    return model, gm, x, layer


"""graphopt.ops.graph: reading nodes (tensor_meta, form_of)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp

from graphopt import ops
from tests.ops.helpers import FORMS, Wrap, build_weighted, export_module, only_view, placeholder


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


@pytest.mark.parametrize("form", FORMS)
def test_form_of_names_the_spelling(form: str) -> None:
    _, gm, _, _ = build_weighted("linear", form, bias=True)
    assert ops.form_of(only_view(gm, ops.weighted_op_view).node) == form

"""as_tensor: torch.tensor(x) of a graph value stops copying when nothing can observe the shared memory."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from graphopt.ops import transfer_view
from graphopt.passes.as_tensor import as_tensor
from tests.conftest import assert_same_outputs, captured, context

pytestmark = pytest.mark.filterwarnings("ignore:To copy construct from a tensor")


def copying_moves(gm) -> list:
    return [node.name for node in gm.graph.nodes if (m := transfer_view(gm, node)) is not None and m.copy]


class Rewrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = np.arange(4, dtype=np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tensor(x)
        b = torch.tensor(x * 2, dtype=torch.float64)
        return a + b + torch.tensor(self.table)


def test_exported_torch_tensor_calls_stop_copying() -> None:
    model, x = Rewrapped(), torch.randn(2, 4)
    gm = captured(model, (x,), "export")
    assert len(copying_moves(gm)) == 3
    report = as_tensor(gm, context((x,))).report
    assert len(report.rewrites) == 3 and copying_moves(gm) == []
    assert "lift_fresh_copy" in report.rewrites[2].detail  # the stored array was copied twice, now once
    assert_same_outputs(model, gm, (x,), tolerance=0)


def test_torch_tensor_call_becomes_as_tensor() -> None:
    # symbolic_trace cannot trace torch.tensor(proxy); a graph built by hand (or a custom tracer) can hold it
    graph = fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.mul, (x, 2))
    wrapped = graph.call_function(torch.tensor, (doubled,), {"dtype": torch.float64})
    graph.output(graph.call_function(torch.add, (wrapped, 1)))
    gm = fx.GraphModule(nn.Module(), graph)
    original = copy.deepcopy(gm)
    inputs = (torch.randn(3),)
    report = as_tensor(gm, context(inputs)).report
    assert report.rewrites and [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.mul, torch.as_tensor, torch.add]
    assert_same_outputs(original, gm, inputs, tolerance=0)


def test_guard_torch_tensor_with_requires_grad() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.tensor, (x,), {"requires_grad": True}))
    gm = fx.GraphModule(nn.Module(), graph)
    report = as_tensor(gm, context((torch.randn(3),))).report
    assert report.rewrites == [] and "requires_grad" in report.skips[0].reason


def test_guard_result_written_in_place() -> None:
    class Scratch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tensor(x)
            y.add_(1)  # on a shared tensor this would change x
            return x + y

    x = torch.randn(2, 4)
    gm = captured(Scratch(), (x,), "export")
    report = as_tensor(gm, context((x,))).report
    assert report.rewrites == [] and "written in place" in report.skips[0].reason
    assert_same_outputs(Scratch(), gm, (x,), tolerance=0)


def test_guard_source_written_in_place_afterwards() -> None:
    class Snapshot(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            before = torch.tensor(h)
            h.add_(1)
            return before + h

    x = torch.randn(2, 4)
    gm = captured(Snapshot(), (x,), "export")
    report = as_tensor(gm, context((x,))).report
    assert report.rewrites == [] and "written in place" in report.skips[0].reason
    assert_same_outputs(Snapshot(), gm, (x,), tolerance=0)


def test_guard_result_returned() -> None:
    class Copy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tensor(x)

    x = torch.randn(2, 4)
    gm = captured(Copy(), (x,), "export")
    report = as_tensor(gm, context((x,))).report
    assert report.rewrites == [] and "returned" in report.skips[0].reason
    assert gm(x).data_ptr() != x.data_ptr()

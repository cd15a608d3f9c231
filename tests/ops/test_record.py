"""record and Recorder: one isolated run of a graph on example inputs, a hook per node."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt import ops
from tests.ops.helpers import export_module


class ConvBnDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.bn(self.conv(x)))


def test_record_calls_the_hook_after_each_node_with_its_result_and_inputs() -> None:
    gm = fx.symbolic_trace(ConvBnDropout().eval())
    x = torch.randn(2, 3, 6, 6)
    seen: list[tuple[str, Any]] = []
    inputs: dict[str, Any] = {}

    def hook(node: fx.Node, result: Any, values: Any) -> None:
        seen.append((node.name, result))
        inputs[node.name] = [values[arg] for arg in node.all_input_nodes]

    output = ops.record(gm, (x,), hook)
    assert [name for name, _ in seen] == [node.name for node in gm.graph.nodes]
    torch.testing.assert_close(output, gm(x))
    results = dict(seen)
    assert results["x"] is x and inputs["conv"] == [x]
    assert inputs["bn"][0] is results["conv"]


def test_record_is_isolated() -> None:
    """Fixed RNG (dropout draws the same mask each run), buffers restored (BatchNorm statistics), no autograd."""
    gm = fx.symbolic_trace(ConvBnDropout().train())
    x = torch.randn(2, 3, 6, 6)
    statistics = gm.bn.running_mean.clone()
    first, second = ops.record(gm, (x,)), ops.record(gm, (x,))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(gm.bn.running_mean, statistics, rtol=0, atol=0)
    assert not first.requires_grad
    assert ops.record(gm, (x,), context=torch.enable_grad).requires_grad


def test_record_flattens_the_inputs_of_an_exported_module() -> None:
    class Pair(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

    a, b = torch.randn(3), torch.randn(3)
    gm = export_module(Pair(), (a, b))
    assert ops.interpreter_inputs(gm, ((a, b),)) == (a, b)
    torch.testing.assert_close(ops.record(gm, ((a, b),)), a + b)


class Doubling(ops.Recorder):
    """A recorder that changes what a node computes: every relu reads its input doubled."""

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and n.target is torch.relu:
            source = n.args[0]
            saved = self.env[source]
            self.env[source] = saved * 2
            try:
                return super().run_node(n)
            finally:
                self.env[source] = saved
        return super().run_node(n)


def test_a_recorder_subclass_may_change_what_a_node_computes() -> None:
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + x)
    x = torch.randn(5)
    torch.testing.assert_close(Doubling(gm).run_on((x,)), torch.relu(2 * x) + x)

"""graphopt.backends.int8_budget: the search that keeps an engine's int8 within the accuracy budget.

A fake engine stands in for OpenVINO's and onnxruntime's quantizers: its error is scripted per set of
layers left in float (and, through `quantized_within_budget`, per input). The search grows the layers
it moves to float 1, 2, 4, 8, ... at a time, and the engine's result is measured on the calibration
batches as well as the example (tests/test_int8_engines.py checks the real engines end to end).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.backends.engine import EngineInput
from graphopt.backends.int8_budget import Int8Layer, quantized_within_budget, within_budget
from tests.passes.test_quantize_int8 import OutlierChannel


def test_the_search_moves_1_2_4_8_layers_to_float_until_the_rest_fits() -> None:
    # 16 layers, each alone within the budget, together 17x over it: only the one with the smallest error fits
    errors = {f"layer{index}": 1e-3 + index * 1e-5 for index in range(16)}
    quantized: list[frozenset[str]] = []

    def quantize(in_float: frozenset[str]) -> frozenset[str]:
        quantized.append(in_float)
        return in_float

    def error(in_float: frozenset[str]) -> float:  # the engine's error: the sum of its int8 layers' errors
        return sum(value for path, value in errors.items() if path not in in_float)

    ranked = [Int8Layer(path, nn.Linear(2, 2), value) for path, value in errors.items()]
    outcome = within_budget(lambda: ranked, 1.5e-3, quantize, error)
    worst_first = [f"layer{index}" for index in range(15, -1, -1)]
    moved = [len(in_float) for in_float in quantized]
    assert moved == [0, 1, 3, 7, 15], "every layer in int8, then the worst 1, 2, 4 and 8 more by error alone"
    assert quantized == [frozenset(worst_first[:count]) for count in moved]
    assert outcome.built == frozenset(worst_first[:15]) and outcome.error == pytest.approx(1e-3) and outcome.quantizations == 5


def test_an_engine_over_the_budget_on_a_calibration_batch_only_gets_layers_moved_to_float() -> None:
    accuracy = 0.1
    graph = fx.symbolic_trace(OutlierChannel().eval())
    example = torch.randn(4, 3, 12, 12)
    calibration = tuple((torch.randn(4, 3, 12, 12),) for _ in range(2))
    over_on = calibration[-1][0]  # the last batch: every calibration batch counts, not the first one only
    quantized: list[frozenset[str]] = []

    def quantize(in_float: frozenset[str]) -> frozenset[str]:
        quantized.append(in_float)
        return in_float

    def run(in_float: frozenset[str]) -> Any:
        """The engine's result: conv2 in int8 is twice the budget off on ``over_on``, exact elsewhere."""

        def call(x: torch.Tensor) -> Any:
            outputs = graph(x)
            if "conv2" in in_float or not torch.equal(x, over_on):
                return outputs
            return pytree.tree_map(lambda t: t * (1 + 2 * accuracy), outputs)

        return call

    request = EngineInput(graph, (example,), (frozenset(),), "int8", {}, calibration, accuracy)
    outcome, layers = quantized_within_budget(request, "fake", quantize, run, lambda: {"conv1", "conv2", "conv3"})
    assert [layer.path for layer in layers] == ["conv1", "conv2", "conv3"]
    assert quantized == [frozenset(), {"conv2"}], "over the budget on the calibration batch: conv2, the most sensitive layer, goes to float"
    assert outcome.built == {"conv2"} and outcome.error <= accuracy and list(outcome.in_float) == ["conv2"]

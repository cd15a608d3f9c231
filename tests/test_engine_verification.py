"""How an engine's result is verified (stages._on_engine, Verifier.output_tolerance): the tolerance each precision sets.

A fake engine (registered in graphopt.backends.ENGINES for one test) runs graphopt's own graph and
changes its outputs by a chosen relative amount, on every input or on the second input only. int8
is held to the caller's accuracy budget on both checks; bf16 to twice torch.autocast's own error on
the same input, not to bf16's fixed output tolerance; the report's error includes the engine's
second-input error; and a dimension the model's code ties to the example's size, which torch.export
fixes, is refused when an engine is built instead of failing or computing wrongly at other sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

import graphopt
from graphopt import verify
from graphopt.backends import ENGINES, EngineInfo, EngineInput, EngineRunner
from graphopt.backends.engine import export_program
from graphopt.errors import EngineError, VerificationError
from graphopt.report import EngineReport, Report
from tests.engine_models import conv_net

EXAMPLE_BATCH = 2
Change = Callable[[tuple[Any, ...], Any, fx.GraphModule], Any]


class Changed(EngineRunner):
    """graphopt's graph, its outputs passed through ``change(args, outputs, graph)``: an engine result exactly as wrong as a test wants."""

    engine = "fake"

    def __init__(self, graph_module: fx.GraphModule, change: Change) -> None:
        super().__init__()
        self.graph_module, self.change = graph_module, change

    def run(self, args: tuple[Any, ...]) -> Any:
        return self.change(args, self.graph_module(*args), self.graph_module)


def fake_engine(monkeypatch: pytest.MonkeyPatch, change: Change, *precisions: str) -> str:
    """Register an engine computing in ``precisions`` (and fp32) whose runner is `Changed` by ``change``; its name."""

    def build(request: EngineInput) -> Changed:
        return Changed(request.graph_module, change)

    info = EngineInfo("fake", "a test's engine: graphopt's graph with its outputs changed", precisions=("fp32", *precisions), build=build)
    monkeypatch.setitem(ENGINES, info.name, info)
    return info.name


def scaled(outputs: Any, error: float) -> Any:
    """Every output times 1 + ``error``: off by exactly ``error`` of its scale."""
    return pytree.tree_map(lambda t: t * (1 + error), outputs)


def off_by(error: float, only_on_the_second_input: bool = False) -> Change:
    """Outputs off by ``error`` of their scale, everywhere or only at batch sizes other than the example's."""

    def change(args: tuple[Any, ...], outputs: Any, graph: fx.GraphModule) -> Any:
        second = args[0].shape[0] != EXAMPLE_BATCH
        return scaled(outputs, error) if second or not only_on_the_second_input else outputs

    return change


def int8_on_fake_engine(monkeypatch: pytest.MonkeyPatch, change: Change, accuracy: float) -> graphopt.OptimizedModule:
    engine = fake_engine(monkeypatch, change, "int8")
    calibration = [torch.randn(4, 3, 12, 12) for _ in range(2)]
    return graphopt.optimize(conv_net(), torch.randn(EXAMPLE_BATCH, 3, 12, 12), engine=engine, precision="int8", calibration=calibration, accuracy=accuracy)


@pytest.mark.parametrize(("second_only", "where"), [(False, "the example inputs"), (True, "a second input")])
def test_an_int8_engine_result_twice_the_accuracy_budget_off_is_refused(monkeypatch: pytest.MonkeyPatch, second_only: bool, where: str) -> None:
    accuracy = 2e-2
    with pytest.raises(VerificationError, match=f"engine='fake' \\(int8\\) computes output.* differently from the original model on {where}") as raised:
        int8_on_fake_engine(monkeypatch, off_by(2 * accuracy, second_only), accuracy)
    assert raised.value.max_error == pytest.approx(2 * accuracy, rel=1e-3)


def test_an_int8_engine_result_within_the_accuracy_budget_is_accepted_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    accuracy = 2e-2
    fast = int8_on_fake_engine(monkeypatch, off_by(accuracy / 2), accuracy)
    engine = fast.graphopt_report.engine
    assert engine.precision == "int8"
    assert engine.max_error == pytest.approx(accuracy / 2, rel=1e-3) and engine.second_input_error == pytest.approx(accuracy / 2, rel=1e-3)


class Cancelling(nn.Module):
    """Two linears whose outputs mostly cancel: torch.autocast's bf16 error is about 1e-2 of the output's scale,
    above one bf16 rounding (7.8e-3) yet under bf16's fixed output tolerance (5e-2)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)
        with torch.no_grad():
            self.b.weight.copy_(0.7 * self.a.weight)
            self.b.bias.copy_(0.7 * self.a.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) - self.b(x)


def autocast_error_times(multiple: float) -> Change:
    """A bf16 engine whose error is ``multiple`` times torch.autocast's own on the same input (autocast of graphopt's graph)."""

    def change(args: tuple[Any, ...], outputs: Any, graph: fx.GraphModule) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = graph(*args)
        return pytree.tree_map(lambda exact, low: exact + multiple * (low.float() - exact), outputs, autocast)

    return change


@pytest.mark.parametrize(("multiple", "accepted"), [(1.5, True), (2.5, False)])
def test_a_bf16_engine_is_held_to_twice_autocasts_error_not_to_bf16s_fixed_tolerance(monkeypatch: pytest.MonkeyPatch, multiple: float, accepted: bool) -> None:
    torch.manual_seed(0)
    model, x = Cancelling().eval(), torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = verify.compare(expected, model(x).float()).max_error
    # 1.5x autocast's error is over one bf16 rounding and 2.5x under bf16's fixed 5e-2: only twice autocast's error accepts the one and refuses the other
    assert verify.low_precision_floor(torch.bfloat16) < 1.5 * autocast and 2.5 * autocast < verify.tolerance_for(torch.bfloat16), autocast
    engine = fake_engine(monkeypatch, autocast_error_times(multiple), "bf16")
    if accepted:
        fast = graphopt.optimize(model, x, engine=engine, precision="bf16")
        assert fast.graphopt_report.engine.max_error == pytest.approx(multiple * autocast, rel=1e-2)
        return
    with pytest.raises(VerificationError, match="engine='fake' \\(bf16\\) computes output differently from the original model on the example inputs") as raised:
        graphopt.optimize(model, x, engine=engine, precision="bf16")
    assert raised.value.max_error == pytest.approx(multiple * autocast, rel=1e-2)


def test_the_reports_error_includes_the_engines_second_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    error = 5e-5  # within float32's tolerance (1e-4), on the second input only
    engine = fake_engine(monkeypatch, off_by(error, only_on_the_second_input=True))
    report = graphopt.optimize(conv_net(), torch.randn(EXAMPLE_BATCH, 3, 12, 12), engine=engine).graphopt_report
    assert report.engine.max_error < 1e-6 and report.engine.second_input_error == pytest.approx(error, rel=1e-2)
    assert report.max_error == pytest.approx(error, rel=1e-2)


def test_the_reports_error_is_the_largest_of_the_passes_and_the_engines_two_checks() -> None:
    report = Report(mode="inference", frontend="fx", engine=EngineReport("fake", "fp32", max_error=1e-6, second_input_error=3e-5))
    assert report.max_error == 3e-5
    report.engine.second_input_error = None
    assert report.max_error == 1e-6


def row_weights(x: torch.Tensor) -> torch.Tensor:
    """A weight per row of the batch, counted with the batch size as a Python int: torch.export fixes the batch there."""
    return torch.linspace(1.0, 2.0, int(x.shape[0])).unsqueeze(1)


torch.fx.wrap("row_weights")  # symbolic_trace keeps the call whole: fx's graph takes any batch, as the model does


class RowWeighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x * row_weights(x))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) * 2


@pytest.mark.parametrize("engine", ["openvino", "onnxruntime"])
def test_an_engine_refuses_a_batch_the_models_code_ties_to_the_examples_size(engine: str) -> None:
    if ENGINES[engine].missing():
        pytest.skip(ENGINES[engine].missing())
    model = RowWeighted().eval()
    assert graphopt.optimize(model, torch.randn(EXAMPLE_BATCH, 4)).graphopt_report.dynamic == "x dim 0"  # capture verified the batch dynamic
    with pytest.raises(EngineError, match=f"engine='{engine}': torch.export fixed input 0 dim 0 to the example's size"):
        graphopt.optimize(model, torch.randn(EXAMPLE_BATCH, 4), engine=engine)


def test_export_program_refuses_a_dimension_torch_export_fixed() -> None:
    graph = fx.symbolic_trace(RowWeighted().eval())
    with pytest.raises(EngineError, match="engine='onnxruntime': torch.export fixed input 0 dim 0 to the example's size"):
        export_program(graph, (torch.randn(EXAMPLE_BATCH, 4),), (frozenset({0}),), "onnxruntime")


def test_export_program_keeps_a_dimension_the_code_leaves_free() -> None:
    program = export_program(fx.symbolic_trace(Plain().eval()), (torch.randn(EXAMPLE_BATCH, 4),), (frozenset({0}),), "onnxruntime")
    [size] = [node.meta["val"].shape[0] for node in program.graph.find_nodes(op="placeholder") if node.name in program.graph_signature.user_inputs]
    assert isinstance(size, torch.SymInt) and size.node.expr.free_symbols



def test_saving_refuses_a_batch_the_models_code_ties_to_the_examples_size(tmp_path: Any) -> None:
    model = RowWeighted().eval()
    optimized = graphopt.optimize(model, torch.randn(EXAMPLE_BATCH, 4))
    assert optimized.graphopt_report.dynamic == "x dim 0"  # the graph takes other batch sizes: its file would not
    with pytest.raises(graphopt.SaveError, match="torch.export fixed x dim 0 to the example's size"):
        graphopt.save(optimized, tmp_path / "row-weighted.pt2")

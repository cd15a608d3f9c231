"""int8 on every engine that quantizes, held to graphopt's accuracy budget (graphopt.backends.int8_budget).

Two models trained here on real data shipped by scikit-learn (the digits CNN, an MLP on the
breast-cancer table) keep their top-1 within a point of float32 on each engine's int8; a layer
that quantizes badly stays in float and the report names it; where no layer fits the budget the
engine's float32 result comes back with a warning; a saved int8 engine result computes the same in
a fresh process; the QDQ ONNX export runs in onnxruntime within the budget on held-out inputs;
tune with calibration tries each engine's int8. No test times anything: tune's timer is a fake.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.backends import ENGINES
from graphopt.backends.int8_budget import Int8Layer, within_budget
from graphopt.errors import EngineError, ExportError
from tests.digits import DigitsNet, digits
from tests.passes.test_quantize_int8 import OutlierChannel, batches, int8_twice_as_fast  # noqa: F401 - autouse here too: no test times
from tests.test_engines import FakeTimer, loaded_in_a_fresh_process

INT8_ENGINES = [name for name, info in ENGINES.items() if "int8" in info.precisions]
QUANTIZING_ENGINES = [name for name in INT8_ENGINES if not ENGINES[name].own_passes]  # the runtimes' own quantizers


def top1(model: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(inputs).argmax(1) == labels).float().mean().item()


def trained(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, epochs: int) -> nn.Module:
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(labels), generator=torch.Generator().manual_seed(1)).split(64):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(inputs[batch]), labels[batch]).backward()
            optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def digits_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits CNN trained for 8 epochs: (model, training images, their labels, test images, their labels)."""
    images, labels, train, test = digits()
    torch.manual_seed(0)
    return trained(DigitsNet(), images[train], labels[train], 8), images[train], labels[train], images[test], labels[test]


@pytest.fixture(scope="module")
def cancer_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MLP on scikit-learn's breast-cancer table (569 rows, 30 features, standardized), trained for 30 epochs."""
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn ships the dataset (pip install -e '.[test]')")
    loaded = datasets.load_breast_cancer()
    features = torch.tensor(loaded.data, dtype=torch.float32)
    labels = torch.tensor(loaded.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:400], order[400:]
    mean, std = features[train].mean(0), features[train].std(0)
    features = (features - mean) / std
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    return trained(model, features[train], labels[train], 30), features[train], labels[train], features[test], labels[test]


@pytest.mark.parametrize("engine", INT8_ENGINES)
# the MLP's two logits are close to each other: NNCF's int8 of it reaches 1.2e-1 of their scale (onnxruntime's 1.5e-2),
# over the default budget (OpenVINO then gives its float32 result), without changing a decision
@pytest.mark.parametrize(("dataset", "accuracy"), [("digits_cnn", 5e-2), ("cancer_mlp", 2e-1)])
def test_each_engines_int8_keeps_a_trained_models_top1(engine: str, dataset: str, accuracy: float, request: pytest.FixtureRequest) -> None:
    model, train_x, train_y, test_x, test_y = request.getfixturevalue(dataset)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train_x, train_y), batch_size=100)
    fast = graphopt.optimize(model, train_x[:100], engine=engine, precision="int8", calibration=loader, accuracy=accuracy)
    float_top1, int8_top1 = top1(model, test_x, test_y), top1(fast, test_x, test_y)
    assert float_top1 > 0.9  # trained
    assert int8_top1 >= float_top1 - 0.01, (float_top1, int8_top1)
    report = fast.graphopt_report
    assert not [warning for warning in report.warnings if "no conv or linear stayed in int8" in warning]  # int8, not a float fallback
    if engine in QUANTIZING_ENGINES:
        assert report.engine.precision == "int8" and not fast.runner.int8_fell_back
        assert "in int8 by" in report.engine.notes[0], report.engine.notes
        assert max(report.engine.max_error, report.engine.second_input_error) <= accuracy  # verified within the budget


@pytest.mark.parametrize("engine", QUANTIZING_ENGINES)
def test_a_layer_that_quantizes_badly_stays_in_float_on_the_engine_and_the_report_names_it(engine: str) -> None:
    model = OutlierChannel().eval()
    x = torch.randn(4, 3, 12, 12)
    fast = graphopt.optimize(model, x, engine=engine, precision="int8", calibration=batches(2, shape=(3, 12, 12)), accuracy=0.1)
    notes = fast.graphopt_report.engine.notes
    kept = [note.split(":")[0] for note in notes if ": kept in float: " in note]
    assert kept[0] == "conv2", notes  # the outlier layer goes to float first, with why
    # measured alone in PyTorch, or on the engine where that ranking left nothing in int8
    assert any(re.search("kept in float: alone in int8( on the engine)? it changes the output by", line) for line in fast.graphopt_report.why("conv2"))
    assert f"{3 - len(kept)} of 3 convs/linears in int8" in notes[0]
    if engine == "openvino":
        # NNCF quantizes a layer's inputs: with conv2 in float, conv1's outlier output stays float and conv1, conv3 stay
        # int8. onnxruntime's QDQ file also quantizes conv1's output, so there conv1 must go to float too
        assert kept == ["conv2"], notes
    with torch.no_grad():
        assert graphopt.verify.compare(model(x), fast(x)).max_error <= 0.1


@pytest.mark.parametrize("engine", QUANTIZING_ENGINES)
def test_a_budget_no_layer_meets_gives_the_engines_float32_result_with_a_warning(engine: str) -> None:
    model = OutlierChannel().eval()
    x = torch.randn(4, 3, 12, 12)
    with pytest.warns(UserWarning, match=f"no conv or linear stayed in int8 within accuracy=1e-06 on engine='{engine}'"):
        fast = graphopt.optimize(model, x, engine=engine, precision="int8", calibration=batches(2, shape=(3, 12, 12)), accuracy=1e-6)
    assert fast.runner.int8_fell_back
    assert sum(": kept in float: " in note for note in fast.graphopt_report.engine.notes) == 3
    with torch.no_grad():
        assert graphopt.verify.compare(model(x), fast(x)).max_error <= 1e-4  # float32


@pytest.mark.parametrize("engine", QUANTIZING_ENGINES)
def test_a_saved_int8_engine_result_computes_the_same_in_a_fresh_process(engine: str, digits_cnn: Any, tmp_path: Path) -> None:
    model, train_x, _, test_x, _ = digits_cnn
    fast = graphopt.optimize(model, train_x[:100], engine=engine, precision="int8", calibration=train_x.split(100))
    assert not fast.runner.int8_fell_back
    held_out = test_x[:37]
    with torch.no_grad():
        name, runner, error = loaded_in_a_fresh_process(fast, (held_out,), fast(held_out), tmp_path)
    assert (name, runner) == (engine, type(fast.runner).__name__)
    assert error <= 1e-4  # the same int8 model, not a float32 one


def test_an_int8_export_is_a_qdq_file_onnxruntime_runs_within_the_budget_on_a_second_input(digits_cnn: Any, tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    import onnxruntime

    model, train_x, _, test_x, test_y = digits_cnn
    path = tmp_path / "digits.onnx"
    calibration = [train_x[i : i + 100] for i in range(100, 500, 100)]
    written = graphopt.export_onnx(model, train_x[:100], path, precision="int8", calibration=calibration, accuracy=5e-2)
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert written.max_error <= 5e-2 and "in int8 by onnxruntime's quantizer" in str(written)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: images.numpy()})[0])

    # the budget is a promise for inputs like those it was measured on: another batch size of the calibration data
    second = train_x[137:198]
    with torch.no_grad():
        assert graphopt.verify.compare(model(second), run(second)).max_error <= 5e-2
    # on digits never seen, the decisions: the held-out error depends on the trained weights (5.4e-2 of the logits'
    # scale with weights trained on one thread, under 5e-2 with two), the top-1 does not move
    float_top1, int8_top1 = top1(model, test_x, test_y), top1(run, test_x, test_y)
    assert int8_top1 >= float_top1 - 0.01, (float_top1, int8_top1)


def test_an_int8_export_refuses_what_it_cannot_hold_to_the_budget(digits_cnn: Any, tmp_path: Path) -> None:
    model, train_x, _, _, _ = digits_cnn
    calibration = [train_x[:50]]
    with pytest.raises(ExportError, match="leave verify on"):
        graphopt.export_onnx(model, train_x[:50], tmp_path / "a.onnx", precision="int8", calibration=calibration, verify=False)
    with pytest.raises(ExportError, match="memory_format= do not apply"):
        graphopt.export_onnx(model, train_x[:50], tmp_path / "a.onnx", precision="int8", calibration=calibration, memory_format="channels_last")
    with pytest.raises(ExportError, match="leave opset= and external_data= out"):
        graphopt.export_onnx(model, train_x[:50], tmp_path / "a.onnx", precision="int8", calibration=calibration, opset=17)
    with pytest.raises(ExportError, match="precision='int8' is for inference"):
        graphopt.export_onnx(model, train_x[:50], tmp_path / "a.onnx", precision="int8", calibration=calibration, mode="training")
    with pytest.raises(ExportError, match="export the original model with optimize=True"):
        graphopt.export_onnx(model, train_x[:50], tmp_path / "a.onnx", precision="int8", calibration=calibration, optimize=False)
    assert not list(tmp_path.iterdir())


def test_openvino_int8_without_nncf_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    if "openvino" not in QUANTIZING_ENGINES or ENGINES["openvino"].missing():
        pytest.skip("OpenVINO is not installed")
    monkeypatch.setitem(sys.modules, "nncf", None)  # import nncf raises ImportError
    with pytest.raises(EngineError, match=r"quantizes with NNCF, which is not installed: pip install 'graphopt\[openvino\]'"):
        graphopt.optimize(OutlierChannel().eval(), torch.randn(4, 3, 12, 12), engine="openvino", precision="int8", calibration=batches(1, shape=(3, 12, 12)))


def test_tune_with_calibration_tries_each_engines_int8(digits_cnn: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from graphopt import tuning

    engine = QUANTIZING_ENGINES[0]
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_memory_cache", {})
    monkeypatch.setattr(tuning, "measure_latencies", FakeTimer({f"{engine} int8": 1e-3}))
    model, train_x, _, _, _ = digits_cnn
    tuned = graphopt.optimize(model, train_x[:100], tune=True, accuracy=5e-2, calibration=train_x.split(100))
    report = tuned.graphopt_report
    measured = {candidate.name for candidate in report.tune.candidates if candidate.status == "measured"}
    assert {f"{name} int8" for name in QUANTIZING_ENGINES} <= measured
    assert report.tune.winner == f"{engine} int8" and report.engine.precision == "int8"


class FakeEngine:
    """An engine whose quantized error is the sum of the errors of the layers it quantizes."""

    def __init__(self, errors: dict[str, float], others: float = 0.0) -> None:
        self.errors = errors
        self.others = others  # what it quantizes besides the layers costs, whichever layers are in float
        self.quantized: list[frozenset[str]] = []

    def quantize(self, in_float: frozenset[str]) -> frozenset[str]:
        self.quantized.append(in_float)
        return in_float

    def error(self, in_float: frozenset[str]) -> float:
        return self.others + sum(error for path, error in self.errors.items() if path not in in_float)


def layers(errors: dict[str, float]) -> list[Int8Layer]:
    return [Int8Layer(path, nn.Linear(2, 2), error) for path, error in errors.items()]


def test_within_budget_quantizes_everything_first_and_ranks_only_when_over() -> None:
    engine = FakeEngine({"a": 0.01, "b": 0.02})
    ranked = []
    outcome = within_budget(lambda: ranked.append(1) or layers(engine.errors), 0.05, engine.quantize, engine.error)
    assert outcome.built == frozenset() and outcome.quantizations == 1 and not ranked and not outcome.in_float


def test_within_budget_puts_layers_over_it_alone_in_float_then_the_worst_in_growing_steps() -> None:
    errors = {"over": 0.2, "a": 0.01, "b": 0.03, "c": 0.02, "d": 0.015, "e": 0.005}
    engine = FakeEngine(errors)
    outcome = within_budget(lambda: layers(errors), 0.03, engine.quantize, engine.error)
    # everything; "over" alone; then the worst one (b); then the next two (c, d): 0.015 within 0.03
    assert engine.quantized == [frozenset(), {"over"}, {"over", "b"}, {"over", "b", "c", "d"}]
    assert outcome.built == {"over", "b", "c", "d"} and outcome.error == pytest.approx(0.015)
    assert "over accuracy=0.03" in outcome.in_float["over"] and "among the largest errors alone" in outcome.in_float["b"]


def test_within_budget_gives_none_when_no_layer_fits() -> None:
    errors = {"a": 0.2, "b": 0.3}
    engine = FakeEngine(errors)
    outcome = within_budget(lambda: layers(errors), 0.05, engine.quantize, engine.error)
    assert outcome.built is None and set(outcome.in_float) == {"a", "b"}
    # both over alone: nothing left to try in int8 by the ranking; every layer in float is within the budget, so each
    # alone on the engine, over the budget too
    assert engine.quantized == [frozenset(), frozenset({"a", "b"}), frozenset({"b"}), frozenset({"a"})]
    assert outcome.quantizations == 4 and outcome.floor == 0.0
    assert not any("no choice of layers" in line for line in outcome.notes(layers(errors), 0.05, "NNCF"))


def test_within_budget_stops_where_the_engines_other_int8_ops_are_over_it_alone() -> None:
    errors = {"a": 0.001, "b": 0.002, "c": 0.003}
    engine = FakeEngine(errors, others=0.07)  # NNCF's int8 of the activations before additions and products, say
    outcome = within_budget(lambda: layers(errors), 0.05, engine.quantize, engine.error)
    # the ranking's search puts every layer in float by steps; then all of them in float once: 7e-2 still, so no
    # layer is measured alone on the engine (that would be one quantization per layer)
    every = frozenset(errors)
    assert engine.quantized[-1] == every and every - {"a"} not in engine.quantized
    assert outcome.built is None and outcome.floor == pytest.approx(0.07) and outcome.quantizations == len(engine.quantized)
    notes = outcome.notes(layers(errors), 0.05, "NNCF")
    assert "with every conv and linear in float, NNCF's int8 of the other ops it quantizes still changed the output by 7.0e-02" in notes[1]


def test_within_budget_measures_each_layer_on_the_engine_where_the_ranking_missed_the_culprit() -> None:
    engine = FakeEngine({"a": 0.06, "b": 0.01, "c": 0.01})  # the engine's own errors: "a" alone is over the budget
    ranked_in_pytorch = {"a": 0.001, "b": 0.02, "c": 0.03}  # fake quantization in PyTorch ranks "a" last
    outcome = within_budget(lambda: layers(ranked_in_pytorch), 0.05, engine.quantize, engine.error)
    assert engine.quantized[:2] == [frozenset(), frozenset({"c"})]  # the ranking's search: "c", then everything in float
    assert engine.quantized[2] == frozenset({"a", "b", "c"})  # every layer in float: within the budget, so the layers are the cause
    assert engine.quantized[3:6] == [frozenset({"b", "c"}), frozenset({"a", "c"}), frozenset({"a", "b"})]  # each alone on the engine
    assert outcome.built == frozenset({"a"}) and outcome.error == pytest.approx(0.02) and outcome.quantizations == 7
    assert outcome.in_float == {"a": "alone in int8 on the engine it changes the output by 6.0e-02 of its scale, over accuracy=0.05"}

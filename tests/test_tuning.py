"""optimize(tune=True): the fastest candidate within the accuracy budget wins, over-budget ones never do, the cache skips measuring.

Latencies come from a deterministic fake timer (graphopt.tuning.measure_latencies), and the budget is spent on a fake
clock (graphopt.tuning.clock) where a test depends on it: no test times anything.
Engines other than PyTorch are candidates only in the tests that ask for them (each costs seconds to build;
tests/test_engines.py checks tune across every engine).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import timing, tuning
from graphopt.backends import ENGINES
from graphopt.errors import InvalidOptionError, VerificationWarning
from graphopt.runtime import int8_modules
from graphopt.models import REFERENCE_MODELS
from tests.conftest import measured_as


class FakeTimer:
    """Latencies by candidate name; every candidate not named takes 10 ms. Records each measurement."""

    def __init__(self, latencies: Mapping[str, float]) -> None:
        self.latencies = latencies
        self.measured: list[list[str]] = []

    def __call__(self, runs: Mapping[str, Callable[[], Any]], **settings: Any) -> timing.Ranking:
        self.measured.append(list(runs))
        for run in runs.values():
            run()  # the candidates really run: a broken one would fail here
        return timing.Ranking.of({name: [self.latencies.get(name, 10e-3)] * timing.MIN_ROUNDS for name in runs}, foreign_cores=0.0)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_memory_cache", {})


@pytest.fixture(autouse=True)
def native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidate lists below are those of a CPU with native bf16, on either CPU family (bf16 still runs, emulated)."""
    monkeypatch.setattr(graphopt.api, "emulated_on_cpu", lambda precision, model: None)


@pytest.fixture(autouse=True)
def pytorch_only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tune's own rules are tested on graphopt's PyTorch candidates; a test that takes `with_engines` keeps the engines."""
    if "with_engines" not in request.fixturenames:
        monkeypatch.setattr(graphopt.api, "ENGINES", {name: info for name, info in ENGINES.items() if info.own_passes})


@pytest.fixture
def with_engines() -> None:
    """The installed engines stay tune's candidates (see `pytorch_only`)."""


class FakeClock:
    """The clock tune spends its budget by: it stands still but for the seconds `advance` adds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def use_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(tuning, "clock", clock)
    return clock


def use_timer(monkeypatch: pytest.MonkeyPatch, latencies: Mapping[str, float]) -> FakeTimer:
    timer = FakeTimer(latencies)
    monkeypatch.setattr(tuning, "measure_latencies", timer)
    return timer


def resnet() -> tuple[nn.Module, tuple[torch.Tensor]]:
    reference = REFERENCE_MODELS["resnet"]
    return reference.build().eval(), reference.example_inputs(2)


def names(report: graphopt.Report, status: str) -> set[str]:
    return {c.name for c in report.tune.candidates if c.status == status}


def test_the_fastest_exact_candidate_wins_by_default(monkeypatch: pytest.MonkeyPatch, with_engines: None) -> None:
    timer = use_timer(monkeypatch, {"fp32 preserve": 4e-3, "fp32 channels_last": 6e-3, "captured graph, no passes": 9e-3})
    use_clock(monkeypatch)  # the builds take no time: however slowly the engines build here, the budget cut leaves none out
    model, inputs = resnet()
    tuned = graphopt.optimize(model, inputs, tune=True)
    report = tuned.graphopt_report
    assert report.tune.winner == "fp32 preserve"
    # the reference first, the engines, the default call, then the likeliest winners (a budget cut drops the last ones);
    # an engine that compiles waits for a larger budget
    engines = ["openvino fp32", "onnxruntime fp32"]
    assert timer.measured == [["captured graph, no passes", *engines, "default call", "fp32 channels_last + oneDNN", "fp32 channels_last", "fp32 preserve"]]
    assert next(c.reason for c in report.tune.candidates if c.name == "inductor fp32") == "compiles: needs tune_budget_s >= 120"
    assert "bf16" in names(report, "not built") and "over accuracy=1e-04" in next(c.reason for c in report.tune.candidates if c.name == "bf16")
    assert "to_channels_last" not in [p.name for p in report.passes]  # the winner's own configuration
    assert "2.25x the graph with no passes" in report.tune.why
    torch.testing.assert_close(tuned(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    assert "tune: fp32 preserve (tuned in" in str(report)


def test_an_emulated_bf16_is_left_out_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphopt.api, "emulated_on_cpu", lambda precision, model: f"{precision} is emulated here" if precision == "bf16" else None)
    timer = use_timer(monkeypatch, {})
    model, inputs = resnet()
    report = graphopt.optimize(model, inputs, tune=True, accuracy=3e-2).graphopt_report
    assert all("bf16" not in name for name in timer.measured[0])
    assert next(c.reason for c in report.tune.candidates if c.name == "bf16") == "bf16 is emulated here"


def test_bf16_counts_as_emulated_exactly_where_onednn_has_no_bf16() -> None:
    from graphopt.precision import emulated_on_cpu

    reason = emulated_on_cpu("bf16", nn.Linear(2, 2))
    assert (reason is None) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert reason is None or "no native bf16" in reason
    assert emulated_on_cpu("fp32", nn.Linear(2, 2)) is None


def test_a_looser_accuracy_admits_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {"bf16 channels_last": 1e-3})
    model, inputs = resnet()
    report = graphopt.optimize(model, inputs, tune=True, accuracy=3e-2).graphopt_report
    assert report.tune.winner == "bf16 channels_last"
    assert {"bf16 preserve", "bf16 channels_last"} <= names(report, "measured")
    assert "use_low_precision" in [p.name for p in report.passes]
    assert report.max_error <= 3e-2


def test_an_over_budget_candidate_never_wins(monkeypatch: pytest.MonkeyPatch, with_engines: None) -> None:
    monkeypatch.setitem(tuning.LOW_PRECISION_BOUNDS, "bf16", 1e-9)  # admit bf16 to be built, so its measured error decides
    monkeypatch.delitem(ENGINES, "inductor")  # its bf16 compiles: OpenVINO's stands for the engines
    timer = use_timer(monkeypatch, {"bf16 channels_last": 1e-4, "bf16 preserve": 1e-4})
    model, inputs = resnet()
    report = graphopt.optimize(model, inputs, tune=True, accuracy=1e-4).graphopt_report
    # OpenVINO's bf16 is over the budget too, or refused where the CPU has no native bf16 (the fixture only fakes oneDNN's)
    assert names(report, "over budget") - {"openvino bf16"} == {"bf16 preserve", "bf16 channels_last", "bf16 channels_last + oneDNN"}
    assert "openvino bf16" in names(report, "over budget") | names(report, "failed")
    assert all("bf16" not in name for name in timer.measured[0])
    assert not report.tune.winner.startswith("bf16")


def test_explicit_options_are_not_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = use_timer(monkeypatch, {})
    model, inputs = resnet()
    graphopt.optimize(model, inputs, tune=True, memory_format="preserve", accuracy=3e-2)
    # each precision's likeliest winner first (built whatever the budget), then the rest
    assert timer.measured == [["captured graph, no passes", "bf16 preserve + oneDNN", "fp32 preserve + oneDNN", "bf16 preserve", "fp32 preserve"]]


def test_a_cache_hit_skips_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = use_timer(monkeypatch, {"fp32 channels_last": 1e-3})
    model, inputs = resnet()
    first = graphopt.optimize(model, inputs, tune=True)
    monkeypatch.setattr(tuning, "_memory_cache", {})  # a new process: only the file is left
    second = graphopt.optimize(model, inputs, tune=True)
    assert len(timer.measured) == 1
    assert (first.graphopt_report.tune.cache, second.graphopt_report.tune.cache) == ("miss", "hit")
    assert second.graphopt_report.tune.winner == "fp32 channels_last"
    assert "to_channels_last" in [p.name for p in second.graphopt_report.passes]
    assert "from the cache, not measured again" in str(second.graphopt_report)
    assert "; verified on this model: error " in second.graphopt_report.tune.why  # the cached choice held to accuracy here too
    other_batch = REFERENCE_MODELS["resnet"].example_inputs(3)
    graphopt.optimize(model, other_batch, tune=True)  # other input shapes: measured again
    assert len(timer.measured) == 2



def test_a_cached_choice_is_made_again_on_another_cpu_or_engine_version(monkeypatch: pytest.MonkeyPatch, with_engines: None) -> None:
    timer = use_timer(monkeypatch, {})
    monkeypatch.setattr(graphopt.api, "ENGINES", {name: info for name, info in ENGINES.items() if name != "inductor"})  # compiles: not needed here
    model, inputs = resnet()
    graphopt.optimize(model, inputs, tune=True)
    graphopt.optimize(model, inputs, tune=True)
    assert len(timer.measured) == 1  # remembered
    monkeypatch.setattr(timing, "cpu_signature", lambda: ["model name: another CPU"])
    graphopt.optimize(model, inputs, tune=True)
    assert len(timer.measured) == 2
    original = type(ENGINES["openvino"]).version
    monkeypatch.setattr(type(ENGINES["openvino"]), "version", lambda info: original(info) + ".1" if info.name == "openvino" else original(info))
    graphopt.optimize(model, inputs, tune=True)
    assert len(timer.measured) == 3


def test_onednn_kernels_are_a_candidate_on_cpu_inference(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {"fp32 channels_last + oneDNN": 1e-3})
    model, inputs = resnet()
    tuned = graphopt.optimize(model, inputs, tune=True)
    assert tuned.graphopt_report.tune.winner == "fp32 channels_last + oneDNN"
    assert [p.name for p in tuned.graphopt_report.passes][-3:] == ["use_onednn_kernels", "use_onednn_linear", "compute_in_place"]
    torch.testing.assert_close(tuned(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    training = graphopt.optimize(REFERENCE_MODELS["resnet"].build().train(), inputs, tune=True).graphopt_report
    assert not [c for c in training.tune.candidates if "oneDNN" in c.name]  # prepacked weights have no gradients


def test_compiling_candidates_wait_for_a_larger_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {})
    model, inputs = resnet()
    report = graphopt.optimize(model, inputs, tune=True).graphopt_report
    left_out = {c.name: c.reason for c in report.tune.candidates if "fuse" in c.name}
    assert left_out and all("tune_budget_s >= 120" in reason for reason in left_out.values())


def test_the_engine_candidates_share_one_capture_passes_and_conversion(monkeypatch: pytest.MonkeyPatch, with_engines: None) -> None:
    pytest.importorskip("openvino")  # installed by make test: the test skips only where the extra is left out
    from graphopt.backends import onnxruntime_engine, openvino_engine

    monkeypatch.delitem(ENGINES, "inductor")  # its candidates compile: not needed to count what the others share
    use_timer(monkeypatch, {"openvino fp32": 1e-3})
    counts = {"capture": 0, "passes": 0, "torch.export": 0, "openvino conversion": 0}

    def counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(graphopt.stages, "capture_graph", counted("capture", graphopt.stages.capture_graph))
    monkeypatch.setattr(graphopt.stages, "run_verified", counted("passes", graphopt.stages.run_verified))
    for module in (openvino_engine, onnxruntime_engine):
        monkeypatch.setattr(module, "export_program", counted("torch.export", module.export_program))
    monkeypatch.setattr(openvino_engine, "_convert", counted("openvino conversion", openvino_engine._convert))
    model, inputs = resnet()
    tuned = graphopt.optimize(model, inputs, tune=True, accuracy=3e-2)
    built = {c.name for c in tuned.graphopt_report.tune.candidates if c.status in ("measured", "over budget")}
    engine_candidates = {name for name in built if name.split()[0] in ("openvino", "onnxruntime")}
    assert {"openvino fp32", "onnxruntime fp32"} <= engine_candidates
    native_bf16 = "BF16" in openvino_engine.core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert ("openvino bf16" in engine_candidates) == native_bf16  # refused before converting on CPUs without it
    # graphopt's own candidates capture and run their passes each; the engines once for all of them
    own = len(built - engine_candidates)
    assert (counts["capture"], counts["passes"]) == (own + 1, own + 1)
    assert (counts["torch.export"], counts["openvino conversion"]) == (1, 1)
    assert tuned.graphopt_report.tune.winner == "openvino fp32"
    assert tuned.graphopt_report.engine.name == "openvino" and tuned.graphopt_report.engine.precision == "fp32"
    assert [p.name for p in tuned.graphopt_report.passes] and tuned.graphopt_report.captured_nodes
    torch.testing.assert_close(tuned(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    other = REFERENCE_MODELS["resnet"].example_inputs(3)
    torch.testing.assert_close(tuned(*other), model(*other), rtol=1e-4, atol=1e-5)


def test_a_failing_candidate_is_reported_and_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {})
    model, inputs = resnet()
    original = graphopt.api.build_candidate

    def flaky(model: nn.Module, example_inputs: Any, shared: Any, **options: Any) -> graphopt.OptimizedModule:
        if options.get("memory_format") == "channels_last":
            raise RuntimeError("layout broke")
        return original(model, example_inputs, shared, **options)

    monkeypatch.setattr(graphopt.api, "build_candidate", flaky)
    report = graphopt.optimize(model, inputs, tune=True).graphopt_report
    failed = {c.name: c.reason for c in report.tune.candidates if c.status == "failed"}
    assert failed == dict.fromkeys(["fp32 channels_last", "fp32 channels_last + oneDNN"], "RuntimeError: layout broke")
    assert report.tune.winner in names(report, "measured")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"accuracy": 0}, "accuracy=0"),
        ({"tune_budget_s": -1}, "tune_budget_s=-1"),
        # tune keeps the fastest candidate within accuracy: unverified, no candidate's error would be known
        ({"verify": False, "accuracy": 3e-2}, "verify=False would leave every error unmeasured. Leave verify out"),
        ({"verify": False}, "verify=False would leave every error unmeasured. Leave verify out"),
    ],
)
def test_bad_tuning_options(options: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = use_timer(monkeypatch, {})
    model, inputs = resnet()
    with pytest.raises(InvalidOptionError, match=message):
        graphopt.optimize(model, inputs, tune=True, **options)
    assert timer.measured == []  # refused before any candidate was built


def test_a_spent_budget_still_measures_the_reference_and_the_default_call(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = use_timer(monkeypatch, {})
    clock = use_clock(monkeypatch)
    original = graphopt.api.build_candidate

    def slow(model: nn.Module, example_inputs: Any, shared: Any, **options: Any) -> graphopt.OptimizedModule:
        clock.advance(10.0)  # each build takes 10 s on tune's clock, over half of tune_budget_s=1
        return original(model, example_inputs, shared, **options)

    monkeypatch.setattr(graphopt.api, "build_candidate", slow)
    model, inputs = resnet()
    report = graphopt.optimize(model, inputs, tune=True, tune_budget_s=1).graphopt_report
    assert timer.measured == [["captured graph, no passes", "default call"]]  # built whatever the budget
    cut = {c.name for c in report.tune.candidates if (c.status, c.reason) == ("not built", "tune_budget_s=1 spent on the candidates before it")}
    assert cut == {"fp32 channels_last + oneDNN", "fp32 channels_last", "fp32 preserve"}
    assert "fp32 preserve: not built: tune_budget_s=1 spent on the candidates before it" in str(report)


def test_a_budget_spent_on_int8_still_builds_each_float_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every precision class accuracy admits gets its likeliest candidate whatever the budget, the float ones first:
    int8's calibrating builds never leave bf16 unbuilt (EfficientNet-B0 lost its within-budget bf16 that way)."""
    timer = use_timer(monkeypatch, {})
    clock = use_clock(monkeypatch)
    original = graphopt.api.build_candidate
    built = []

    def slow(model: nn.Module, example_inputs: Any, shared: Any, **options: Any) -> graphopt.OptimizedModule:
        built.append(options.get("precision"))
        clock.advance(60.0)  # each build over tune_budget_s=1
        return original(model, example_inputs, shared, **options)

    monkeypatch.setattr(graphopt.api, "build_candidate", slow)
    monkeypatch.setattr(importlib.import_module("graphopt.passes.quantize_int8"), "compare_latency", lambda baseline, candidate, threshold, budget_s, asks: measured_as(2.0, 1.0, threshold))
    model, inputs = resnet()
    batches = [torch.randn_like(inputs[0]) for _ in range(2)]
    report = graphopt.optimize(model, inputs, tune=True, accuracy=5e-2, calibration=batches, tune_budget_s=1).graphopt_report
    assert timer.measured == [["captured graph, no passes", "default call", "bf16 channels_last + oneDNN", "int8 channels_last"]]
    assert built[2:] == ["bf16", "int8"]  # the float class before int8
    cut = {c.name for c in report.tune.candidates if (c.status, c.reason) == ("not built", "tune_budget_s=1 spent on the candidates before it")}
    assert cut == {"bf16 channels_last", "bf16 preserve", "fp32 channels_last + oneDNN", "fp32 channels_last", "fp32 preserve"}


def test_each_engine_gets_each_precision_class_before_any_other_candidate() -> None:
    engines = [ENGINES["openvino"], ENGINES["onnxruntime"]]
    todo, _ = tuning.candidates(resnet()[0], {}, 5e-2, ["bf16"], 60.0, onednn=True, int8=True, engines=engines)
    first = [candidate.name for candidate in todo if candidate.required]
    assert first == [
        "captured graph, no passes", "openvino bf16", "openvino fp32", "onnxruntime fp32", "default call", "bf16 channels_last + oneDNN",
        "openvino int8", "onnxruntime int8", "int8 channels_last",
    ]  # fmt: skip
    assert [candidate.name for candidate in todo][: len(first)] == first  # before every other candidate
    # an engine that compiles is among the rest, as graphopt's own fuse= candidates, and only with the budget for it
    todo, left_out = tuning.candidates(resnet()[0], {}, 5e-2, ["bf16"], 60.0, onednn=True, int8=True, engines=[*engines, ENGINES["inductor"]])
    assert [candidate.name for candidate in todo if candidate.required] == first
    assert {row.name: row.reason for row in left_out if row.name.startswith("inductor")} == {
        "inductor bf16": "compiles: needs tune_budget_s >= 120", "inductor fp32": "compiles: needs tune_budget_s >= 120",
    }  # fmt: skip
    todo, _ = tuning.candidates(resnet()[0], {}, 5e-2, ["bf16"], 120.0, onednn=True, int8=True, engines=[*engines, ENGINES["inductor"]])
    assert [(candidate.name, candidate.required) for candidate in todo if candidate.name.startswith("inductor")] == [("inductor bf16", False), ("inductor fp32", False)]
    fixed, _ = tuning.candidates(resnet()[0], {"engine": "openvino"}, 5e-2, ["bf16"], 60.0, int8=True, engines=engines)
    assert [(candidate.name, candidate.required) for candidate in fixed] == [("openvino bf16", True), ("openvino fp32", True), ("openvino int8", True)]


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def with_cancelling_weights(model: TwoLinears) -> TwoLinears:
    """Each output the difference of two hidden units near 300 that differ by 0.3 x-weighted: bf16 (spacing 2 there) loses it all."""
    with torch.no_grad():
        large = 300 + torch.rand(8, 8)
        model.up.weight.copy_(torch.cat([large, large + 0.3]))
        model.up.bias.zero_()
        model.down.weight.copy_(torch.cat([torch.eye(4), torch.zeros(4, 4), -torch.eye(4), torch.zeros(4, 4)], dim=1))
        model.down.bias.zero_()
    return model


@pytest.mark.filterwarnings("ignore:graphopt rolled back pass:graphopt.errors.VerificationWarning")  # fp32 kernels may reassociate over fp32's tolerance on this cancellation
def test_a_cached_choice_over_accuracy_with_other_weights_is_tuned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {"bf16 preserve": 1e-3})
    x = torch.randn(2, 8)
    assert graphopt.optimize(TwoLinears().eval(), x, tune=True, accuracy=3e-2).graphopt_report.tune.winner == "bf16 preserve"
    cancelling = with_cancelling_weights(TwoLinears().eval())  # the same architecture: the same cache key
    tuned = graphopt.optimize(cancelling, x, tune=True, accuracy=3e-2)
    report = tuned.graphopt_report.tune
    assert report.cache == "rejected"
    assert report.why.startswith("the cached choice bf16 preserve was rejected on this model (over budget: error ")
    assert "so tune measured again" in report.why
    assert not report.winner.startswith("bf16")
    for inputs in (x, torch.randn(3, 8)):  # the error against the original in float32, on the example and another batch
        expected = cancelling(inputs)
        assert (tuned(inputs) - expected).abs().max() <= 3e-2 * expected.abs().max()
    # the new choice replaced the cached one, and holds on this model: a hit now
    assert graphopt.optimize(cancelling, x, tune=True, accuracy=3e-2).graphopt_report.tune.cache == "hit"


class IncreasingRows(nn.Module):
    """Accepts only rows that increase: every second input graphopt resamples from the example is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert((x[:, 1:] > x[:, :-1]).all(), "each row must increase")
        return self.linear(x)


def test_an_error_not_measured_is_never_recorded_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {"captured graph, no passes": 1e-3})
    x = torch.rand(2, 4).cumsum(dim=1)
    with pytest.warns(VerificationWarning, match="no second input"):
        report = graphopt.optimize(IncreasingRows().eval(), x, tune=True).graphopt_report
    # no pass and no second input: nothing but the capture's own check against eager ran on the graph with no passes
    (reference,) = [c for c in report.tune.candidates if c.name == "captured graph, no passes"]
    assert reference.status == "measured" and reference.max_error is None
    assert "captured graph, no passes: 1.00 ms, error not measured" in str(report)
    assert report.tune.why.endswith("error not measured (a graph with no passes, checked against eager by the capture only) within accuracy 1e-04")


@pytest.mark.parametrize("int8_fastest", [True, False])
def test_calibration_makes_int8_a_candidate_that_wins_only_when_faster(int8_fastest: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {"int8 channels_last": 1e-4 if int8_fastest else 1.0, "fp32 channels_last + oneDNN": 1e-3})
    # every layer's int8 kernel 'measures' faster than its float32 one: the int8 candidate keeps them
    monkeypatch.setattr(importlib.import_module("graphopt.passes.quantize_int8"), "compare_latency", lambda baseline, candidate, threshold, budget_s, asks: measured_as(2.0, 1.0, threshold))
    model, inputs = resnet()
    batches = [torch.randn_like(inputs[0]) for _ in range(2)]
    tuned = graphopt.optimize(model, inputs, tune=True, accuracy=5e-2, calibration=batches)
    report = tuned.graphopt_report
    (int8,) = [c for c in report.tune.candidates if c.name == "int8 channels_last"]
    assert int8.status == "measured" and int8.options == {"precision": "int8", "memory_format": "channels_last", "accuracy": 5e-2}
    assert report.tune.winner == ("int8 channels_last" if int8_fastest else "fp32 channels_last + oneDNN")
    assert bool(int8_modules(tuned)) is int8_fastest
    assert report.max_error <= 5e-2


def test_explicit_options_rule_int8_out_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, {})
    model, inputs = resnet()
    report = graphopt.optimize(model, inputs, tune=True, memory_format="preserve", calibration=[inputs[0]]).graphopt_report
    (left_out,) = [c for c in report.tune.candidates if c.name == "int8"]
    assert left_out.status == "not built" and left_out.reason == "explicit memory_format= rules int8 out"
    with pytest.raises(InvalidOptionError, match="tune=True chooses the precision itself"):
        graphopt.optimize(model, inputs, tune=True, precision="int8", calibration=[inputs[0]])


class BatchRecordingTimer(FakeTimer):
    """A `FakeTimer` that also records the batch size (the first dimension of the output) each run computed."""

    def __init__(self, latencies: Mapping[str, float]) -> None:
        super().__init__(latencies)
        self.batches: set[int] = set()

    def __call__(self, runs: Mapping[str, Callable[[], Any]], **settings: Any) -> timing.Ranking:
        self.batches |= {run().shape[0] for run in runs.values()}
        return super().__call__(runs, **settings)


def throughput(batch: int, **options: Any) -> dict[str, Any]:
    return {"tune": True, "tune_target": "throughput", "tune_batch_size": batch, **options}


def test_throughput_times_every_candidate_at_the_given_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = BatchRecordingTimer({"fp32 preserve": 4e-3, "fp32 channels_last": 6e-3, "captured graph, no passes": 9e-3})
    monkeypatch.setattr(tuning, "measure_latencies", timer)
    use_clock(monkeypatch)
    model, inputs = resnet()  # batch 2
    tuned = graphopt.optimize(model, inputs, **throughput(5))
    report = tuned.graphopt_report
    assert timer.batches == {5} and len(timer.measured) == 1  # every candidate timed at batch 5, none at the example's
    assert report.tune.winner == "fp32 preserve"  # the stub's fastest call at that batch: the most samples per second
    assert (report.tune.target, report.tune.batch_size) == ("throughput", 5)
    assert "tune for throughput at batch 5: fp32 preserve (tuned in" in str(report)
    assert "highest throughput of" in report.tune.why and "at batch 5: 1250.0 samples/s (4.00 ms per call)" in report.tune.why
    assert "captured graph, no passes: 555.6 samples/s (9.00 ms per call), error" in str(report)
    assert graphopt.Report.from_dict(report.to_dict()).tune.batch_size == 5
    at_five = (inputs[0].repeat(3, 1, 1, 1)[:5],)
    torch.testing.assert_close(tuned(*at_five), model(*at_five), rtol=1e-4, atol=1e-5)


def test_a_latency_choice_is_not_reused_for_throughput(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = use_timer(monkeypatch, {"fp32 preserve": 1e-3})
    model, x = TwoLinears().eval(), torch.randn(2, 8)
    calls = [{"tune": True}, throughput(4), throughput(4), throughput(6), {"tune": True}]
    caches = [graphopt.optimize(model, x, **options).graphopt_report.tune.cache for options in calls]
    assert caches == ["miss", "miss", "hit", "miss", "hit"]  # each target and batch tuned once, on the same example
    assert len(timer.measured) == 3
    hit = graphopt.optimize(model, x, **throughput(4)).graphopt_report.tune
    assert (hit.target, hit.batch_size) == ("throughput", 4) and "tune for throughput at batch 4: fp32 preserve (from the cache" in "\n".join(hit.lines())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tune_target": "speed", "tune": True}, "unknown tune_target 'speed': use one of 'latency', 'throughput'"),
        ({"tune_target": "throughput", "tune_batch_size": 4}, "pass tune=True too, or leave tune_target out"),
        ({"tune": True, "tune_target": "throughput"}, "give that size, e.g. tune_batch_size=32"),
        ({"tune": True, "tune_batch_size": 4}, "tune_batch_size=4 is the batch tune_target='throughput' times the candidates at"),
        ({"tune_batch_size": 4}, "tune_batch_size=4 is the batch tune_target='throughput' times the candidates at"),
        (throughput(0), "tune_batch_size=0: give the number of samples per call"),
        (throughput(2.5), "tune_batch_size=2.5: give the number of samples per call"),
        (throughput(True), "tune_batch_size=True: give the number of samples per call"),
        # every size fixed: no candidate could run at another batch than the example's
        (throughput(4, dynamic_batch=False), "tune_batch_size=4 differs from the example's batch 2, and every size is fixed"),
        (throughput(4, dynamic_shapes=None), "give example inputs of batch 4, or let the batch vary (dynamic_shapes='batch', or leave it out)"),
    ],
)
def test_bad_throughput_options(options: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = use_timer(monkeypatch, {})
    model, inputs = resnet()
    with pytest.raises(InvalidOptionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        graphopt.optimize(model, inputs, **options)
    assert timer.measured == []  # refused before any candidate was built


class PairedRows(nn.Module):
    """Reads its batch as exactly two rows of 8: the batch dimension stays fixed at 2 in every candidate."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + x.reshape(16).sum()


def test_a_batch_the_model_fixes_is_refused_unless_it_is_the_example_s(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = BatchRecordingTimer({})
    monkeypatch.setattr(tuning, "measure_latencies", timer)
    x = torch.randn(2, 8)
    with pytest.raises(InvalidOptionError, match=r"tune_batch_size=4, and none accepts that batch \(x has shape \[4, 8\].*give example inputs of batch 4"):
        graphopt.optimize(PairedRows().eval(), x, **throughput(4))
    assert timer.measured == []
    report = graphopt.optimize(PairedRows().eval(), x, **throughput(2)).graphopt_report  # the example's own batch needs no other
    assert report.tune.batch_size == 2 and timer.batches == {2}


def test_a_candidate_that_refuses_the_batch_never_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = use_timer(monkeypatch, {"fp32 preserve + oneDNN": 1e-4})  # would win, but its batch is fixed at the example's
    use_clock(monkeypatch)  # the builds take no time: the budget cut leaves none out
    original = graphopt.api.build_candidate

    def fixed_onednn(model: nn.Module, example_inputs: Any, shared: Any, **options: Any) -> graphopt.OptimizedModule:
        if options.get("passes"):
            options["dynamic_shapes"] = None
        return original(model, example_inputs, shared, **options)

    monkeypatch.setattr(graphopt.api, "build_candidate", fixed_onednn)
    model = TwoLinears().eval()
    tuned = graphopt.optimize(model, torch.randn(2, 8), **throughput(3))
    report = tuned.graphopt_report.tune
    ((name, reason),) = [(c.name, c.reason) for c in report.candidates if c.status == "failed"]
    assert name == "fp32 preserve + oneDNN" and reason.startswith("InputMismatchError: x has shape [3, 8]")
    assert report.winner != name and name not in timer.measured[0]
    at_three = torch.randn(3, 8)
    torch.testing.assert_close(tuned(at_three), model(at_three), rtol=1e-4, atol=1e-5)


def test_throughput_is_refused_for_generate() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(InvalidOptionError, match=r"does not take tune_target='throughput' \(tune=True times generate\(\) per new token"):
        graphopt.optimize(model, torch.randint(1, 50, (2, 8)), **throughput(8))

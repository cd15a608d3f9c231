"""The benchmark harness: interleaving, per-round ratios, failures, errors, memory, load, CUDA timing.

Variants here are stubs and the clock is fake (a scripted ``measure``), so the medians
and ratios are checked exactly; no test depends on how fast anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

from graphopt.bench import harness
from graphopt.bench.harness import BenchModel, Harness, relative_error
from graphopt.bench.results import FOREIGN_CPU_WARNING, ModelResult
from graphopt.bench.variants import Runner, Setup, Variant, VariantSkipped
from graphopt.timing import round_order


def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())


TINY = BenchModel("tiny", tiny_model, lambda: (torch.randn(2, 3, 8, 8),))


def stub(key: str, log: list[str], role: str = "peer", scale: float = 1.0, **fields: Any) -> Variant:
    """A variant whose runner logs its key and returns eager's output times ``scale``; ``fields``: e.g. precision="low"."""

    def build(setup: Setup) -> Runner:
        def run() -> torch.Tensor:
            log.append(key)
            return setup.model(*setup.inputs) * scale

        return run

    return Variant(key, f"variant {key}", role, build, **fields)


class ScriptedClock:
    """A fake ``measure``: calls the runner, then returns the next scripted duration of that variant."""

    def __init__(self, seconds: dict[str, list[float]], log: list[str]) -> None:
        self.seconds = {key: iter(values) for key, values in seconds.items()}
        self.log = log

    def __call__(self, run: Runner) -> float:
        before = len(self.log)
        run()
        key = self.log[before]
        return next(self.seconds[key])


def unit_clock(run: Runner) -> float:
    """A fake ``measure``: every call takes one second."""
    run()
    return 1.0


REAL_MATMUL_GFLOPS = harness.matmul_gflops


def quiet_harness(variants: list[Variant], **options: Any) -> Harness:
    return Harness(variants, log=lambda message: None, **options)


RATES = {"fp32": 100.0, "bf16": 200.0, "int8": 400.0}  # GFLOP/s


@pytest.fixture(autouse=True)
def fixed_matmul_rates(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The machine's matrix-multiply rates, as a run measures them first: fixed here (a test may change them)."""
    rates = dict(RATES)
    monkeypatch.setattr(harness, "matmul_gflops", lambda dtype, size, device: rates[{torch.float32: "fp32", torch.int8: "int8"}.get(dtype, "bf16")])
    return rates


@pytest.fixture(autouse=True)
def no_foreign_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other test processes must not add load warnings to results checked here (one test sets its own)."""

    class Quiet(harness.ForeignLoad):
        def __exit__(self, *exc_info: object) -> None:
            self.cores = 0.0

    monkeypatch.setattr(harness, "ForeignLoad", Quiet)


def test_rounds_are_interleaved_and_ratios_are_per_round() -> None:
    log: list[str] = []
    # b is twice as fast as a in every round; its ratio must be 2 exactly, whatever the drift between rounds
    clock = ScriptedClock({"a": [0.010, 0.030, 0.020], "b": [0.005, 0.015, 0.010], "c": [0.040, 0.010, 0.020]}, log)
    variants = [stub("a", log, role="baseline"), stub("b", log, role="graphopt"), stub("c", log)]
    result = quiet_harness(variants, rounds=3, warmup=1, measure=clock).run_model(TINY)

    rounds = [name for index in range(3) for name in round_order(["a", "b", "c"], index)]
    assert log == ["a", "a", "b", "b", "c", "c"] + rounds  # first call + 1 warm-up each, then shuffled rounds
    a, b, c = result.variants
    assert a.samples_ms == pytest.approx([10.0, 30.0, 20.0])
    assert b.median_ms == pytest.approx(10.0)
    assert a.ratio == pytest.approx(1.0)
    assert b.round_ratios == pytest.approx([2.0, 2.0, 2.0])
    assert b.ratio == pytest.approx(2.0)
    assert c.round_ratios == pytest.approx([0.25, 3.0, 1.0])
    assert c.ratio == pytest.approx(1.0)
    assert result.fastest("peer") is c
    assert result.graphopt_vs_best_peer == pytest.approx(2.0)  # c / b per round: 8, 0.67, 2 -> median 2
    assert result.graphopt_vs_each_peer() == {"c": pytest.approx(2.0)}


def test_precision_classes_compare_graphopt_defaults_with_the_best_peer_of_each_class() -> None:
    log: list[str] = []
    clock = ScriptedClock(
        {"eager": [4.0, 4.0, 4.0], "ort": [2.0, 2.0, 2.0], "amp": [1.0, 2.0, 1.0], "default": [1.0, 1.0, 4.0], "fast": [0.5, 0.5, 0.5], "low": [2.0, 0.5, 1.0]},
        log,
    )
    variants = [
        stub("eager", log, role="baseline"),
        stub("ort", log, scale=1 + 1e-6),  # fp32 in another order: exact
        stub("amp", log, scale=1 + 1e-2),  # bf16: low
        stub("default", log, role="graphopt", class_default="exact"),
        stub("fast", log, role="graphopt"),
        stub("low", log, role="graphopt", scale=1 - 5e-3, class_default="low"),
    ]
    run = quiet_harness(variants, rounds=3, warmup=0, measure=clock)
    result = run.run_model(TINY)
    assert [v.precision_class for v in result.variants] == ["exact", "exact", "low", "exact", "exact", "low"]
    flops = 2 * (2 * 4 * 6 * 6) * (3 * 3 * 3)  # the conv's multiply-adds, two operations each
    assert result.flops == flops

    exact = result.class_summary("exact", RATES, "bf16")
    assert (exact["best_peer"], exact["graphopt_default"], exact["fastest_graphopt"]) == ("ort", "default", "fast")
    assert exact["default_vs_best_peer"] == pytest.approx(2.0)  # ort / default per round: 2, 2, 0.5
    assert exact["fastest_vs_best_peer"] == pytest.approx(4.0)
    assert exact["roofline_best_peer"] == pytest.approx(flops / 2.0 / 1e9 / RATES["fp32"])  # median 2 s
    low = result.class_summary("low", RATES, "bf16")
    assert (low["best_peer"], low["graphopt_default"]) == ("amp", "low")
    assert low["default_vs_best_peer"] == pytest.approx(1.0)  # amp / low per round: 0.5, 4, 1
    assert low["roofline_default"] == pytest.approx(flops / 1.0 / 1e9 / RATES["bf16"])

    data = result.to_dict(RATES, "bf16")
    assert data["flops"] == flops and data["classes"]["exact"] == exact and data["classes"]["low"] == low
    by_key = {v["key"]: v for v in data["variants"]}
    assert by_key["amp"]["precision_class"] == "low"
    assert by_key["ort"]["gflops"] == pytest.approx(flops / 2.0 / 1e9)  # every variant: its FLOP/s and roofline fraction
    assert by_key["ort"]["roofline_fraction"] == pytest.approx(exact["roofline_best_peer"])
    assert by_key["amp"]["roofline_fraction"] == pytest.approx(flops / 1.0 / 1e9 / RATES["bf16"])


def test_int8_variants_form_their_own_class_whatever_their_error() -> None:
    log: list[str] = []
    clock = ScriptedClock({"eager": [4.0, 4.0, 4.0], "amp": [1.0, 1.0, 1.0], "ov8": [1.0, 2.0, 1.0], "ours8": [0.5, 1.0, 2.0]}, log)
    variants = [
        stub("eager", log, role="baseline"),
        stub("amp", log, scale=1 + 1e-2),
        stub("ov8", log, scale=1 + 2e-2, precision="int8"),
        stub("ours8", log, role="graphopt", scale=1 - 1e-6, class_default="int8", precision="int8"),  # int8 even where exact
    ]
    result = quiet_harness(variants, rounds=3, warmup=0, measure=clock).run_model(TINY)
    assert [v.precision_class for v in result.variants] == ["exact", "low", "int8", "int8"]
    int8 = result.class_summary("int8", RATES, "bf16")
    assert (int8["best_peer"], int8["graphopt_default"]) == ("ov8", "ours8")
    assert int8["default_vs_best_peer"] == pytest.approx(2.0)  # ov8 / ours8 per round: 2, 2, 0.5
    assert int8["roofline_best_peer"] == pytest.approx(result.flops / 1.0 / 1e9 / RATES["int8"])
    assert result.class_summary("low", RATES, "bf16")["best_peer"] == "amp"


def test_low_precision_variants_are_skipped_where_the_low_dtype_is_slower_than_fp32(fixed_matmul_rates: dict[str, float]) -> None:
    fixed_matmul_rates["bf16"] = 2.0
    log: list[str] = []
    variants = [stub("eager", log, role="baseline"), stub("amp", log, precision="low"), stub("tune", log, role="graphopt", precision="auto")]
    run = quiet_harness(variants, rounds=2, warmup=0, measure=unit_clock)
    result = run.run_model(TINY)
    eager, amp, tune = result.variants
    assert (eager.status, amp.status, tune.status) == ("ok", "skipped", "ok")
    assert amp.reason == (
        "bf16 matrix products run at 2.0 GFLOP/s here, 50x slower than fp32's 100 (no native bf16 on this cpu): low-precision variants are not timed"
    )
    assert "amp" not in log
    assert run.new_result("test").machine["matmul_gflops"] == {"fp32": 100.0, "bf16": 2.0, "int8": 400.0}


def test_the_matmul_rate_and_the_flop_count_are_measured() -> None:
    assert REAL_MATMUL_GFLOPS(torch.float32, 64, torch.device("cpu"), budget_s=0.01) > 0
    assert REAL_MATMUL_GFLOPS(torch.int8, 64, torch.device("cpu"), budget_s=0.01) > 0  # oneDNN uint8 x int8
    assert harness.count_flops(nn.Linear(4, 3), (torch.randn(2, 4),)) == 2 * 2 * 4 * 3

    class Untraceable(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no")

    assert harness.count_flops(Untraceable(), (torch.randn(2),)) is None
    assert harness.count_flops(nn.ReLU(), (torch.randn(2),)) is None  # nothing counted: no roofline figure


def test_ratio_is_the_median_of_per_round_ratios_not_the_ratio_of_medians() -> None:
    log: list[str] = []
    clock = ScriptedClock({"a": [1.0, 2.0, 4.0], "b": [4.0, 1.0, 2.0]}, log)
    result = quiet_harness([stub("a", log, role="baseline"), stub("b", log)], rounds=3, warmup=0, measure=clock).run_model(TINY)
    b = result.variants[1]
    assert b.round_ratios == pytest.approx([0.25, 2.0, 2.0])
    assert b.ratio == pytest.approx(2.0)  # the ratio of the medians would be 2/2 = 1


def test_setup_time_memory_and_error_are_recorded() -> None:
    log: list[str] = []
    variants = [stub("a", log, role="baseline"), stub("b", log, scale=1.01)]
    result = quiet_harness(variants, rounds=2, warmup=0, measure=ScriptedClock({"a": [1, 1], "b": [1, 1]}, log)).run_model(TINY)
    a, b = result.variants
    assert a.max_error == 0.0
    assert b.max_error == pytest.approx(0.01, rel=1e-3)
    assert a.setup_s is not None and a.setup_s >= 0
    assert b.peak_memory_mb is None or b.peak_memory_mb >= 0  # None only where psutil is missing
    assert result.input_shapes == [[2, 3, 8, 8]]


def test_skipped_and_failing_variants_are_recorded_and_the_run_goes_on() -> None:
    log: list[str] = []

    def skipped(setup: Setup) -> Runner:
        raise VariantSkipped("not on this machine")

    def broken(setup: Setup) -> Runner:
        raise RuntimeError("no C++ compiler\nlong traceback text")

    calls = 0

    def fails_later(setup: Setup) -> Runner:
        def run() -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls > 2:
                raise RuntimeError("third call failed")
            log.append("late")
            return setup.model(*setup.inputs)

        return run

    variants = [
        stub("a", log, role="baseline"),
        Variant("skip", "skipped one", "peer", skipped),
        Variant("broken", "broken one", "peer", broken),
        Variant("late", "fails while timed", "peer", fails_later),
        stub("b", log),
    ]
    result = quiet_harness(variants, rounds=3, warmup=1, measure=unit_clock).run_model(TINY)
    outcomes = {v.key: v for v in result.variants}
    assert (outcomes["skip"].status, outcomes["skip"].reason) == ("skipped", "not on this machine")
    assert (outcomes["broken"].status, outcomes["broken"].reason) == ("failed", "RuntimeError: no C++ compiler")
    assert (outcomes["late"].status, outcomes["late"].reason) == ("failed", "RuntimeError: third call failed")
    assert outcomes["late"].samples_ms == []
    assert len(outcomes["a"].samples_ms) == len(outcomes["b"].samples_ms) == 3  # the rounds were rerun without it


def test_a_failing_baseline_skips_the_others_and_a_broken_model_is_recorded() -> None:
    def broken(setup: Setup) -> Runner:
        raise RuntimeError("eager is broken")

    log: list[str] = []
    result = quiet_harness([Variant("a", "eager", "baseline", broken), stub("b", log)], rounds=1).run_model(TINY)
    assert [v.status for v in result.variants] == ["failed", "skipped"]
    assert result.variants[1].reason.startswith("eager fp32 did not run")

    def no_model() -> nn.Module:
        raise ImportError("torchvision is not installed")

    broken_model = quiet_harness([stub("a", log, role="baseline")]).run_model(BenchModel("vision", no_model, lambda: ()))
    assert broken_model.error == "could not build it: ImportError: torchvision is not installed"


def test_time_budget_skips_what_has_not_started() -> None:
    log: list[str] = []
    result = quiet_harness([stub("a", log, role="baseline"), stub("b", log)], time_budget_s=0.0).run_model(TINY)
    assert [v.status for v in result.variants] == ["skipped", "skipped"]
    assert all(v.reason == "time budget of 0 s spent" for v in result.variants)
    assert log == []


def test_the_first_variant_must_be_the_baseline() -> None:
    with pytest.raises(ValueError, match="baseline"):
        Harness([stub("b", [])])


def test_relative_error_is_relative_to_the_output_scale() -> None:
    expected = (torch.tensor([1e-9, -2e-9]), torch.tensor([10.0, 0.0]))
    assert relative_error(expected, [np.array([1.1e-9, -2e-9]), np.array([10.0, 0.5])]) == pytest.approx(0.05)
    assert relative_error(torch.ones(2), torch.ones(3)) == float("inf")
    assert relative_error((torch.ones(2), torch.ones(2)), torch.ones(2)) == float("inf")
    assert relative_error(torch.zeros(2), torch.full((2,), 0.5)) == pytest.approx(0.5)  # zero scale: absolute


def test_foreign_load_while_timing_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    class Busy(harness.ForeignLoad):
        def __exit__(self, *exc_info: object) -> None:
            self.cores = FOREIGN_CPU_WARNING + 1.0

    monkeypatch.setattr(harness, "ForeignLoad", Busy)
    log: list[str] = []
    result = quiet_harness([stub("a", log, role="baseline")], rounds=1, measure=unit_clock).run_model(TINY)
    assert result.foreign_cpu == FOREIGN_CPU_WARNING + 1.0
    assert len(result.warnings) == 1 and "other processes kept 1.25 cores busy" in result.warnings[0]


def test_the_machine_busy_at_start_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness.os, "getloadavg", lambda: (64.0, 1.0, 1.0))
    result = quiet_harness([stub("a", [], role="baseline")]).new_result("graphopt bench")
    assert any("the machine was busy before the run (1-minute load average 64.0" in w for w in result.warnings)
    assert result.machine["cores"] and result.machine["cpu"] and result.machine["device"] == "cpu"


class FakeEvent:
    """Stands in for torch.cuda.Event: logs what the harness does with it."""

    log: list[str] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.name = "start" if not any(entry.startswith("new") for entry in self.log) else "end"
        self.log.append(f"new {self.name}")

    def record(self) -> None:
        self.log.append(f"{self.name}.record")

    def synchronize(self) -> None:
        self.log.append(f"{self.name}.synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        self.log.append("elapsed_time")
        return 250.0  # milliseconds, as CUDA reports them


def test_cuda_timing_synchronises_before_and_waits_for_the_end_event(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: FakeEvent.log.append("device.synchronize"))
    measured = harness.cuda_event_seconds(lambda: FakeEvent.log.append("run"))
    assert measured == pytest.approx(0.25)  # FakeEvent's 250 ms, in s
    assert FakeEvent.log == [
        "new start", "new end", "device.synchronize", "start.record", "run", "end.record", "end.synchronize", "elapsed_time",
    ]  # fmt: skip


def test_cuda_runs_use_events_cudnn_benchmark_and_allocator_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = (Harness([stub("a", [], role="baseline")], device="cuda").measure, Harness([stub("a", [], role="baseline")]).measure)
    expected = (harness.cuda_event_seconds, harness.wall_clock_seconds)  # which clock each device uses, not a duration
    assert all(timer is wanted for timer, wanted in zip(chosen, expected, strict=True))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    quiet_harness([stub("a", [], role="baseline")], device="cuda").run_model(BenchModel("x", lambda: 1 / 0, lambda: ()))
    assert torch.backends.cudnn.benchmark is True

    allocated = {"now": 100 * harness.MIB, "peak": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    with harness._PeakMemory(torch.device("cuda")) as memory:
        allocated["peak"] = 164 * harness.MIB
    assert memory.grown_mb == pytest.approx(64.0)
    assert "max_memory_allocated" in harness.memory_method(torch.device("cuda"))


def test_cpu_peak_memory_sees_a_temporary_allocation() -> None:
    pytest.importorskip("psutil")
    with harness._PeakMemory(torch.device("cpu")) as memory:
        block = torch.ones(64 * harness.MIB // 4)  # 64 MiB, touched
        for _ in range(500):  # until the sampling thread has seen it (it runs every millisecond)
            if memory._peak - memory._baseline > 32 * harness.MIB:
                break
            threading.Event().wait(0.01)
        del block  # freed before the block ends: only the sampler can have seen the peak
    assert memory.grown_mb is not None and memory.grown_mb > 32


def run_model_with(variants: list[Variant], **options: Any) -> ModelResult:
    return quiet_harness(variants, rounds=1, warmup=0, **options).run_model(TINY)


def test_runners_are_called_in_inference_mode() -> None:
    seen: list[bool] = []

    def build(setup: Setup) -> Runner:
        def run() -> torch.Tensor:
            seen.append(torch.is_inference_mode_enabled())
            return setup.model(*setup.inputs)

        return run

    run_model_with([Variant("a", "eager", "baseline", build)])
    assert seen and all(seen)


def builder_that(check: Callable[[Setup], None]) -> Callable[[Setup], Runner]:
    def build(setup: Setup) -> Runner:
        check(setup)
        return lambda: setup.model(*setup.inputs)

    return build


def test_variants_share_one_model_in_eval_mode_and_a_private_folder() -> None:
    seen: list[Setup] = []
    run_model_with([Variant("a", "eager", "baseline", builder_that(seen.append)), Variant("b", "b", "peer", builder_that(seen.append))])
    assert seen[0].model is seen[1].model and not seen[0].model.training
    assert seen[0].workdir.name.startswith("graphopt-bench-") and not seen[0].workdir.exists()  # removed afterwards

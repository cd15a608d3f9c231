"""compare_latency: interleaved medians; the warm-up round counts only for long calls."""

from __future__ import annotations

import pytest

from graphopt import timing


class FakeClock:
    """time.perf_counter for `graphopt.timing`: advanced only by the calls being timed."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def timed_call(clock: FakeClock, seconds: list[float]) -> tuple[list[int], object]:
    """A call that takes ``seconds[i]`` on its i-th call (the last figure repeats), and its call counter."""
    calls = [0]

    def run() -> None:
        clock.now += seconds[min(calls[0], len(seconds) - 1)]
        calls[0] += 1

    return calls, run


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_long_calls_count_the_warm_up_round(clock: FakeClock) -> None:
    baseline_calls, baseline = timed_call(clock, [2.0])
    candidate_calls, candidate = timed_call(clock, [1.2, 1.0])
    assert timing.compare_latency(baseline, candidate) == pytest.approx((2.0, 1.0))
    assert baseline_calls == candidate_calls == [3], "three rounds, the first of them the warm-up"


def test_short_calls_leave_the_warm_up_out_and_fill_the_budget(clock: FakeClock) -> None:
    baseline_calls, baseline = timed_call(clock, [0.1, 0.02])  # a slow first call: not a sample
    candidate_calls, candidate = timed_call(clock, [0.05, 0.01])
    assert timing.compare_latency(baseline, candidate, budget_s=2.0) == pytest.approx((0.02, 0.01))
    assert baseline_calls == candidate_calls == [1 + 13], "the warm-up, then 2 s / 0.15 s per round = 13 rounds"


def test_the_warm_up_counts_only_when_both_calls_are_long(clock: FakeClock) -> None:
    baseline_calls, baseline = timed_call(clock, [1.0])
    candidate_calls, candidate = timed_call(clock, [0.4, 0.3])
    assert timing.compare_latency(baseline, candidate) == pytest.approx((1.0, 0.3))
    assert baseline_calls == candidate_calls == [1 + 3]

"""graphopt.timing on a scripted clock: paired rounds in alternating order, the interval they stop on, the warm-up,
the budget, foreign load, the ranking, and the decision cache. No test times anything: the clock moves only when a
scripted call says so (tests/test_measurement.py runs the same code against a noisy machine)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
from scipy.stats import binom

from graphopt import timing


class FakeClock:
    """time.perf_counter for `graphopt.timing`: advanced only by the calls being timed."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def timed_call(clock: FakeClock, seconds: list[float], log: list[str] | None = None, name: str = "") -> tuple[list[int], Callable[[], None]]:
    """A call that takes ``seconds[i]`` on its i-th call (the last figure repeats), and its call counter."""
    calls = [0]

    def run() -> None:
        clock.now += seconds[min(calls[0], len(seconds) - 1)]
        calls[0] += 1
        if log is not None:
            log.append(name)

    return calls, run


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    monkeypatch.setattr(timing, "psutil", None)  # no foreign load from the real machine in these figures
    return fake


def test_rounds_alternate_the_order_and_stop_once_the_interval_is_clear(clock: FakeClock) -> None:
    log: list[str] = []
    baseline_calls, baseline = timed_call(clock, [0.1, 0.02], log, "A")  # a slow first call: not a sample
    candidate_calls, candidate = timed_call(clock, [0.05, 0.01], log, "B")
    result = timing.compare_latency(baseline, candidate, threshold=1.5, budget_s=100.0, asks="faster")
    assert (result.baseline_s, result.candidate_s, result.ratio) == pytest.approx((0.02, 0.01, 2.0))
    assert result.verdict == "clear" and result.faster and result.rounds == timing.MIN_ROUNDS
    assert baseline_calls == candidate_calls == [1 + timing.MIN_ROUNDS], "the warm-up, then the fewest rounds with a finite interval"
    assert log[2:8] == ["A", "B", "B", "A", "A", "B"], "each round after the warm-up swaps the order"
    assert result.foreign_cores is None and "not measured (psutil is not installed)" in result.describe()


def test_long_calls_count_the_warm_up_round(clock: FakeClock) -> None:
    baseline_calls, baseline = timed_call(clock, [2.0])
    candidate_calls, candidate = timed_call(clock, [1.2, 1.0])
    result = timing.compare_latency(baseline, candidate, budget_s=1.0, asks="faster")
    assert baseline_calls == candidate_calls == [timing.MIN_ROUNDS], "the warm-up is the first round; the budget cannot cut the minimum"
    assert result.rounds == timing.MIN_ROUNDS and result.ratio == pytest.approx(2.0)  # the median ignores the first 1.2 s


@pytest.mark.parametrize("long_first", ["baseline", "candidate"])
def test_one_long_first_call_counts_no_warm_up_as_a_round(clock: FakeClock, long_first: str) -> None:
    # only when every variant's first call is long is its extra cost small: a short first call may be mostly warm-up
    first = {"baseline": 0.1, "candidate": 0.05, long_first: 2.0}
    baseline_calls, baseline = timed_call(clock, [first["baseline"], 0.1])
    candidate_calls, candidate = timed_call(clock, [first["candidate"], 0.05])
    result = timing.compare_latency(baseline, candidate, threshold=1.5, budget_s=100.0, asks="faster")
    assert baseline_calls == candidate_calls == [1 + timing.MIN_ROUNDS], "both warm-ups, then the fewest rounds"
    assert (result.rounds, result.baseline_s, result.candidate_s, result.low, result.high) == pytest.approx((timing.MIN_ROUNDS, 0.1, 0.05, 2.0, 2.0))


def test_a_candidate_as_fast_as_the_threshold_is_close_and_measured_until_the_budget_is_spent(clock: FakeClock) -> None:
    # per-round ratios alternate 0.8x and 1.25x around 1.0: no interval clears it however many rounds
    baseline_calls, baseline = timed_call(clock, [0.01] * 200)
    candidate_calls, candidate = timed_call(clock, [0.01] + [0.0125, 0.008] * 100)
    result = timing.compare_latency(baseline, candidate, threshold=1.0, budget_s=0.5, asks="faster")
    assert result.verdict == "close" and not result.faster
    assert result.low < 1.0 < result.high and result.noise > 0.1
    # ~0.02 s per round: the warm-up and rounds while the next one still ends within 0.5 s
    assert clock.now <= 0.5 and baseline_calls[0] == candidate_calls[0] == 1 + result.rounds and result.rounds >= 20
    assert "within the measurement noise" in result.concern()


def test_cheap_calls_stop_at_the_round_limit(clock: FakeClock) -> None:
    _, baseline = timed_call(clock, [1e-4])
    _, candidate = timed_call(clock, [1e-4] + [1.25e-4, 0.8e-4] * 100)
    assert timing.compare_latency(baseline, candidate, budget_s=100.0, asks="faster").rounds == timing.MAX_ROUNDS


def test_a_clearly_slower_candidate_is_clear_and_not_faster(clock: FakeClock) -> None:
    _, baseline = timed_call(clock, [0.01])
    _, candidate = timed_call(clock, [0.03])
    result = timing.compare_latency(baseline, candidate, threshold=1.02, asks="faster")
    assert result.verdict == "clear" and not result.faster and result.high < 1.02 and result.rounds == timing.MIN_ROUNDS


@pytest.mark.parametrize("candidate_s, slower", [(0.0099, False), (0.0101, False), (0.0105, True)], ids=["1.01x", "0.99x", "0.95x"])
def test_the_rounds_stop_once_neither_rule_can_change_its_decision(clock: FakeClock, candidate_s: float, slower: bool) -> None:
    # steady calls: the interval is the ratio itself. At 1.01x and 0.99x the candidate is clearly neither 1.02x faster
    # (taken where it must be faster) nor slower by that margin (undone where it stays unless slower); at 0.95x clearly
    # slower: each settled after the fewest rounds, for both rules at once
    _, baseline = timed_call(clock, [0.01])
    _, candidate = timed_call(clock, [candidate_s])
    result = timing.compare_latency(baseline, candidate, threshold=1.02, budget_s=0.5, asks="either")
    assert not result.faster and result.slower is slower
    assert result.verdict == "clear" and result.settled and result.rounds == timing.MIN_ROUNDS


@pytest.mark.parametrize("asks", ["faster", "either"])
def test_rounds_go_on_while_the_interval_straddles_the_threshold_asked_about(clock: FakeClock, asks: timing.Question) -> None:
    # alternating 1.00x and 1.04x: the interval straddles 1.02x, so "is it 1.02x faster?" could still go either way
    _, baseline = timed_call(clock, [0.0104, 0.01] * 40)
    _, candidate = timed_call(clock, [0.01])
    result = timing.compare_latency(baseline, candidate, threshold=1.02, budget_s=0.5, asks=asks)
    assert result.verdict == "close" and not result.settled and result.rounds > timing.MIN_ROUNDS  # the fake clock's budget spent
    assert result.concern() == f"within the measurement noise after {result.rounds} rounds: its interval 1.00-1.04x straddles 1.02x"


@pytest.mark.parametrize(
    ("asks", "ratios", "straddles", "slower"),
    [
        ("slower", (1.00, 1.04), None, False),  # at least 1/1.02: not slower, however many more rounds (a pass stays)
        ("slower", (0.93, 0.97), None, True),  # below 1/1.02: slower (a pass is undone)
        ("slower", (0.96, 1.00), "0.98x", False),  # straddles 1/1.02: timed to the budget, the default kept
        ("faster", (0.96, 1.01), None, False),  # at most 1.02: not faster (int8 is left out), though it could be slower
        ("either", (0.96, 1.01), "0.98x", False),
    ],
)
def test_each_rule_stops_once_its_own_answer_is_settled(
    clock: FakeClock, asks: timing.Question, ratios: tuple[float, float], straddles: str | None, slower: bool
) -> None:
    _, baseline = timed_call(clock, [0.01 * ratios[0], 0.01 * ratios[1]] * 40)
    _, candidate = timed_call(clock, [0.01])
    result = timing.compare_latency(baseline, candidate, threshold=1.02, budget_s=0.5, asks=asks)
    assert (result.low, result.high) == pytest.approx(ratios) and result.asks == asks
    assert result.settled is (straddles is None) and result.slower is slower and not result.faster
    if straddles is None:
        assert result.verdict == "clear" and result.rounds == timing.MIN_ROUNDS, "the fewest rounds"
    else:
        assert result.verdict == "close" and result.rounds > timing.MIN_ROUNDS, "timed until the fake clock's budget was spent"
        assert result.concern().endswith(f"straddles {straddles}")


def test_the_candidate_s_time_follows_the_paired_ratio() -> None:
    # under load the medians of each side can contradict the rounds: here the candidate is 0.85x in 17 of 20 rounds,
    # yet its own median (8.82) is below the baseline's (10.50), as bursts slowed the baseline where the candidate ran fast
    baseline = [*range(1, 18), 100, 100, 100]
    candidate = [*(b / 0.85 for b in range(1, 18)), 0.5, 0.5, 0.5]
    result = timing.Comparison.of(baseline, candidate, 1.02, foreign_cores=0.0)
    assert result.baseline_s == 10.5 and result.ratio == pytest.approx(0.85) and result.slower
    assert result.candidate_s == pytest.approx(10.5 / 0.85), "the time the ratio says, not the candidate's median"


def test_a_remembered_decision_that_is_not_settled_is_measured_again(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # written when "clear" meant clear of the threshold: under 1.02x, but it could still be slower by that margin
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    key = timing.decision_key("a pass")
    timing.remember(key, timing.Comparison(1.01, 1.0, 1.01, 0.97, 1.015, 1.02, 8, 0.0, "clear"))
    assert timing.remembered(key) is None
    settled = timing.Comparison.of([0.99] * 8, [1.0] * 8, 1.02, foreign_cores=0.0)
    timing.remember(key, settled)
    assert settled.verdict == "clear" and timing.remembered(key) == settled
    # the same interval asked only "is it slower?" (a pass of the preset) is settled: not slower
    not_slower = timing.Comparison.of([1.0, 1.04] * 4, [1.0] * 8, 1.02, foreign_cores=0.0, asks="slower")
    timing.remember(key, not_slower)
    assert not_slower.verdict == "clear" and timing.remembered(key) == not_slower


@pytest.mark.parametrize("count", [*range(1, 60), 200])
def test_the_median_interval_is_the_widest_cut_that_keeps_its_confidence(count: int) -> None:
    low, high = timing.median_interval(list(range(1, count + 1)))  # values 1..n: the interval names its order statistics
    if count < timing.MIN_ROUNDS:
        assert (low, high) == (-math.inf, math.inf)
        return
    cut = low
    assert high == count + 1 - cut, "symmetric"
    coverage = 1 - 2 * binom.cdf(cut - 1, count, 0.5)
    assert coverage >= timing.CONFIDENCE > 1 - 2 * binom.cdf(cut, count, 0.5), "the interval one value narrower would not hold"


def test_the_ranking_shuffles_the_order_and_stops_when_the_winner_is_clear(clock: FakeClock) -> None:
    log: list[str] = []
    variants = {name: timed_call(clock, [seconds], log, name)[1] for name, seconds in (("a", 0.03), ("b", 0.01), ("c", 0.02))}
    ranking = timing.rank_latencies(variants, budget_s=100.0)
    assert (ranking.winner, ranking.runner_up, ranking.verdict) == ("b", "c", "clear")
    assert ranking.medians == pytest.approx({"a": 0.03, "b": 0.01, "c": 0.02}) and ranking.ratio == pytest.approx(2.0)
    assert ranking.rounds == timing.MIN_ROUNDS
    rounds = [log[3 + 3 * index : 6 + 3 * index] for index in range(ranking.rounds)]
    assert rounds == [timing.round_order(["a", "b", "c"], index) for index in range(ranking.rounds)]


def test_round_order_puts_each_variant_after_different_ones() -> None:
    names = ["eager", "graphopt", "openvino", "onnxruntime"]
    orders = [timing.round_order(names, index) for index in range(10)]
    assert all(sorted(order) == sorted(names) for order in orders) and orders == [timing.round_order(names, i) for i in range(10)]
    before = {name: {order[order.index(name) - 1] for order in orders if order.index(name) > 0} for name in names}
    assert all(len(predecessors) >= 2 for predecessors in before.values()), before  # a fixed or rotating order gives one
    assert [timing.round_order(["a", "b"], index) for index in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]


def test_the_benchmarks_rounds_follow_round_order() -> None:
    log: list[str] = []
    timing.interleaved_samples({name: (lambda name=name: log.append(name)) for name in "abcd"}, rounds=3, warmup=0)
    assert log == [name for index in range(3) for name in timing.round_order(list("abcd"), index)]


def test_a_ranking_of_equals_is_close_within_its_budget(clock: FakeClock) -> None:
    calls_a, a = timed_call(clock, [0.01] + [0.0125, 0.008] * 100)
    calls_b, b = timed_call(clock, [0.01])
    ranking = timing.rank_latencies({"a": a, "b": b}, budget_s=0.3)
    assert ranking.verdict == "close" and "as fast within the measurement noise" in ranking.concern()
    assert clock.now <= 0.3 and calls_a == calls_b == [1 + ranking.rounds]


def test_foreign_load_is_system_busy_time_minus_our_own(monkeypatch: pytest.MonkeyPatch) -> None:
    readings: dict[str, Iterator[float]] = {"busy": iter([100.0, 103.0]), "own": iter([10.0, 11.0]), "clock": iter([0.0, 2.0])}
    monkeypatch.setattr(timing, "_busy_seconds", lambda: next(readings["busy"]))
    monkeypatch.setattr(timing, "_own_seconds", lambda: next(readings["own"]))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(readings["clock"]))
    with timing.ForeignLoad() as probe:
        pass
    assert probe.cores == pytest.approx(1.0)  # (3 busy - 1 ours) on the fake clock's 2 units


def test_over_the_limit_of_foreign_load_the_verdict_is_disturbed_whatever_the_interval() -> None:
    quiet = timing.Comparison.of([2.0] * 8, [1.0] * 8, 1.02, foreign_cores=timing.FOREIGN_LOAD_LIMIT)
    busy = timing.Comparison.of([2.0] * 8, [1.0] * 8, 1.02, foreign_cores=timing.FOREIGN_LOAD_LIMIT + 0.01)
    assert (quiet.verdict, busy.verdict) == ("clear", "disturbed")
    assert busy.faster, "the interval still decides; the verdict says not to trust it beyond this run"
    assert "cores busy on average" in busy.concern() and quiet.concern() == ""


def test_only_clear_decisions_are_remembered_and_a_later_unclear_one_forgets(clock: FakeClock, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    clear = timing.Comparison.of([2.0] * 8, [1.0] * 8, 1.02, foreign_cores=0.0)
    close = timing.Comparison.of([1.0, 1.1] * 4, [1.1, 1.0] * 4, 1.02, foreign_cores=0.0)
    key = timing.decision_key("a pass", [1, 2, 3])
    assert timing.remembered(key) is None
    timing.remember(key, close)
    assert timing.remembered(key) is None and not (tmp_path / "measured.json").exists()
    timing.remember(key, clear)
    assert timing.remembered(key) == clear
    assert timing.decision_key("a pass", [1, 2, 4]) != key and timing.remembered(timing.decision_key("a pass", [1, 2, 4])) is None
    timing.remember(key, close)
    assert timing.remembered(key) is None, "a measurement that is no longer clear drops the old decision"
    (tmp_path / "measured.json").write_text("{not json")
    assert timing.remembered(key) is None  # a damaged cache costs a measurement, not a crash


def test_the_cpu_is_part_of_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    key = timing.decision_key("a pass")
    monkeypatch.setattr(timing, "cpu_signature", lambda: ["model name: another CPU"])
    assert timing.decision_key("a pass") != key

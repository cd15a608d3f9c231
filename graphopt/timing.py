"""Latency measurement that holds on a busy machine: paired interleaved rounds until the answer is clear.

Variants run in rounds after a warm-up call each, one call per variant per round, the order
changing from round to round (two alternate, A B, B A, ...; more are shuffled: `round_order`),
so slow drift, bursts of other load and what one call leaves behind for the next fall on all
of them alike. Each round gives a paired ratio (the baseline's time over the candidate's, taken
a moment apart); the decision
rests on the median of those ratios and its `CONFIDENCE` interval (order statistics, as the
sign test: no assumption about the shape of the noise, and a burst that slows one call makes
one extreme ratio, not a shifted mean). Rounds go on until the decision is settled or the budget
(seconds, or `MAX_ROUNDS`) is spent; `MIN_ROUNDS` rounds always run, the fewest whose interval is
finite. Two rules decide on a `Comparison`, and the caller says which it asks (``asks``): a
candidate the caller's default leaves out (int8 against float32) is taken only where
`Comparison.faster` (``asks="faster"``: the interval above the threshold); a candidate the default
includes (a measured pass of the preset, a oneDNN kernel, the compiled decode step, OpenVINO's model
compiled for the example's shapes) stays unless `Comparison.slower` (``asks="slower"``: the interval
below the threshold's inverse, slower by more than the gain a candidate must show, 1/1.02 for a
pass), so that a measurement that stays within the noise, as under other processes' load, leaves the
default and repeated runs agree. Rounds stop once the rule asked can no longer change its answer
(`Comparison.settled`): for "faster", the interval above the threshold or at most at it; for "slower",
below the inverse or at least at it (a pass 1.01x faster stops after the fewest rounds, where one
straddling 0.98x is timed to the budget); ``asks="either"`` waits for both.

Every measurement also records how many cores other processes kept busy meanwhile (`ForeignLoad`:
the system's busy CPU time minus this process's own, from psutil; unknown without it). The
verdict: ``"clear"`` (the interval is settled), ``"close"`` (not
when the budget is spent: the caller keeps its stated default) or ``"disturbed"`` (other processes
kept more than `FOREIGN_LOAD_LIMIT` cores busy on average: the figures are flagged and a decision
is not remembered, whatever the interval says).

A decision measured "clear" is remembered (`remembered`, `remember`) in
``$GRAPHOPT_CACHE_DIR/measured.json`` (default ``~/.cache/graphopt``, beside tune's cache),
under a key the caller derives from what the decision depends on, this CPU included
(`cpu_signature`); ``GRAPHOPT_REMEASURE=1`` (`remeasure_requested`) measures again.

`compare_latency` decides between two variants (a measured pass, a kernel, int8 against
float32), `rank_latencies` ranks several (tune's candidates): it stops once the fastest is clear
of the runner-up. `median_latencies` and `interleaved_samples` are the plain fixed-round forms
the benchmark and ``graphopt demo`` report figures with. Only ratios measured together mean
anything.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

try:
    import psutil
except ImportError:  # foreign load degrades to "not measured": no verdict is "disturbed"
    psutil = None

LONG_CALL_S = 0.5  # calls this long (every variant's) count their warm-up call as the first round
CONFIDENCE = 0.99  # of the interval a decision rests on; every round is a look at it, so it is kept high
MIN_ROUNDS = 8  # the fewest rounds whose 99% interval of a median is finite (2 / 2**8 < 1%)
MAX_ROUNDS = 50  # beyond this even cheap calls stop: the noise, not the sample size, limits the answer
FOREIGN_LOAD_LIMIT = 0.25  # cores other processes may keep busy on average before a measurement is "disturbed"
REMEASURE_VARIABLE = "GRAPHOPT_REMEASURE"  # set to 1: remembered decisions are measured again (and remembered anew)

Verdict = Literal["clear", "close", "disturbed"]
Question = Literal["faster", "slower", "either"]  # which rule a comparison's caller applies (`Comparison.settled`)
Measure = Callable[[Callable[[], Any]], float]


def wall_clock_seconds(run: Callable[[], Any]) -> float:
    """Seconds one call of ``run`` takes on the host's monotonic clock."""
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def round_order(names: Sequence[str], index: int) -> list[str]:
    """The order of round ``index``: a permutation of ``names``, another each round, the same on every run.

    A fixed order (A B C A B C ...), or a rotating one, runs each variant after the same other
    variant almost every round, and a call pays for what the call before it left behind (caches
    it evicted, a runtime's threads still spinning on the cores); shuffled rounds spread that over
    every variant. Two variants simply alternate (A B, B A, ...)."""
    names = list(names)
    if len(names) == 2:
        return names if index % 2 == 0 else names[::-1]
    return random.Random(index).sample(names, len(names))


def interleaved_samples(
    variants: Mapping[str, Callable[[], Any]],
    rounds: int = 20,
    warmup: int = 3,
    measure: Measure = wall_clock_seconds,
) -> dict[str, list[float]]:
    """Seconds of each call, per variant, one call per variant per round, in `round_order`.

    ``measure`` times one call (the CUDA benchmark passes one that uses CUDA events).
    """
    for run in variants.values():
        for _ in range(warmup):
            run()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(rounds):
        for name in round_order(list(variants), index):
            samples[name].append(measure(variants[name]))
    return samples


def median_latencies(
    variants: Mapping[str, Callable[[], Any]],
    rounds: int = 20,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, measured interleaved."""
    samples = interleaved_samples(variants, rounds, warmup)
    return {name: statistics.median(times) for name, times in samples.items()}


def _busy_seconds() -> float:
    """CPU seconds all cores spent on anything but idling (guest time is already counted as user time)."""
    times = psutil.cpu_times()._asdict()
    return sum(value for name, value in times.items() if name not in ("idle", "iowait", "guest", "guest_nice"))


def _own_seconds() -> float:
    """CPU seconds this process (every thread) and its waited-for children spent."""
    times = psutil.Process().cpu_times()
    return times.user + times.system + times.children_user + times.children_system


class ForeignLoad:
    """Average number of cores other processes kept busy inside a ``with`` block (``cores`` None without psutil)."""

    cores: float | None = None

    def __enter__(self) -> ForeignLoad:
        if psutil is not None:
            self._start = (_busy_seconds(), _own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc_info: object) -> None:
        if psutil is None:
            return
        busy, own, started = self._start
        wall = time.perf_counter() - started
        if wall > 0:
            self.cores = max(0.0, ((_busy_seconds() - busy) - (_own_seconds() - own)) / wall)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free ``confidence`` interval of the median of ``values``: two order statistics.

    The k-th smallest and k-th largest value bound the median with probability at least
    1 - 2 P(Binomial(n, 1/2) < k) (the sign test's interval); k is the largest that keeps this
    at ``confidence``. Too few values for that give (-inf, inf).
    """
    ordered = sorted(values)
    count = len(ordered)
    tail = (1 - confidence) / 2
    cut, below = 0, 0.0  # values cut from each end; below = P(Binomial(count, 1/2) < cut)
    while below + math.comb(count, cut) / 2**count <= tail:
        below += math.comb(count, cut) / 2**count
        cut += 1
    if cut == 0:
        return -math.inf, math.inf
    return ordered[cut - 1], ordered[count - cut]


def _settled(low: float, high: float, threshold: float, asks: Question) -> bool:
    """More rounds cannot change the answer to ``asks`` for the interval [low, high] of a paired ratio.

    "faster": the interval is above ``threshold`` (faster) or at most at it (not faster); "slower":
    below its inverse (slower by the same margin) or at least at it (not slower); "either": both.
    """
    faster_settled = low > threshold or high <= threshold
    slower_settled = high < 1.0 / threshold or low >= 1.0 / threshold
    return {"faster": faster_settled, "slower": slower_settled, "either": faster_settled and slower_settled}[asks]


def _verdict(clear: bool, foreign_cores: float | None) -> Verdict:
    if foreign_cores is not None and foreign_cores > FOREIGN_LOAD_LIMIT:
        return "disturbed"
    return "clear" if clear else "close"


def _load_text(foreign_cores: float | None) -> str:
    if foreign_cores is None:
        return "other processes' load not measured (psutil is not installed)"
    return f"other processes kept {foreign_cores:.2f} cores busy"


@dataclass(frozen=True)
class Comparison:
    """A baseline against a candidate, measured in paired rounds (`compare_latency`)."""

    baseline_s: float  # median seconds per call
    # baseline_s over ratio: the candidate's time as the paired rounds put it (under load its own median can contradict
    # the ratio: 62.54 ms without, 43.80 ms with, at 0.85x)
    candidate_s: float
    ratio: float  # how many times faster the candidate ran: the median of the rounds' baseline / candidate
    low: float  # the `CONFIDENCE` interval of that median
    high: float
    threshold: float  # the candidate counts as faster only when the whole interval is above it
    rounds: int
    foreign_cores: float | None  # cores other processes kept busy on average (None: not measured)
    verdict: Verdict
    asks: Question = "either"  # the rule the caller applies: what "clear" (`settled`) means
    anchored: bool = False  # baseline_s is an earlier measurement of the same graph, candidate_s that over ratio

    @classmethod
    def of(
        cls, baseline: Sequence[float], candidate: Sequence[float], threshold: float, foreign_cores: float | None = None, asks: Question = "either"
    ) -> Comparison:
        """The comparison that paired samples (seconds, round by round) support, for the rule ``asks``."""
        ratios = [b / c if c > 0 else math.inf for b, c in zip(baseline, candidate, strict=True)]
        low, high = median_interval(ratios)
        baseline_s, ratio = statistics.median(baseline), statistics.median(ratios)
        return cls(
            baseline_s, baseline_s / ratio if ratio > 0 else math.inf, ratio, low, high, threshold,
            len(ratios), foreign_cores, _verdict(_settled(low, high, threshold, asks), foreign_cores), asks,
        )  # fmt: skip

    @property
    def faster(self) -> bool:
        """The candidate is faster than the threshold asks, beyond the noise: a default without it takes it only then."""
        return self.low > self.threshold

    @property
    def slower(self) -> bool:
        """The candidate is slower than the baseline by more than the threshold's margin, beyond the noise (the whole
        interval below 1 / threshold; below 1 with the default threshold of 1).

        A default that includes the candidate (a measured pass of the preset, a kernel a pass chose)
        keeps it unless this holds: a measurement within the noise, however loaded the machine,
        leaves the default's choice, so that repeated runs agree.
        """
        return self.high < 1.0 / self.threshold

    @property
    def settled(self) -> bool:
        """The answer to the rule the caller asks (`faster`, `slower` or both) cannot change with more rounds: see `_settled`."""
        return _settled(self.low, self.high, self.threshold, self.asks)

    @property
    def noise(self) -> float:
        """Half the interval's width relative to the ratio: the measurement's uncertainty (0.05: about ±5%)."""
        return (self.high - self.low) / (2 * self.ratio) if self.ratio > 0 else math.inf

    def anchored_to(self, baseline_s: float) -> Comparison:
        """The same measurement reported against an earlier figure for the same baseline graph.

        Absolute times move with the machine's load; the paired ratio does not. A report whose
        next measurement starts from the graph the previous one ended with shows one time for
        that graph (the earlier one) and the candidate's as that time over this ratio.
        """
        return replace(self, baseline_s=baseline_s, candidate_s=baseline_s / self.ratio, anchored=True)

    def describe(self) -> str:
        """``2.00x (99% interval 1.95-2.05x, 8 paired rounds; other processes kept 0.01 cores busy): clear``."""
        interval = f"{CONFIDENCE:.0%} interval {self.low:.2f}-{self.high:.2f}x, {self.rounds} paired rounds"
        return f"{self.ratio:.2f}x ({interval}; {_load_text(self.foreign_cores)}): {self.verdict}"

    def concern(self) -> str:
        """What a verdict other than "clear" means for the decision ("" for a clear one)."""
        if self.verdict == "disturbed":
            return (
                f"other processes kept {self.foreign_cores:.2f} cores busy on average (more than {FOREIGN_LOAD_LIMIT}) while it was "
                "measured: its figures are unreliable and the decision is not reused; measure on a quieter machine to settle it"
            )
        if self.verdict == "close":
            edge = self.threshold if self.asks == "faster" or (self.asks == "either" and self.high > self.threshold) else 1.0 / self.threshold
            return f"within the measurement noise after {self.rounds} rounds: its interval {self.low:.2f}-{self.high:.2f}x straddles {edge:.2f}x"
        return ""


@dataclass(frozen=True)
class Ranking:
    """Several variants measured in shuffled rounds (`rank_latencies`): the fastest and how clearly."""

    medians: dict[str, float]  # median seconds per call of each variant
    winner: str  # the lowest median
    runner_up: str | None  # the next lowest (None: a single variant)
    ratio: float  # how many times faster the winner ran than the runner-up: median of the rounds' ratios
    low: float  # its `CONFIDENCE` interval
    high: float
    rounds: int
    foreign_cores: float | None
    verdict: Verdict  # "clear": the interval is above 1 (or a single variant); "close": the two are as fast within the noise

    @classmethod
    def of(cls, samples: Mapping[str, Sequence[float]], foreign_cores: float | None = None) -> Ranking:
        """The ranking that shuffled-round samples (seconds per variant, round by round) support."""
        medians = {name: statistics.median(times) for name, times in samples.items()}
        ranked = sorted(medians, key=medians.__getitem__)
        rounds = len(samples[ranked[0]])
        if len(ranked) == 1:
            return cls(medians, ranked[0], None, 1.0, 1.0, 1.0, rounds, foreign_cores, _verdict(True, foreign_cores))
        winner, runner_up = ranked[:2]
        ratios = [r / w if w > 0 else math.inf for w, r in zip(samples[winner], samples[runner_up], strict=True)]
        low, high = median_interval(ratios)
        return cls(medians, winner, runner_up, statistics.median(ratios), low, high, rounds, foreign_cores, _verdict(low > 1.0, foreign_cores))

    def describe(self) -> str:
        """How clearly the winner won, in words."""
        if self.runner_up is None:
            return f"alone in {self.rounds} rounds ({_load_text(self.foreign_cores)}): {self.verdict}"
        interval = f"{CONFIDENCE:.0%} interval {self.low:.2f}-{self.high:.2f}x, {self.rounds} rounds"
        return f"{self.ratio:.2f}x as fast as the runner-up ({interval}; {_load_text(self.foreign_cores)}): {self.verdict}"

    def concern(self) -> str:
        """What a verdict other than "clear" means for the choice ("" for a clear one)."""
        if self.verdict == "disturbed":
            return (
                f"other processes kept {self.foreign_cores:.2f} cores busy on average (more than {FOREIGN_LOAD_LIMIT}) while the "
                "candidates were timed, so the choice is not remembered; tune on a quieter machine to settle it"
            )
        if self.verdict == "close":
            return f"{self.winner} and {self.runner_up} are as fast within the measurement noise after {self.rounds} rounds; the lower median won"
        return ""


def _paired_rounds(
    variants: Mapping[str, Callable[[], Any]],
    budget_s: float,
    settled: Callable[[Mapping[str, list[float]]], bool],
    measure: Measure,
) -> tuple[dict[str, list[float]], float | None]:
    """Samples (seconds per variant, round by round) and the foreign load while they were taken.

    One warm-up call per variant (when every one takes `LONG_CALL_S` or more, what a first
    call costs extra is small against it and the warm-up counts as the first round), then
    rounds in `round_order` until ``settled(samples)`` holds, `MAX_ROUNDS` are taken, or the
    next round would end past ``budget_s`` (counted from the warm-up); never fewer than `MIN_ROUNDS`.
    """
    names = list(variants)
    started = time.perf_counter()
    first = {name: measure(run) for name, run in variants.items()}
    samples = {name: [first[name]] if min(first.values()) >= LONG_CALL_S else [] for name in names}
    round_s = sum(first.values())
    with ForeignLoad() as load:
        while (taken := len(samples[names[0]])) < MIN_ROUNDS or not (
            taken >= MAX_ROUNDS or time.perf_counter() - started + round_s > budget_s or settled(samples)
        ):
            round_started = time.perf_counter()
            for name in round_order(names, taken):
                samples[name].append(measure(variants[name]))
            round_s = time.perf_counter() - round_started
    return samples, load.cores


def compare_latency(
    baseline: Callable[[], Any],
    candidate: Callable[[], Any],
    threshold: float = 1.0,
    budget_s: float = 2.0,
    measure: Measure = wall_clock_seconds,
    *,
    asks: Question,
) -> Comparison:
    """``baseline`` against ``candidate`` in paired rounds (A B, B A, ...) until the answer to ``asks`` is settled.

    ``asks="faster"``: the caller takes the candidate only where `Comparison.faster` (the interval of
    the paired ratio above ``threshold``, how many times faster it must be); ``asks="slower"``: the
    caller has it by default and drops it only where `Comparison.slower` (the interval below the
    threshold's inverse). Stops as soon as that answer cannot change (`Comparison.settled`), or when
    ``budget_s`` is spent (at least `MIN_ROUNDS` rounds: a long call may overrun it); a close result
    leaves the caller's default.
    """
    samples, foreign = _paired_rounds(
        {"baseline": baseline, "candidate": candidate},
        budget_s,
        lambda s: Comparison.of(s["baseline"], s["candidate"], threshold, asks=asks).verdict == "clear",
        measure,
    )
    return Comparison.of(samples["baseline"], samples["candidate"], threshold, foreign, asks)


def rank_latencies(variants: Mapping[str, Callable[[], Any]], budget_s: float = 10.0, measure: Measure = wall_clock_seconds) -> Ranking:
    """Every variant in shuffled rounds (`round_order`) until the fastest is clear of the runner-up.

    Stops when the interval of the runner-up's paired ratio to the fastest is above 1, or when
    ``budget_s`` is spent (at least `MIN_ROUNDS` rounds).
    """
    samples, foreign = _paired_rounds(variants, budget_s, lambda s: Ranking.of(s).verdict == "clear", measure)
    return Ranking.of(samples, foreign)


def cache_directory() -> Path:
    """Where graphopt keeps what it measured on this machine: ``$GRAPHOPT_CACHE_DIR``, default ``~/.cache/graphopt``."""
    return Path(os.environ.get("GRAPHOPT_CACHE_DIR", Path.home() / ".cache" / "graphopt"))


def _decisions_file() -> Path:
    return cache_directory() / "measured.json"


def remeasure_requested() -> bool:
    """Whether the environment asks to measure remembered decisions again (``GRAPHOPT_REMEASURE=1``)."""
    return os.environ.get(REMEASURE_VARIABLE, "").strip() not in ("", "0")


@functools.cache
def cpu_signature() -> list[str]:
    """What makes one CPU time differently from another: its model name and instruction-set flags."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = ("model name", "flags", "Features", "CPU part")  # x86 names and flags; Arm's features and part
        found = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in lines if ":" in line and line.split(":", 1)[0].strip() in wanted}
        if found:
            return [f"{name}: {value}" for name, value in sorted(found.items())]
    return [platform.machine(), platform.processor(), platform.platform()]


def decision_key(*parts: Any) -> str:
    """A short stable key for a decision from JSON-ready ``parts`` (the caller names what the decision depends on)."""
    return hashlib.sha256(json.dumps([cpu_signature(), *parts], default=repr).encode()).hexdigest()[:32]


def _stored() -> dict[str, Any]:
    try:
        stored = json.loads(_decisions_file().read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def remembered(key: str) -> Comparison | None:
    """The clear comparison remembered under ``key`` on this machine, or None (also for an unreadable entry)."""
    entry = _stored().get(key)
    try:
        comparison = Comparison(**entry)
    except TypeError:  # missing, or written by another graphopt version
        return None
    # an entry written under another rule for "clear" (or none: "either", the strictest) is measured again
    return comparison if comparison.verdict == "clear" and comparison.settled else None


def remember(key: str, comparison: Comparison) -> None:
    """Keep a clear ``comparison`` under ``key``; any other verdict forgets what was kept there.

    Written whole into a temporary file and renamed, so that concurrent processes never read
    half a file; an unwritable cache only costs a measurement next time.
    """
    path = _decisions_file()
    stored = _stored()
    if comparison.verdict == "clear":
        stored[key] = asdict(comparison)
    elif stored.pop(key, None) is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".measured-", suffix=".json")
    except OSError:
        return
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(stored, file, indent=1)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)

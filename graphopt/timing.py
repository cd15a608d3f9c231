"""Latency measurement: interleaved rounds, medians, ratios.

Variants run in rounds (A B C A B C ...) after a warm-up, so slow drift and other load
on the machine affect all of them alike; each variant's latency is the median of its
rounds. Only ratios between variants measured together mean anything.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

LONG_CALL_S = 0.5  # compare_latency: calls this long count their warm-up round


def wall_clock_seconds(run: Callable[[], Any]) -> float:
    """Seconds one call of ``run`` takes on the host's monotonic clock."""
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def interleaved_samples(
    variants: Mapping[str, Callable[[], Any]],
    rounds: int = 20,
    warmup: int = 3,
    measure: Callable[[Callable[[], Any]], float] = wall_clock_seconds,
) -> dict[str, list[float]]:
    """Seconds of each call, per variant, one call per variant per round (A B C A B C ...).

    ``measure`` times one call (the CUDA benchmark passes one that uses CUDA events).
    """
    for run in variants.values():
        for _ in range(warmup):
            run()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            samples[name].append(measure(run))
    return samples


def median_latencies(
    variants: Mapping[str, Callable[[], Any]],
    rounds: int = 20,
    warmup: int = 3,
) -> dict[str, float]:
    """Median seconds per call of each zero-argument callable, measured interleaved."""
    samples = interleaved_samples(variants, rounds, warmup)
    return {name: statistics.median(times) for name, times in samples.items()}


def compare_latency(
    baseline: Callable[[], Any],
    candidate: Callable[[], Any],
    budget_s: float = 2.0,
    max_rounds: int = 15,
) -> tuple[float, float]:
    """Median seconds of ``baseline`` and ``candidate``, interleaved, within about ``budget_s``.

    One warm-up call each sizes the number of rounds (at least 3) to the budget. When both
    calls take `LONG_CALL_S` or more (a large model), what a first call costs extra is small
    against them, and the warm-up round counts as the first round: three rounds cost three
    calls each instead of four.
    """
    first = {"baseline": wall_clock_seconds(baseline), "candidate": wall_clock_seconds(candidate)}
    rounds = max(3, min(max_rounds, int(budget_s / max(sum(first.values()), 1e-6))))
    counted = min(first.values()) >= LONG_CALL_S
    samples = interleaved_samples({"baseline": baseline, "candidate": candidate}, rounds=rounds - counted, warmup=0)
    if counted:
        for name, seconds in first.items():
            samples[name].insert(0, seconds)
    return statistics.median(samples["baseline"]), statistics.median(samples["candidate"])

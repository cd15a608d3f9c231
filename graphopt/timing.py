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

    One warm-up call each sizes the number of rounds (at least 3) to the budget.
    """
    started = time.perf_counter()
    baseline()
    candidate()
    per_round = max(time.perf_counter() - started, 1e-6)
    rounds = max(3, min(max_rounds, int(budget_s / per_round)))
    latencies = median_latencies({"baseline": baseline, "candidate": candidate}, rounds=rounds, warmup=0)
    return latencies["baseline"], latencies["candidate"]

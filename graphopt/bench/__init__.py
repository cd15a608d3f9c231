"""Benchmark harness: latency measured the same way for every variant, as ratios."""

from graphopt.bench.timing import median_latencies

__all__ = ["median_latencies"]

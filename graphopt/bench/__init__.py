"""Benchmark harness: latency measured the same way for every variant, as ratios."""

from graphopt.timing import median_latencies

__all__ = ["median_latencies"]

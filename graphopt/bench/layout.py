"""Eager NCHW vs channels_last vs graphopt, for the reference models: ``python -m graphopt.bench.layout``.

Every variant of one model is timed in the same process, interleaved (A B C A B C ...),
after a warm-up; the table gives median latencies as ratios to eager NCHW. Run it on a
quiet machine: another CPU job running at the same time distorts every figure.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

import graphopt
from graphopt.models import REFERENCE_MODELS
from graphopt.timing import median_latencies


def _eager(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad():
            return model(*inputs)

    return run


def layout_variants(name: str, batch: int) -> tuple[dict[str, Callable[[], Any]], str]:
    """The variants of one reference model, and graphopt's auto decision as reported."""
    reference = REFERENCE_MODELS[name]
    model = reference.build().eval()
    inputs = reference.example_inputs(batch_size=batch)
    channels_last_model = reference.build().eval().to(memory_format=torch.channels_last)
    channels_last_inputs = tuple(t.contiguous(memory_format=torch.channels_last) for t in inputs)
    preserved = graphopt.optimize(model, inputs, memory_format="preserve")
    converted = graphopt.optimize(model, inputs, memory_format="channels_last")
    auto = graphopt.optimize(model, inputs)
    decision = auto.graphopt_report["to_channels_last"].notes[-1]
    variants = {
        "eager NCHW": _eager(model, inputs),
        "eager channels_last": _eager(channels_last_model, channels_last_inputs),
        "graphopt preserve": lambda: preserved(*inputs),
        "graphopt channels_last": lambda: converted(*inputs),
        "graphopt auto": lambda: auto(*inputs),
    }
    return variants, decision


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=sorted(REFERENCE_MODELS), choices=sorted(REFERENCE_MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    print(f"batch {args.batch}, {torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds; ratio = eager NCHW / variant")
    header = None
    for name in args.models:
        variants, decision = layout_variants(name, args.batch)
        latencies = median_latencies(variants, rounds=args.rounds, warmup=3)
        if header is None:
            header = "| model | " + " | ".join(latencies) + " |"
            print(header + "\n|" + "---|" * (len(latencies) + 1))
        base = latencies["eager NCHW"]
        print(f"| {name} | " + " | ".join(f"{base / seconds:.2f}x" for seconds in latencies.values()) + " |")
        print(f"|   auto: {decision} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

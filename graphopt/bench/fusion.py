"""Fusion on the reference models: ops executed, compile seconds and speed: ``python -m graphopt.bench.fusion``.

For each model it optimizes with the same passes (channels_last fixed, so that the
layout's own measured decision does not differ between variants) and each ``fuse`` setting (None, the
pointwise regions by Inductor and by TorchScript, the whole graph by torch.compile),
counts the kernels one forward runs with torch.profiler (top-level ATen/oneDNN ops plus
Inductor's generated kernels), and times the variants interleaved in this process
(median of rounds; ratio = unfused / variant). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import graphopt
from graphopt.models import REFERENCE_MODELS
from graphopt.timing import median_latencies

FUSE_SETTINGS = {"unfused": None, "regions (inductor)": "inductor", "regions (torchscript)": "torchscript", "whole graph (torch.compile)": "graph"}


def _is_kernel(event: Any) -> bool:
    return event.name.startswith(("aten::", "mkldnn::")) or "cpp_fused" in event.name


def count_kernels(run: Callable[[], Any]) -> collections.Counter[str]:
    """The kernels one call of ``run`` executes: top-level ATen/oneDNN ops and Inductor kernels, by name."""
    import torch._inductor.config as inductor_config

    run()
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch({"cpp.enable_kernel_profile": True}))
        prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU]))
        run()
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not _is_kernel(parent):
            parent = parent.cpu_parent
        if _is_kernel(event) and parent is None:
            counts[event.name] += 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="*", default=sorted(REFERENCE_MODELS), choices=sorted(REFERENCE_MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", FutureWarning)
    print(f"batch {args.batch}, {args.precision}, {torch.get_num_threads()} threads; ratio = unfused / variant, median of {args.rounds} interleaved rounds")
    print("| model | variant | regions | kernels per forward | compile s | ratio |\n|---|---|---|---|---|---|")
    for name in args.models:
        reference = REFERENCE_MODELS[name]
        model, inputs = reference.build().eval(), reference.example_inputs(batch_size=args.batch)
        modules = {label: graphopt.optimize(model, inputs, fuse=fuse, precision=args.precision, memory_format="channels_last") for label, fuse in FUSE_SETTINGS.items()}
        runs = {label: (lambda module=module: module(*inputs)) for label, module in modules.items()}
        kernels = {label: sum(count_kernels(run).values()) for label, run in runs.items()}
        latencies = median_latencies(runs, rounds=args.rounds, warmup=3)
        for label, module in modules.items():
            fusion = module.graphopt_report.fusion
            regions = "-" if fusion is None else str(sum(r.status != "eager" for r in fusion.regions))
            seconds = "-" if fusion is None else f"{fusion.compile_seconds:.1f}"
            print(f"| {name} | {label} | {regions} | {kernels[label]} | {seconds} | {latencies['unfused'] / latencies[label]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

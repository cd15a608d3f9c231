"""Deployment benchmark: an optimized module saved and loaded, and compiled into an AOTInductor package, against
the Python module it came from, eager PyTorch and torch.compile (Inductor, with freezing: its strongest CPU setting).

Run ``make bench-deploy`` (or ``python -m graphopt.bench.deploy``) on a quiet machine: every variant is timed
interleaved in one process, and the table gives speedups over eager (median of the rounds), each variant's
largest error relative to eager's output scale and what building it cost, with the CPU model and thread count.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphopt
from graphopt.bench.scripts import chosen_variants, print_table_head, print_table_row, script_options
from graphopt.errors import error_summary
from graphopt.models import ANCHOR_MODELS, REFERENCE_MODELS
from graphopt.timing import interleaved_samples

MODELS = ("resnet50", "vit_b_16")


def _compiled_frozen(model: nn.Module) -> Callable[..., Any]:
    """torch.compile with Inductor's freezing (weights folded in as constants), one variant only: compiled
    variants of one model would share Dynamo's cache whatever their Inductor settings."""
    compiled = torch.compile(model)

    def frozen(*args: Any) -> Any:
        with torch._inductor.config.patch(freezing=True):  # read when the first call compiles
            return compiled(*args)

    return frozen


def variants(model: nn.Module, x: torch.Tensor, workdir: Path, only: set[str] | None) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    """Each variant as a zero-argument call, and the seconds building it took (first call included)."""
    built: dict[str, Callable[[], Any]] = {"eager": lambda: model(x)}
    seconds: dict[str, float] = {}
    fast = None

    def optimized() -> Callable[..., Any]:
        nonlocal fast
        fast = fast or graphopt.optimize(model, (x,), progress=False)
        return fast

    makers: dict[str, Callable[[], Callable[..., Any]]] = {
        "graphopt module": optimized,
        "graphopt.load(saved file)": lambda: graphopt.load(graphopt.save(optimized(), workdir / "model.pt2", overwrite=True)),
        "graphopt.package (AOTInductor)": lambda: torch._inductor.aoti_load_package(str(graphopt.package(optimized(), workdir / "aoti.pt2", overwrite=True))),
        "torch.compile (freezing)": lambda: _compiled_frozen(model),
    }
    for name, make in makers.items():
        if only and name not in only:
            continue
        started = time.perf_counter()
        try:
            run = make()
            with torch.inference_mode():
                run(x)  # compiles where the variant compiles
        except Exception as error:  # noqa: BLE001 - a failing variant is reported, not fatal
            print(f"  {name}: failed ({error_summary(error)[:200]})")
            continue
        seconds[name] = time.perf_counter() - started
        built[name] = (lambda run: lambda: run(x))(run)
    return built, seconds


def measure(name: str, batch: int, rounds: int, only: set[str] | None) -> list[tuple[str, float, float, float | None]]:
    """(variant, speedup over eager, max error relative to eager's scale, build seconds) for one model."""
    reference = {**REFERENCE_MODELS, **ANCHOR_MODELS}[name]
    model, (x,) = reference.build().eval(), reference.example_inputs(batch_size=batch)
    with tempfile.TemporaryDirectory() as workdir:
        runs, seconds = variants(model, x, Path(workdir), only)
        with torch.inference_mode():
            expected = runs["eager"]()
            errors = {key: float((run() - expected).abs().max() / expected.abs().max()) for key, run in runs.items()}
            samples = interleaved_samples(runs, rounds=rounds, warmup=2)
    eager = statistics.median(samples["eager"])
    return [(key, eager / statistics.median(times), errors[key], seconds.get(key)) for key, times in samples.items()]


def main(argv: list[str] | None = None) -> int:
    parser = script_options(__doc__.splitlines()[0], MODELS, rounds=10, models_help=f"anchor or reference model names (default {','.join(MODELS)})")
    args = parser.parse_args(argv)
    only = chosen_variants(args.variants)
    heading = f"batch {args.batch}; speedup = eager / variant, median of {args.rounds} interleaved rounds; build: seconds to a first result"
    print_table_head(heading, ["model", "variant", "speedup vs eager", "max error", "build"])
    for name in args.models.split(","):
        for key, speedup, error, seconds in measure(name, args.batch, args.rounds, only):
            build = "" if seconds is None else f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
            print_table_row([name, key, f"{speedup:.2f}x", f"{error:.1e}", build])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

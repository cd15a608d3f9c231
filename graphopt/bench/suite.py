"""``graphopt bench`` end to end: settings, the run, and the files it writes.

The results go to ``OUTPUT_DIR/bench.json``, ``bench.md`` and ``bench.png``; the JSON
and markdown are rewritten after each model, so an interrupted run keeps what it
measured. ``--quick`` is a smoke run for CI (well under a minute on 2 cores): batch 2, two
rounds after one warm-up call, the smallest reference model unless models are given, and
`QUICK_VARIANTS` unless variants are given; its figures mean nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from graphopt.bench.harness import BenchModel, Harness, Measure
from graphopt.bench.results import BenchResult, to_markdown, write_json, write_plot
from graphopt.bench.variants import LOW_PRECISIONS, select, variants
from graphopt.errors import InvalidOptionError

QUICK_MODELS = "transformer"  # the smallest reference model: 3x32x32 inputs
# A few fast variants that still cover each role (baseline, peer, graphopt) and the exact and low precision classes;
# compilers (torch.compile, OpenVINO, onnxruntime) and int8 calibration are left out: they take most of a full run.
QUICK_VARIANTS = ("eager", "eager-cl", "eager-amp", "graphopt-default", "graphopt-low")


@dataclass
class Settings:
    """How to run: device, low precision, rounds, which variants, where to write."""

    device: str = "auto"
    batch: int = 8
    rounds: int = 20
    warmup: int = 3
    low_precision: str | None = None  # None: bf16 where the device runs it, else fp16
    variants: list[str] | None = None  # shell-style patterns over variant keys; None: all
    exclude: tuple[str, ...] = ()
    time_budget_s: float | None = None
    output_dir: Path = Path("bench-results")
    matmul_size: int = 2048  # the square matrix product that measures the machine's rate (roofline)

    @classmethod
    def quick(cls) -> Settings:
        """The --quick smoke run's settings: checks the harness works, measures nothing worth reading."""
        return cls(batch=2, rounds=2, warmup=1, matmul_size=256, variants=list(QUICK_VARIANTS))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.partition(":")[0] not in ("cpu", "cuda"):
        raise InvalidOptionError(f"--device {name}: the benchmark runs on auto, cpu, cuda or cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidOptionError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return torch.device(name)


def default_low_precision(device: torch.device) -> str:
    """bf16 where the device has bf16 kernels (CUDA Ampere+, CPUs with AVX-512/AMX or emulation), else fp16."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    try:
        torch.nn.functional.conv2d(torch.ones(1, 2, 4, 4, dtype=torch.bfloat16), torch.ones(2, 2, 1, 1, dtype=torch.bfloat16))
    except RuntimeError:
        return "fp16"
    return "bf16"


def write_outputs(result: BenchResult, output_dir: Path, plot: bool = True) -> list[str]:
    """Write bench.json, bench.md and (with ``plot``) bench.png; returns what was written or why not."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json(result, output_dir / "bench.json")
    (output_dir / "bench.md").write_text(to_markdown(result))
    messages = [f"written: {output_dir / 'bench.json'}, {output_dir / 'bench.md'}"]
    if plot:
        problem = write_plot(result, output_dir / "bench.png")
        messages.append(problem or f"written: {output_dir / 'bench.png'}")
    return messages


def run_suite(
    models: list[BenchModel],
    settings: Settings,
    command: str,
    *,
    measure: Measure | None = None,
    log: Callable[[str], None] = print,
) -> BenchResult:
    """Measure ``models`` with ``settings``, writing the files after each model; returns the result."""
    device = resolve_device(settings.device)
    low_precision = settings.low_precision or default_low_precision(device)
    if low_precision not in LOW_PRECISIONS:
        raise InvalidOptionError(f"low precision {low_precision!r}: use one of {', '.join(LOW_PRECISIONS)}")
    try:
        chosen = select(variants(low_precision), settings.variants, settings.exclude)
    except ValueError as error:
        raise InvalidOptionError(str(error)) from error
    harness = Harness(
        chosen,
        device=device,
        rounds=settings.rounds,
        warmup=settings.warmup,
        low_precision=low_precision,
        time_budget_s=settings.time_budget_s,
        measure=measure,
        matmul_size=settings.matmul_size,
        log=log,
    )
    log(f"graphopt bench: {len(models)} model(s) x {len(chosen)} variant(s) on {device}, {settings.rounds} interleaved rounds")
    result = harness.run(models, command, on_model=lambda partial: write_outputs(partial, settings.output_dir, plot=False))
    for message in write_outputs(result, settings.output_dir):
        log(message)
    return result

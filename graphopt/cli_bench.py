"""The commands that time graphopt against eager PyTorch: ``graphopt demo`` (a built-in model, one ratio) and
``graphopt bench`` (graphopt.bench's suite: the models, variants and settings the options select, and the command that repeats a run).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from graphopt.api import optimize
from graphopt.bench.harness import BenchModel
from graphopt.bench.models import select_models
from graphopt.bench.results import to_markdown
from graphopt.bench.suite import QUICK_MODELS, Settings, run_suite
from graphopt.bench.variants import variants as bench_variants
from graphopt.cli_arguments import load_factory, parse_input_spec, split_names
from graphopt.errors import InvalidOptionError
from graphopt.models import get_reference_model
from graphopt.runtime import OptimizedModule
from graphopt.timing import median_latencies


def _time_ratio(model: nn.Module, optimized: OptimizedModule, inputs: tuple[Any, ...]) -> dict[str, float]:
    def eager() -> Any:
        with torch.no_grad():
            return model(*inputs)

    return median_latencies({"eager (no_grad)": eager, "graphopt": lambda: optimized(*inputs)})


def demo_command(args: argparse.Namespace) -> int:
    reference = get_reference_model(args.model)
    model = reference.build().eval()
    inputs = reference.example_inputs(batch_size=args.batch)
    print(f"graphopt demo: {reference.name} ({reference.description}), input {list(inputs[0].shape)}")
    optimized = optimize(model, inputs)
    print(optimized.graphopt_report)
    latencies = _time_ratio(model, optimized, inputs)
    eager = latencies["eager (no_grad)"]
    print(f"\nlatency, median of interleaved rounds on {torch.get_num_threads()} threads:")
    for name, seconds in latencies.items():
        print(f"  {name:<16} {seconds * 1e3:8.2f} ms   {eager / seconds:5.2f}x vs eager")
    print("(a ratio, not a benchmark: run on a quiet machine; `graphopt bench` compares graphopt with eager, torch.compile and onnxruntime)")
    return 0


def _bench_factory_model(args: argparse.Namespace, batch: int) -> Callable[[str], BenchModel]:
    """Builds the `BenchModel` of a ``MODULE:FACTORY`` entry of --models, with the --input shapes."""

    def from_factory(reference: str) -> BenchModel:
        load_factory(reference)  # fail now, with a clear message, rather than in the middle of the run
        specs = args.input or [f"{batch}x3x224x224"]

        def inputs() -> tuple[torch.Tensor, ...]:
            generator = torch.Generator().manual_seed(0)
            return tuple(parse_input_spec(spec, generator) for spec in specs)

        inputs()  # checks the --input specs
        return BenchModel(reference, lambda: load_factory(reference), inputs)

    return from_factory


def _bench_command_line(args: argparse.Namespace, settings: Settings, selection: str) -> str:
    """The command that repeats this run, with the defaults it used spelled out."""
    words = ["graphopt", "bench", "--models", selection, "--batch", str(settings.batch), "--device", settings.device]
    words += ["--rounds", str(settings.rounds), "--warmup", str(settings.warmup)]
    if settings.variants is not None:  # --quick's own list too: the command repeats the same run
        words += ["--variants", ",".join(settings.variants)]
    for option in ("low_precision", "exclude", "time_budget"):
        if getattr(args, option) is not None:
            words += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    for spec in args.input or ():
        words += ["--input", spec]
    return shlex.join(words)


def _generate_bench(args: argparse.Namespace) -> int:
    """``graphopt bench --generate``: `graphopt.bench.generate` with the options it reads; the others are refused."""
    from graphopt.bench import generate

    if args.list_variants:
        for variant in generate.variants():
            print(f"{variant.key:<22} {variant.role:<9} {variant.label}")
        return 0
    refused = [f"--{option.replace('_', '-')}" for option in ("input", "batch", "device", "warmup", "low_precision", "time_budget") if getattr(args, option) is not None]
    if refused:
        raise InvalidOptionError(f"{', '.join(refused)}: not options of --generate, which runs batch 1 on the CPU (see graphopt bench --help)")
    models, rounds = split_names(args.models) or list(generate.MODELS), args.rounds or (1 if args.quick else 5)
    new_tokens = generate.QUICK_NEW_TOKENS if args.quick else generate.NEW_TOKENS
    output_dir = Path(args.output_dir or "bench-results/generate")
    words = ["graphopt", "bench", "--generate", "--models", ",".join(models), "--rounds", str(rounds), "--output-dir", str(output_dir)]
    for option in ("variants", "exclude"):
        if getattr(args, option) is not None:
            words += [f"--{option}", getattr(args, option)]
    try:
        result = generate.run(
            models, rounds=rounds, new_tokens=new_tokens, patterns=split_names(args.variants), exclude=split_names(args.exclude) or (),
            tiny=args.quick, output_dir=output_dir, command=shlex.join(words + (["--quick"] if args.quick else [])),
        )  # fmt: skip
    except ValueError as error:  # an unknown model or a pattern matching no variant
        raise InvalidOptionError(str(error)) from error
    print()
    print(result.to_markdown())
    return 0 if any(model.error is None for model in result.models) else 1


def bench_command(args: argparse.Namespace) -> int:
    if args.generate:
        return _generate_bench(args)
    if args.list_variants:
        for variant in bench_variants(args.low_precision or "bf16"):
            print(f"{variant.key:<22} {variant.role:<9} {variant.label}")
        return 0
    given = {name: getattr(args, name) for name in ("device", "batch", "rounds", "warmup", "low_precision") if getattr(args, name) is not None}
    defaults = Settings.quick() if args.quick else Settings()
    settings = dataclasses.replace(
        defaults,
        **given,
        variants=split_names(args.variants) or defaults.variants,
        exclude=tuple(split_names(args.exclude) or ()),
        time_budget_s=None if args.time_budget is None else args.time_budget * 60,
        output_dir=Path(args.output_dir or "bench-results"),
    )
    selection = args.models or (QUICK_MODELS if args.quick else "reference")
    models = select_models(selection, settings.batch, _bench_factory_model(args, settings.batch))
    result = run_suite(models, settings, _bench_command_line(args, settings, selection))
    print()
    print(to_markdown(result))
    return 0 if any(model.error is None for model in result.models) else 1

"""What the benchmark scripts share (`graphopt.bench.transformers`, `graphopt.bench.train`, `graphopt.bench.deploy`):
their options and their Markdown table, headed by the machine's line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

import graphopt
from graphopt.bench.harness import cpu_name


def machine() -> str:
    """The first line of a benchmark table: CPU model, threads, torch and graphopt versions."""
    return f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, graphopt {graphopt.__version__}"


def script_options(description: str, models: Sequence[str], rounds: int, baseline: str = "eager", models_help: str | None = None) -> argparse.ArgumentParser:
    """The options every benchmark script takes: ``--models``, ``--batch`` (8), ``--rounds``, ``--variants`` (the
    ``baseline`` always runs)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default=",".join(models), help=models_help)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--variants", default="", help=f"comma-separated variant names ({baseline} always runs)")
    return parser


def chosen_variants(variants: str) -> set[str] | None:
    """The variant names ``--variants`` gives (None: all)."""
    return {name.strip() for name in variants.split(",") if name.strip()} or None


def print_table_head(heading: str, columns: Sequence[str]) -> None:
    """The machine's line, ``heading`` and the header of a Markdown table with ``columns``."""
    print(machine())
    print(f"{heading}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def print_table_row(cells: Sequence[str]) -> None:
    """One row of the table, printed at once (a long run shows each result as it comes)."""
    print("| " + " | ".join(cells) + " |", flush=True)

"""The registry listings: ``graphopt passes`` (each pass's modes, and where it runs by default or the option that asks
for it) and ``graphopt engines`` (each engine's precisions and whether it is installed).
"""

from __future__ import annotations

import argparse

from graphopt.backends import ENGINES
from graphopt.passes import PassInfo
from graphopt.pipeline import list_passes


def _when_it_runs(info: PassInfo) -> str:
    """Where a pass runs by default, or the option that asks for it."""
    if info.presets:
        return f"default: {', '.join(info.presets)}"
    if info.lowers_precision:
        return "opt-in: --precision"
    if info.quantizes:
        return "opt-in: --precision int8"
    if info.fuse == "regions":
        return "opt-in: --fuse"
    return "opt-in: --passes"


def passes_command(args: argparse.Namespace) -> int:
    infos = list_passes()
    rows = [(info.name, f"[{', '.join(info.modes)}]", _when_it_runs(info), info.description) for info in infos]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for *cells, description in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + "  " + description)
    return 0


def engines_command(args: argparse.Namespace) -> int:
    rows = [
        (info.name, ", ".join(info.precisions), info.missing() or "installed", f"{info.description}. Costs: {info.costs}")
        for info in ENGINES.values()
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    for name, precisions, installed, description in rows:
        print(f"{name.ljust(widths[0])}  {precisions.ljust(widths[1])}  {installed}\n    {description}")
    return 0

"""What users see on stderr: graphopt's own warnings and errors, never torch's notices about its own internals.

The commands run in a subprocess, as a user runs them, with Python's default warning filters (pytest's
``filterwarnings`` would hide what users see). torch.export captures and saves deep-copy pytree specs
(torch's deprecated ``LeafSpec``: a ``FutureWarning``), and every ONNX export logs "torchvision is not
installed" lines; `graphopt.quiet` drops these inside graphopt's calls, and only there.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import graphopt
from graphopt.models import resnet_small
from graphopt.quiet import FOREIGN_LOG_MESSAGES

REPO_ROOT = Path(__file__).resolve().parents[1]
RESNET = "graphopt.models:resnet_small"
SMALL_INPUT = "1x3x32x32"  # a batch of 1: torch.export logs that it specialised it, graphopt says so itself

# graphopt's own lines: "graphopt: ..." (errors, notes) and its warnings, whose messages start with "graphopt: "
OWN_LINE = re.compile(r"^graphopt[: ]|^\S.*:\d+: \w*Warning: graphopt: ")


def foreign_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` graphopt did not write (the indented source line Python prints under one of
    graphopt's warnings counts as graphopt's)."""
    foreign, after_own = [], False
    for line in stderr.splitlines():
        own = bool(OWN_LINE.match(line)) or (after_own and line.startswith(" "))
        if not own and line.strip():
            foreign.append(line)
        after_own = own
    return foreign


def fresh_python(*arguments: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """``python ARGUMENTS`` in a fresh process importing this checkout's graphopt, with Python's default warning filters."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def test_foreign_lines_tells_graphopts_own_lines_from_others() -> None:
    stderr = (
        "/x/api.py:12: UserWarning: graphopt: no layer stays in int8\n  warnings.warn(\n"
        "graphopt: error: --input 'x' is not a shape\n"
        "/usr/lib/copyreg.py:105: FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated\n  return cls.__new__(cls)\n"
        "W1203 08:01:51.444000 3627 torch/onnx/_internal/exporter/_registration.py:107] torchvision is not installed.\n"
    )
    assert foreign_lines(stderr) == [
        "/usr/lib/copyreg.py:105: FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated",
        "  return cls.__new__(cls)",
        "W1203 08:01:51.444000 3627 torch/onnx/_internal/exporter/_registration.py:107] torchvision is not installed.",
    ]


def test_optimize_with_torch_export_save_and_onnx_prints_only_graphopts_own_lines(tmp_path: Path) -> None:
    """Capture with torch.export, save (a torch.export archive) and ONNX export, in one command."""
    result = fresh_python(
        "-m", "graphopt.cli", "optimize", RESNET, "--input", SMALL_INPUT, "--frontend", "export", "--no-progress",
        "--save", "model.pt2", "--onnx", "model.onnx", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "frontend: export" in result.stdout and (tmp_path / "model.pt2").is_file() and (tmp_path / "model.onnx").is_file()
    assert "a batch of 1 always is: give example inputs with a batch of 2 or more" in result.stdout  # graphopt's own word on it
    assert foreign_lines(result.stderr) == []


def test_the_notices_are_dropped_inside_graphopts_calls_only() -> None:
    """Nothing is filtered process-wide: the same warning from the user's own code, after optimize, still shows."""
    example = (torch.randn(2, 3, 32, 32),)
    filters_before = {name: list(logging.getLogger(name).filters) for name in FOREIGN_LOG_MESSAGES}  # the root logger's may be others'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphopt.optimize(resnet_small().eval(), example, frontend="export", progress=False)
        inside = [str(warning.message) for warning in caught if "LeafSpec" in str(warning.message)]
        caught.clear()
        copy.deepcopy(torch.export.export(resnet_small().eval(), example).module())  # the user's own torch.export
        outside = [str(warning.message) for warning in caught if "LeafSpec" in str(warning.message)]
    assert inside == []
    assert outside, (
        "the user's own LeafSpec warning was dropped outside graphopt's calls (or torch "
        f"{torch.__version__} no longer raises it: then drop it from graphopt.quiet.FOREIGN_WARNINGS)"
    )
    assert {name: list(logging.getLogger(name).filters) for name in FOREIGN_LOG_MESSAGES} == filters_before


def test_importing_graphopt_installs_no_warning_filter() -> None:
    """In a fresh process: pytest discards the filters a module installs while it is collected."""
    code = "import warnings, graphopt.cli; print([entry[1].pattern for entry in warnings.filters if entry[1] is not None])"
    result = fresh_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert "LeafSpec" not in result.stdout

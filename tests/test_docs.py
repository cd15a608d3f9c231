"""docs/writing-a-pass.md stays true: its example pass, registry entry and tests run as written."""

from __future__ import annotations

import inspect
import itertools
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt.passes import MODES, REGISTRY, PassInfo
from tests.conftest import captured

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "writing-a-pass.md"
NAME = "remove_inverse_permutes"


def code_blocks() -> dict[str, str]:
    """The guide's Python blocks, by the path in their first-line comment."""
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", GUIDE.read_text(), re.S)
    return dict(blocks)


def load_example_pass(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The guide's pass module, importable under its name, and its `PassInfo` in the registry."""
    blocks = code_blocks()
    module = types.ModuleType(f"graphopt.passes.{NAME}")
    exec(compile(blocks[f"graphopt/passes/{NAME}.py"], f"<{NAME}.py>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    entry = blocks["graphopt/passes/__init__.py"].strip().rstrip(",")
    info = eval(entry, {"PassInfo": PassInfo, "MODES": MODES, NAME: getattr(module, NAME)})
    monkeypatch.setitem(REGISTRY, NAME, info)
    return module


def expand(function: types.FunctionType) -> list[dict[str, object]]:
    """The keyword arguments of each case of a test function's ``pytest.mark.parametrize`` marks."""
    marks = [mark for mark in getattr(function, "pytestmark", []) if mark.name == "parametrize"]
    axes = [[{mark.args[0]: value} for value in mark.args[1]] for mark in marks]
    return [{k: v for case in combination for k, v in case.items()} for combination in itertools.product(*axes)]


def test_the_guide_has_the_three_files() -> None:
    assert set(code_blocks()) == {f"graphopt/passes/{NAME}.py", "graphopt/passes/__init__.py", f"tests/passes/test_{NAME}.py"}


def test_the_example_pass_and_its_tests_run_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    load_example_pass(monkeypatch)
    tests = types.ModuleType(f"tests.passes.test_{NAME}")
    exec(compile(code_blocks()[f"tests/passes/test_{NAME}.py"], f"<test_{NAME}.py>", "exec"), tests.__dict__)
    functions = [value for name, value in vars(tests).items() if name.startswith("test_") and inspect.isfunction(value)]
    ran = 0
    for function in functions:
        for kwargs in expand(function):
            function(**kwargs)
            ran += 1
    assert ran == 5


def test_the_registered_example_runs_in_the_preset_and_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_example_pass(monkeypatch)

    class RoundTrip(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.permute(0, 2, 1).permute(0, 2, 1) * 2

    model, inputs = RoundTrip().eval(), (torch.randn(2, 3, 4),)
    optimized = graphopt.optimize(model, inputs, memory_format="preserve")
    assert len(optimized.graphopt_report[NAME].rewrites) == 1
    torch.testing.assert_close(optimized(torch.ones(5, 3, 4)), torch.full((5, 3, 4), 2.0))
    disabled = graphopt.optimize(model, inputs, memory_format="preserve", disable=[NAME])
    assert NAME not in [entry.name for entry in disabled.graphopt_report.passes]
    assert getattr(module, NAME)(captured(model, inputs, "export"), graphopt.passes.PassContext()).modified

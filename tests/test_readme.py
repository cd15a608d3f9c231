"""README.md stays true: its Python snippets run, in order, in one session, as a new user pastes them.

Every ```python block of the README is executed in the order it appears, in one shared
namespace (one interpreter: a block may use what an earlier one defined), with a temporary
folder as the working directory (files the snippets write, ``model.onnx``, ``diff.html``,
land there), ``HF_HUB_OFFLINE=1`` (the keyword-inputs example builds a small BERT from a
config: nothing may be downloaded) and a private tuning cache (``tune=True`` measures as on
a first run, and writes nothing to ``~/.cache``). Shell blocks (```sh) and output blocks
(plain ```) are not run. A failure names the block, its README line and its first line; the
traceback points at README lines.

Every block runs, on a CPU-only machine too: an example for a GPU picks its device with
``torch.cuda.is_available()``.

The Options section lists every parameter of `graphopt.optimize` (signature and table), and
every ``graphopt optimize`` command of the README parses.

Slow: the snippets train in fp16, tune (with a 20 s budget), compile with
Inductor, optimize a full-size ResNet-50 and export to ONNX: 2-4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re
import shlex
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

import graphopt
from graphopt import tuning

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\S*)\s*$")
RUNNABLE, NOT_RUN = {"python"}, {"sh", ""}  # fence languages: run / shell commands and program output
MIN_BLOCKS = 13  # the README's examples when this test was written; more may come

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Block:
    """One fenced Python block: its position among them, the README line of its first code line, its code."""

    index: int
    line: int
    code: str

    @property
    def where(self) -> str:
        first = next((line for line in self.code.splitlines() if line.strip()), "")
        first = first.strip() if len(first.strip()) <= 72 else first.strip()[:69] + "..."
        return f"README block {self.index} (line {self.line}: {first!r})"


def fences(lines: list[str]) -> list[tuple[int, int, str]]:
    """(opening line index, closing line index, language) of every fenced block."""
    found: list[tuple[int, int, str]] = []
    opening: tuple[int, str] | None = None
    for number, line in enumerate(lines):
        match = FENCE.match(line)
        if match is None:
            continue
        if opening is None:
            opening = (number, match.group(1))
        else:
            found.append((opening[0], number, opening[1]))
            opening = None
    if opening is not None:
        raise AssertionError(f"README line {opening[0] + 1}: a code fence is never closed")
    return found


def python_blocks(text: str) -> list[Block]:
    """The README's ```python blocks, in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    for start, end, language in fences(lines):
        if language in RUNNABLE:
            blocks.append(Block(len(blocks), start + 2, "\n".join(lines[start + 1 : end]) + "\n"))
    return blocks


def run(block: Block, namespace: dict[str, object]) -> str:
    """Execute ``block`` in ``namespace``, returning what it printed; compiled as README.md with its own line
    numbers, so tracebacks show README lines."""
    source = "\n" * (block.line - 1) + block.code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, str(README), "exec"), namespace)
    return printed.getvalue()


def sample_report() -> list[str]:
    """The output block that follows the README's first Python block: the sample report."""
    lines = README.read_text().splitlines()
    end = next(end for _, end, language in fences(lines) if language in RUNNABLE)
    following = next(fence for fence in fences(lines) if fence[0] > end)
    assert following[2] == "", "the first example must be followed by its output"
    return lines[following[0] + 1 : following[1]]


def skeleton(report: list[str]) -> list[str]:
    """What a report shows whatever the machine: the header lines' labels and the passes in order (figures vary)."""
    header = [line.split(":")[0] for line in report[: report.index(next(line for line in report if line.startswith("pass ")))]]
    passes = [line.split()[0] for line in report if re.match(r"^[a-z_]+ +\d+ +\d+ ", line)]
    return header + passes


def test_every_code_block_is_python_shell_or_output() -> None:
    """No example escapes the test under another label (```py, ```Python, ```bash ...)."""
    languages = {language for _, _, language in fences(README.read_text().splitlines())}
    assert languages <= RUNNABLE | NOT_RUN, f"unknown code fence languages {sorted(languages - RUNNABLE - NOT_RUN)}: use ```python or ```sh"
    count = len(python_blocks(README.read_text()))
    assert count >= MIN_BLOCKS, f"{count} ```python blocks, {MIN_BLOCKS} expected at least: were examples removed, or their fences changed?"


def test_the_python_snippets_run_in_order_in_one_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_memory_cache", {})
    namespace: dict[str, object] = {"__name__": "__main__"}
    ran = 0
    printed = []
    for block in python_blocks(README.read_text()):
        try:
            printed.append(run(block, namespace))
        except Exception:
            pytest.fail(f"{block.where} failed, after {ran} block(s) ran:\n{traceback.format_exc()}", pytrace=False)
        ran += 1
    assert ran >= MIN_BLOCKS
    # the sample report is the current one: the same header lines and passes, in order
    assert skeleton(printed[0].splitlines()) == skeleton(sample_report()), printed[0]


def options_section() -> list[str]:
    """The lines of the README's "### Options" section."""
    lines = README.read_text().splitlines()
    start = lines.index("### Options")
    end = next(number for number in range(start + 1, len(lines)) if lines[number].startswith("#"))
    return lines[start + 1 : end]


def test_the_options_section_lists_every_parameter_of_optimize() -> None:
    """The signature line spells graphopt.optimize's parameters, kinds and defaults; the table has a row for each."""
    parameters = inspect.signature(graphopt.optimize).parameters
    line = next(line for line in options_section() if line.startswith("`graphopt.optimize("))
    spelled = ast.parse("def " + line.strip("`").removeprefix("graphopt.") + ": pass").body[0].args  # type: ignore[attr-defined]
    positional = [argument.arg for argument in spelled.args]
    keyword_only = [argument.arg for argument in spelled.kwonlyargs]
    expected_positional = [name for name, parameter in parameters.items() if parameter.kind != inspect.Parameter.KEYWORD_ONLY]
    assert positional == expected_positional and keyword_only == [name for name in parameters if name not in expected_positional], line
    defaults = dict(zip(positional[len(positional) - len(spelled.defaults) :], spelled.defaults, strict=True))
    defaults |= {argument.arg: default for argument, default in zip(spelled.kwonlyargs, spelled.kw_defaults, strict=True) if default is not None}
    assert {name: ast.literal_eval(default) for name, default in defaults.items()} == {
        name: parameter.default for name, parameter in parameters.items() if parameter.default is not inspect.Parameter.empty
    }, line

    rows = {name: row for row in options_section() if row.startswith("| `") for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert set(rows) == set(parameters) - {"model"}, "the options table's rows and optimize's parameters differ"
    assert '"int8"' in rows["precision"] and "int8" in rows["accuracy"]


def test_the_command_line_section_shows_int8_in_commands_that_parse() -> None:
    """Every `graphopt optimize` line of the README parses (options in [brackets] included), and one asks for int8."""
    from graphopt.cli import build_parser

    lines = README.read_text().splitlines()
    commands = [line.split("#")[0].replace("[", "").replace("]", "") for line in lines if line.startswith("graphopt optimize ")]
    for command in commands:
        build_parser().parse_args(shlex.split(command)[1:])  # argparse exits (failing the test) on an unknown option or choice
    assert any("--precision int8 --calibration" in command for command in commands)

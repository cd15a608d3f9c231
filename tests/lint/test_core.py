"""The lint machinery and CLI: findings, selection, fixes, JSON, exit codes (rules are tested per module)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import graphopt
from graphopt import cli
from graphopt.lint import RULES, check_source, fix_source
from graphopt.lint.core import add_keyword, Edit

SCRIPT = textwrap.dedent(
    """\
    import torch
    from torch import nn

    model = nn.DataParallel(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad(set_to_none=False)
    """
)


def test_findings_carry_code_message_why_and_fix() -> None:
    findings = check_source(SCRIPT, "train.py", select=["GO201", "GO301"])
    assert [(f.code, f.line, f.fixable) for f in findings] == [("GO201", 4, False), ("GO301", 6, True)]
    first = findings[0]
    assert first.path == "train.py" and first.why and first.fix and first.name == "data-parallel"
    assert str(first) == "train.py:4:9: GO201 nn.DataParallel: use DistributedDataParallel"


def test_json_keys_are_stable() -> None:
    (finding,) = check_source(SCRIPT, "train.py", select=["GO301"])
    assert list(finding.to_dict()) == ["code", "name", "message", "why", "fix", "path", "line", "col", "fixable"]


def test_every_rule_is_documented() -> None:
    check_source("", "empty.py")  # loads the rule modules
    assert len(RULES) >= 2
    for code, rule in RULES.items():
        assert code.startswith("GO") and len(code) == 5 and rule.name and rule.message and rule.why and rule.fix


def test_fix_applies_safe_edits_only() -> None:
    fixed, remaining = fix_source(SCRIPT, "train.py", select=["GO201", "GO301"])
    assert "zero_grad(set_to_none=True)" in fixed and fixed.replace("set_to_none=True", "set_to_none=False") == SCRIPT
    assert [f.code for f in remaining] == ["GO201"]
    compile(fixed, "train.py", "exec")
    assert fix_source(fixed, "train.py", select=["GO301"])[0] == fixed


def test_add_keyword_handles_trailing_commas_and_empty_calls() -> None:
    import ast

    for source, expected in [
        ("f(a)", "f(a, x=1)"),
        ("f()", "f(x=1)"),
        ("f(a,)", "f(a, x=1)"),
        ("f(\n    a,\n)", "f(\n    a,\n x=1)"),
    ]:
        call = ast.parse(source).body[0].value  # type: ignore[attr-defined]
        edit = add_keyword(call, "x=1", source)
        lines = source.splitlines(keepends=True)
        start = sum(len(line) for line in lines[: edit.line - 1]) + edit.col
        assert source[:start] + edit.replacement + source[start:] == expected
        compile(expected, "<test>", "eval")
    assert isinstance(edit, Edit)


def test_unknown_codes_and_unparsable_files() -> None:
    with pytest.raises(graphopt.GraphoptError, match=r"unknown lint rule codes \['GO999'\]"):
        check_source(SCRIPT, select=["GO999"])
    with pytest.raises(graphopt.GraphoptError, match="train.py:1: cannot lint a file that does not parse"):
        check_source("def (:\n", "train.py")


def test_cli_lint_exit_codes_formats_and_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "clean.py").write_text("x = 1\n")
    assert cli.main(["lint", str(tmp_path), "--select", "GO201,GO301"]) == 1
    out = capsys.readouterr().out
    assert f"{script}:4:9: GO201" in out and "why: " in out and out.rstrip().endswith("2 finding(s)")
    assert cli.main(["lint", str(script), "--select", "GO301", "--format", "json"]) == 1
    assert [f["code"] for f in json.loads(capsys.readouterr().out)] == ["GO301"]
    assert cli.main(["lint", str(script), "--select", "GO301", "--fix"]) == 0
    assert "set_to_none=True" in script.read_text()
    assert capsys.readouterr().out.rstrip().endswith("0 finding(s) left after --fix")
    assert cli.main(["lint", str(tmp_path / "missing.py")]) == 2
    assert "missing.py does not exist" in capsys.readouterr().err


def test_facts_see_training_loops_through_any_backward_and_only_real_convs() -> None:
    import ast

    from graphopt.lint.core import Facts

    source = textwrap.dedent(
        """\
        import torch
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(build())
        for x, y in loader:
            scaler.scale(criterion(model(x), y)).backward()
        """
    )
    facts = Facts.of(source, ast.parse(source))
    assert len(facts.training_loops) == 1 and not facts.has_convs
    conv = "import torch\nnet = torch.nn.Conv2d(3, 8, 3)\n"
    assert Facts.of(conv, ast.parse(conv)).has_convs

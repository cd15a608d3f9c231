"""``graphopt lint``: check training scripts (files or folders) against graphopt.lint's performance playbook, print
the findings as text or JSON, and apply the safe fixes with --fix.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from graphopt.cli_arguments import UsageError, split_names
from graphopt.lint import check_source, fix_source


def _python_files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            files += sorted(path.rglob("*.py"))
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{text} does not exist: name Python files or folders to lint")
    return files


def lint_command(args: argparse.Namespace) -> int:
    select = split_names(args.select)
    findings = []
    for path in _python_files(args.paths):
        source = path.read_text(encoding="utf-8")
        if args.fix:
            fixed, remaining = fix_source(source, str(path), select)
            if fixed != source:
                path.write_text(fixed, encoding="utf-8")
            findings += remaining
        else:
            findings += check_source(source, str(path), select)
    if args.format == "json":
        print(json.dumps([finding.to_dict() for finding in findings], indent=2))
    else:
        for finding in findings:
            print(finding)
            print(f"    why: {finding.why}\n    fix: {finding.fix}")
        print(f"{len(findings)} finding(s)" + (" left after --fix" if args.fix else ""))
    return 1 if findings else 0

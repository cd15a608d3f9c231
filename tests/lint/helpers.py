"""Helpers the rule tests share."""

from __future__ import annotations

from graphopt import lint


def found(source: str, code: str) -> list[tuple[str, int]]:
    """(code, line) of each finding of rule ``code`` in ``source``."""
    return [(f.code, f.line) for f in lint.check_source(source, "train.py", select=[code])]


def line(source: str, text: str) -> int:
    """The 1-based number of the one line of ``source`` containing ``text``."""
    numbers = [n for n, content in enumerate(source.splitlines(), 1) if text in content]
    assert len(numbers) == 1, f"{text!r} is on lines {numbers}"
    return numbers[0]

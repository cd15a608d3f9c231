"""graphopt.data.memory: the memory numbers read from the operating system."""

from __future__ import annotations

from graphopt.data.memory import default_budget


def test_default_budget_is_positive() -> None:
    assert default_budget() > 0

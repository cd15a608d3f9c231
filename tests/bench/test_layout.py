"""The layout comparison script runs end to end (a smoke run: its figures are not checked)."""

from __future__ import annotations

import pytest

from graphopt.bench import layout


def test_layout_table_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert layout.main(["--models", "resnet", "--batch", "2", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "| model | eager NCHW | eager channels_last | graphopt preserve | graphopt channels_last | graphopt auto |"
    assert lines[3].startswith("| resnet | 1.00x | ")
    assert lines[4].startswith("|   auto: measured on the example inputs:")

"""The comparison script runs end to end (a smoke run: its figures are not checked)."""

from __future__ import annotations

import pytest

from graphopt.bench import compare


def test_compare_table_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--models", "resnet", "--batch", "2", "--rounds", "1"]) == 0  # onnxruntime variants included
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == (
        "| model | eager fp32 | eager fp32 channels_last | eager bf16 autocast channels_last | graphopt fp32 | graphopt bf16 "
        "| onnxruntime plain export | onnxruntime graphopt export |"
    )
    assert lines[3].startswith("| resnet | 1.00x | ")
    assert lines[4].startswith("|   graphopt fp32 layout: measured on the example inputs:")
    assert lines[5].startswith("|   graphopt bf16 layout: measured on the example inputs:")

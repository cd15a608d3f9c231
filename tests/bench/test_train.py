"""``make bench-train`` (graphopt.bench.train): a smoke run on tiny stand-in models checks its table's form."""

from __future__ import annotations

import re

import pytest

from graphopt.bench import train as bench


@pytest.mark.parametrize("model", ["resnet50", pytest.param("bert-base", marks=pytest.mark.filterwarnings("ignore::UserWarning"))])
def test_a_small_run_prints_a_row_per_variant(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    if model == "bert-base":
        pytest.importorskip("transformers")
    variants = 'eager bf16 autocast + CL,eager bf16 autocast + CL (again),graphopt default,graphopt precision="bf16"'
    assert bench.main(["--small", "--models", model, "--batch", "4", "--rounds", "1", "--variants", variants]) == 0
    out = capsys.readouterr().out
    assert "threads, torch" in out and "one training step" in out and "batch 4" in out
    rows = re.findall(r"^\| (\S+) \| ([^|]+) \| (\d+\.\d\d)x \| ([^|]*) \|$", out, re.M)
    autocast = "eager bf16 autocast + CL" if model == "resnet50" else "eager bf16 autocast"
    expected = ["eager fp32", *([autocast, f"{autocast} (again)"] if model == "resnet50" else []), "graphopt default", 'graphopt precision="bf16"']
    assert [(name, variant.strip()) for name, variant, _, _ in rows] == [(model, variant) for variant in expected]
    assert rows[-1][3].strip() in ("bf16 pass kept", "bf16 pass rolled back")

"""``make bench-transformers`` (graphopt.bench.transformers): a smoke run on a 2-layer GPT-2 checks its table's form."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from graphopt.bench import transformers as bench


def test_a_small_run_prints_a_row_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    variants = "graphopt default,onnxruntime fp32"
    argv = ["--small", "--models", "gpt2-small", "--batch", "2", "--length", "8", "--rounds", "1", "--variants", variants]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "threads, torch" in out and "batch 2, sequence 8" in out
    rows = re.findall(r"^\| (\S+) \| ([^|]+) \| (\d+\.\d\d)x \| (\S+) \|$", out, re.M)
    assert [(model, variant.strip()) for model, variant, _, _ in rows] == [
        ("gpt2-small", variant) for variant in ("eager", "graphopt default", "onnxruntime fp32")
    ]
    assert all(float(error) < 1e-4 for _, _, _, error in rows)  # exact fp32 variants

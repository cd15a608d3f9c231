"""``make bench-deploy`` (graphopt.bench.deploy): a smoke run on a small model checks its table's form."""

from __future__ import annotations

import re

import pytest

from graphopt.bench import deploy


def test_a_small_run_prints_a_row_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    variants = "graphopt module,graphopt.load(saved file)"  # the AOTInductor and torch.compile variants compile for minutes
    assert deploy.main(["--models", "resnet", "--batch", "2", "--rounds", "1", "--variants", variants]) == 0
    out = capsys.readouterr().out
    assert "threads, torch" in out and "batch 2;" in out
    rows = re.findall(r"^\| (\S+) \| ([^|]+) \| (\d+\.\d\d)x \| (\S+) \| ([^|]*) \|$", out, re.M)
    assert [(model, variant.strip()) for model, variant, *_ in rows] == [("resnet", variant) for variant in ("eager", "graphopt module", "graphopt.load(saved file)")]
    assert all(float(error) < 1e-4 for _, _, _, error, _ in rows)  # exact fp32 variants
    assert [build.strip().endswith("s") for *_, build in rows] == [False, True, True]  # eager is not built

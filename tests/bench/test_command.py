"""``graphopt bench`` from the command line: --quick smoke runs and the files they write.

The runs are real but tiny (the smallest reference model, batch 2, two rounds) and
select a few fast variants; their figures are checked for form, never for speed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import graphopt.models
from graphopt import cli, cli_bench
from graphopt.bench.harness import BenchModel
from graphopt.bench.models import select_models
from graphopt.bench.results import BenchResult
from graphopt.bench.suite import QUICK_VARIANTS
from graphopt.bench.variants import select, variants
from graphopt.errors import InvalidOptionError

FAST_VARIANTS = "eager-cl,graphopt"


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_quick_run_writes_json_markdown_and_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = bench(capsys, "--quick", "--variants", FAST_VARIANTS, "--output-dir", str(tmp_path))
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["command"] == (
        "graphopt bench --models transformer --batch 2 --device auto --rounds 2 --warmup 1 --variants eager-cl,graphopt"
    )
    assert data["settings"]["rounds"] == 2 and data["settings"]["variants"] == ["eager", "eager-cl", "graphopt"]
    assert data["machine"]["cpu"] and data["machine"]["torch_threads"] >= 1
    assert data["machine"]["matmul_size"] == 256 and data["machine"]["matmul_gflops"]["fp32"] > 0  # --quick: a small product
    (model,) = data["models"]
    assert model["name"] == "transformer" and model["input_shapes"] == [[2, 3, 32, 32]] and model["error"] is None
    assert [v["key"] for v in model["variants"]] == ["eager", "eager-cl", "graphopt"]
    for variant in model["variants"]:
        assert variant["status"] == "ok", variant
        assert len(variant["samples_ms"]) == len(variant["round_ratios"]) == 2
        assert variant["median_ms"] > 0 and variant["ratio_vs_eager"] > 0 and variant["setup_s"] > 0
        assert variant["max_error"] < 1e-4
    assert model["variants"][0]["round_ratios"] == [1.0, 1.0]
    assert model["best_peer"] == "eager-cl" and model["best_graphopt"] == "graphopt"
    assert model["graphopt_vs_best_peer"] > 0
    assert model["graphopt_vs_each_peer"] == {"eager-cl": model["graphopt_vs_best_peer"]}
    assert model["flops"] > 0 and model["classes"]["low"] is None
    exact = model["classes"]["exact"]
    assert (exact["best_peer"], exact["fastest_graphopt"], exact["graphopt_default"]) == ("eager-cl", "graphopt", None)
    assert 0 < exact["roofline_fastest"] and exact["roofline_default"] is None
    graphopt_row = model["variants"][2]
    assert graphopt_row["roofline_fraction"] == pytest.approx(exact["roofline_fastest"]) and graphopt_row["gflops"] > 0

    markdown = (tmp_path / "bench.md").read_text()
    assert "Command: `graphopt bench --models transformer" in markdown
    assert "| transformer | eager fp32 + CL (" in markdown  # the summary: best peer, best graphopt, ratio
    assert "Matrix-multiply rate on these threads (256x256 torch.mm): fp32 " in markdown
    assert "| transformer | exact | eager fp32 + CL | — | — | graphopt fp32 | " in markdown  # per precision class
    assert "### transformer (input 2x3x32x32)" in markdown
    assert "| model | fastest graphopt | eager fp32 + CL |" in markdown  # graphopt vs each peer
    assert f"| transformer | graphopt fp32 | {model['graphopt_vs_each_peer']['eager-cl']:.2f}x |" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| eager fp32 |") or line.startswith("| graphopt fp32 |")]
    roofline = re.compile(r"\(\d+%( implausible)?\) \|$")  # flagged when a loaded machine measured too low a matmul rate
    assert len(rows) == 2 and all(row.count("|") == 9 and " ms | " in row and " MiB | " in row and " | exact | " in row and roofline.search(row) for row in rows)
    assert "Peak memory: growth of the process's resident memory" in markdown
    assert markdown.strip() in out  # the same table is printed


def test_the_plot_is_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib comes with graphopt[bench] (installed by make test/bench)")
    code, out, _ = bench(capsys, "--quick", "--variants", "graphopt", "--output-dir", str(tmp_path))
    assert code == 0
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"written: {tmp_path / 'bench.png'}" in out


def test_without_matplotlib_the_run_says_why_there_is_no_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code, out, _ = bench(capsys, "--quick", "--variants", "graphopt", "--output-dir", str(tmp_path))
    assert code == 0
    assert "no plot: matplotlib is not installed (pip install 'graphopt[bench]')" in out
    assert not (tmp_path / "bench.png").exists() and (tmp_path / "bench.json").exists()


def test_failures_are_recorded_in_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_optimize(*args: object, **kwargs: object) -> None:
        raise RuntimeError("graphopt broke")

    monkeypatch.setattr(graphopt, "optimize", broken_optimize)
    # the low-precision variants are left out: on a CPU without native bf16 they are skipped before building
    excluded = "*fuse,*graph,*tune*,*onednn,*low*,graphopt-openvino*,graphopt-ort,graphopt-inductor*"
    code, out, _ = bench(capsys, "--quick", "--variants", "graphopt*", "--exclude", excluded, "--output-dir", str(tmp_path))
    assert code == 0
    variants = json.loads((tmp_path / "bench.json").read_text())["models"][0]["variants"]
    assert [(v["key"], v["status"], v["reason"]) for v in variants[1:]] == [
        ("graphopt-default", "failed", "RuntimeError: graphopt broke"),
        ("graphopt", "failed", "RuntimeError: graphopt broke"),
        ("graphopt-cl", "failed", "RuntimeError: graphopt broke"),
        ("graphopt-int8", "failed", "RuntimeError: graphopt broke"),
        ("graphopt-int8-1e-1", "failed", "RuntimeError: graphopt broke"),
        ("graphopt-ort-int8", "failed", "RuntimeError: graphopt broke"),
    ]
    assert "| graphopt fp32 | failed: RuntimeError: graphopt broke |" in (tmp_path / "bench.md").read_text()


def test_module_factory_models_take_their_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = bench(
        capsys, "--models", "graphopt.models:resnet_small", "--input", "2x3x16x16", "--variants", "graphopt",
        "--rounds", "1", "--warmup", "0", "--output-dir", str(tmp_path),
    )  # fmt: skip
    assert code == 0
    (model,) = json.loads((tmp_path / "bench.json").read_text())["models"]
    assert model["name"] == "graphopt.models:resnet_small" and model["input_shapes"] == [[2, 3, 16, 16]]
    assert [v["status"] for v in model["variants"]] == ["ok", "ok"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "resnet,nope"], "unknown model 'nope': use reference, anchors, one of convnext, reference.mobilenet_v2, resnet, transformer, convnext_tiny, efficientnet_b0, anchors.mobilenet_v2, resnet50, vit_b_16, or MODULE:FACTORY"),
        (["--models", "mobilenet_v2"], "--models mobilenet_v2 names two models: the small reference model (3x64x64 per sample) and the full-size anchor (3x224x224): say reference.mobilenet_v2 or anchors.mobilenet_v2"),
        (["--models", "graphopt.models:nope"], "module 'graphopt.models' has no attribute 'nope'"),
        (["--models", "graphopt.models:resnet_small", "--input", "2xfoo"], "--input '2xfoo' is not SHAPE[:DTYPE]"),
        (["--variants", "tensorrt"], "no variant matches 'tensorrt'"),
        (["--device", "tpu"], "the benchmark runs on auto, cpu, cuda or cuda:N"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = bench(capsys, "--quick", *argv, "--output-dir", str(tmp_path))
    assert code == 2
    assert message in err
    assert not (tmp_path / "bench.json").exists()


def test_anchor_models_are_required_for_anchors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(graphopt.models, "ANCHOR_MODELS", raising=False)
    code, _, err = bench(capsys, "--models", "anchors", "--output-dir", str(tmp_path))
    assert code == 2
    assert "--models anchors needs graphopt.models.ANCHOR_MODELS" in err


def test_a_name_both_groups_have_is_chosen_by_its_group() -> None:
    def no_factory(entry: str) -> BenchModel:
        raise AssertionError(entry)

    reference, anchor, resnet50 = select_models("reference.mobilenet_v2, anchors.mobilenet_v2,resnet50", 2, no_factory)
    assert [model.name for model in (reference, anchor, resnet50)] == ["mobilenet_v2", "mobilenet_v2", "resnet50"]
    assert [tuple(model.inputs()[0].shape) for model in (reference, anchor, resnet50)] == [(2, 3, 64, 64), (2, 3, 224, 224), (2, 3, 224, 224)]
    with pytest.raises(InvalidOptionError, match="unknown model 'anchors.resnet'"):
        select_models("anchors.resnet", 2, no_factory)


def test_anchor_models_are_found_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = graphopt.models.ReferenceModel("tiny_anchor", graphopt.models.resnet_small, (8, 3, 16, 16), "a stand-in anchor")
    monkeypatch.setattr(graphopt.models, "ANCHOR_MODELS", {"tiny_anchor": tiny}, raising=False)
    code, _, _ = bench(capsys, "--quick", "--models", "tiny_anchor", "--variants", "eager", "--output-dir", str(tmp_path))
    assert code == 0
    (model,) = json.loads((tmp_path / "bench.json").read_text())["models"]
    assert model["name"] == "tiny_anchor" and model["input_shapes"] == [[2, 3, 16, 16]]


def test_list_variants(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = bench(capsys, "--list-variants", "--low-precision", "fp16")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["eager", "baseline", "eager", "fp32"]
    assert any(line.split()[:2] == ["ort-plain", "peer"] for line in lines)
    assert any("eager fp16 autocast" in line for line in lines)


def test_quick_runs_a_few_fast_variants_and_says_which(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--quick alone picks its short list (not all 29 variants), records it in the command, and --help names it."""
    calls: list[tuple[Any, str]] = []
    monkeypatch.setattr(cli_bench, "run_suite", lambda models, settings, command: calls.append((settings, command)) or BenchResult(command, {}, {}, ""))
    monkeypatch.setattr(cli_bench, "to_markdown", lambda result: "")
    bench(capsys, "--quick", "--output-dir", str(tmp_path))
    ((settings, command),) = calls
    assert settings.variants == list(QUICK_VARIANTS) and 3 <= len(QUICK_VARIANTS) <= 6
    assert command.endswith("--warmup 1 --variants " + ",".join(QUICK_VARIANTS))
    chosen = select(variants("bf16"), settings.variants)
    assert {v.role for v in chosen} == {"baseline", "peer", "graphopt"}  # still a comparison
    assert not [v.key for v in chosen if v.key.startswith(("compile", "openvino", "ort", "pt2e")) or "int8" in v.key]  # the slow ones
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert ",".join(QUICK_VARIANTS) in "".join(capsys.readouterr().out.split())  # argparse wraps lines at hyphens too

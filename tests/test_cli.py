"""Tests of the ``graphopt`` command line (graphopt.cli).

Commands run in-process through ``graphopt.cli.main(argv)``; one test runs
``python -m graphopt.cli`` in a subprocess to check the exit status reaches the shell.
Inputs stay small (batch 2, 32x32) so every command finishes in about a second.
No test measures time: the demo's latency measurement is replaced by a stub.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import graphopt
from graphopt import cli, cli_bench, cli_optimize, timing
from graphopt.errors import GraphoptError
from graphopt.pipeline import PRESETS, preset
from tests.conftest import measured_as

REPO_ROOT = Path(__file__).resolve().parents[1]
RESNET = "graphopt.models:resnet_small"
SMALL_INPUT = "2x3x32x32"


def not_a_model() -> int:
    """A factory that returns something other than an nn.Module."""
    return 3


# importable both as tests.test_cli and as test_cli, whichever way pytest imported this file
NOT_A_MODEL = f"{__name__}:not_a_model"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict[str, list[str]]:
    """The report table's rows, pass name -> its cells, in printed order."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["pass", "rewrites"])
    assert set(lines[header + 1].replace(" ", "")) == {"-"}, lines[header + 1]
    rows: dict[str, list[str]] = {}
    for line in lines[header + 2 :]:
        if not line.strip() or line.startswith(("report written", "(no passes ran)", "fusion (")):
            break
        if line.startswith(" "):  # a skip reason under its pass
            continue
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


# --------------------------------------------------------------------------- passes


def test_passes_lists_every_registered_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "passes")
    assert code == 0 and err == ""
    infos = graphopt.list_passes()
    assert len(infos) >= 3
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == [info.name for info in infos]
    for line, info in zip(lines, infos):
        assert f"[{', '.join(info.modes)}]" in line
        assert info.description in line
        assert (f"default: {', '.join(info.presets)}" if info.presets else "opt-in: --") in line


def test_passes_says_how_to_ask_for_each_opt_in_pass(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "passes")
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert "default: inference " in rows["fold_conv_bn"] and "opt-in: --passes" in rows["drop_conv_bias"]
    assert "opt-in: --precision" in rows["use_low_precision"] and "opt-in: --fuse" in rows["extract_pointwise_regions"]
    assert "opt-in: --passes" in rows["pad_channels"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"graphopt {graphopt.__version__} (torch {torch.__version__})"


# --------------------------------------------------------------------------- optimize


def test_optimize_prints_the_report_and_writes_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report_path = tmp_path / "r.json"
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--report", str(report_path), "--memory-format", "channels_last")
    assert code == 0, err
    assert "graphopt: error" not in err
    assert "mode: inference" in out and "frontend: fx" in out and "verify: on" in out
    rows = table_rows(out)
    assert list(rows) == list(preset("inference", measure=False))
    assert f"report written to {report_path}" in out

    data = json.loads(report_path.read_text())
    assert data["mode"] == "inference" and data["frontend"] == "fx"
    passes = {p["name"]: p for p in data["passes"]}
    assert list(passes) == list(preset("inference", measure=False))
    for name in ("remove_dropout", "fold_conv_bn", "to_channels_last"):
        report = passes[name]
        assert len(report["rewrites"]) > 0, name
        assert all(rewrite["where"] and rewrite["detail"] for rewrite in report["rewrites"])
        assert report["modified"]
        # the table and the JSON describe the same run
        assert rows[name][0] == str(len(report["rewrites"]))
        assert rows[name][1] == str(len(report["skips"]))
    assert any("bn" in rewrite["detail"] for rewrite in passes["fold_conv_bn"]["rewrites"])


def test_optimize_in_training_mode_runs_the_preset_and_opt_in_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--mode", "training")
    assert code == 0, err
    assert "mode: training" in out
    assert list(table_rows(out)) == list(PRESETS["training"])
    assert "drop_conv_bias" not in PRESETS["training"], "exact under plain SGD only: opt-in"

    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--mode", "training", "--passes", "drop_conv_bias")
    assert code == 0, err
    assert int(table_rows(out)["drop_conv_bias"][0]) > 0
    assert "exact under plain SGD without weight decay only" in out  # the report's caveat


def test_optimize_fuses_pointwise_regions(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--fuse", "torchscript")
    assert code == 0, err
    assert list(table_rows(out))[-1] == "extract_pointwise_regions"
    assert "fusion (torchscript): 4/4 regions compiled" in out


def test_fuse_off_is_fuse_false_and_left_out_none(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--fuse off``: nothing compiled, a language model's decode step included (``fuse=False``); left out, ``None``."""
    given = []
    real = cli_optimize.optimize
    monkeypatch.setattr(cli_optimize, "optimize", lambda *args, **options: given.append(options["fuse"]) or real(*args, **options))
    for fuse in (["--fuse", "off"], []):
        code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, *fuse)
        assert code == 0, err
    assert given == [False, None]


def test_optimize_runs_exactly_the_passes_given(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--passes", "fold_conv_bn")
    assert code == 0, err
    rows = table_rows(out)
    assert list(rows) == ["fold_conv_bn"]
    assert int(rows["fold_conv_bn"][0]) > 0


def test_optimize_runs_the_passes_in_the_order_given(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--passes", "fold_conv_bn, remove_dropout")
    assert code == 0, err
    assert list(table_rows(out)) == ["fold_conv_bn", "remove_dropout"]


def test_optimize_leaves_out_disabled_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--disable", "fold_conv_bn")
    assert code == 0, err
    assert list(table_rows(out)) == [name for name in PRESETS["inference"] if name != "fold_conv_bn"]
    assert "fold_conv_bn" not in out


def test_optimize_with_every_pass_disabled_runs_none(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--disable", ",".join(PRESETS["inference"]))
    assert code == 0, err
    assert table_rows(out) == {}
    assert "(no passes ran)" in out


def test_optimize_without_verification(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--no-verify", "--passes", "fold_conv_bn")
    assert code == 0, err
    assert "verify: off" in out
    assert table_rows(out)["fold_conv_bn"][3] == "-"  # max error column: not measured


def test_optimize_with_strict_verification_fails_on_a_mismatch(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from graphopt.errors import VerificationError

    def refuse(*args, **kwargs):
        assert kwargs["verify"] == "strict"
        raise VerificationError("pass 'x' changed output")

    monkeypatch.setattr(cli_optimize, "optimize", refuse)
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--strict-verify")
    assert code != 0 and "pass 'x' changed output" in err


def test_optimize_with_the_export_frontend(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--frontend", "export", "--passes", "fold_conv_bn")
    assert code == 0, err
    assert "frontend: export" in out
    assert int(table_rows(out)["fold_conv_bn"][0]) > 0


@pytest.mark.parametrize(("choice", "dynamic"), [("auto", "x dims 0, 2, 3"), ("none", "none")])
def test_optimize_with_dynamic_shapes(capsys: pytest.CaptureFixture[str], choice: str, dynamic: str) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--dynamic-shapes", choice, "--passes", "fold_conv_bn")
    assert code == 0, err
    assert f"dynamic sizes: {dynamic}\n" in out


# --------------------------------------------------------------------------- errors

ERROR_CASES = {
    "input_not_a_number": (["optimize", RESNET, "--input", "8x3xfoo"], ["'8x3xfoo'", "SHAPE[:DTYPE]", "e.g. 8x3x224x224"]),
    "input_unknown_dtype": (["optimize", RESNET, "--input", "8x3:complex"], ["'8x3:complex'", "dtypes:", "float32", "int64"]),
    "input_zero_size": (["optimize", RESNET, "--input", "2x3x0x32"], ["'2x3x0x32'", "SHAPE[:DTYPE]"]),
    "target_without_colon": (["optimize", "graphopt.models", "--input", SMALL_INPUT], ["'graphopt.models'", "MODULE:FACTORY", "graphopt.models:resnet_small"]),
    "module_not_importable": (["optimize", "no_such_module_for_graphopt_tests:build", "--input", SMALL_INPUT], ["cannot import", "'no_such_module_for_graphopt_tests'", "PYTHONPATH"]),
    "missing_attribute": (["optimize", "graphopt.models:resnet_tiny", "--input", SMALL_INPUT], ["'graphopt.models'", "no attribute 'resnet_tiny'"]),
    "factory_returns_non_module": (["optimize", NOT_A_MODEL, "--input", SMALL_INPUT], ["not_a_model", "returned int", "not a torch.nn.Module"]),
    "unknown_pass": (["optimize", RESNET, "--input", SMALL_INPUT, "--passes", "fold_conv_b"], ["unknown pass 'fold_conv_b'", "Did you mean 'fold_conv_bn'"]),
    "unknown_disabled_pass": (["optimize", RESNET, "--input", SMALL_INPUT, "--disable", "remove_dropot"], ["unknown pass 'remove_dropot'", "Did you mean 'remove_dropout'"]),
    "pass_for_another_mode": (["optimize", RESNET, "--input", SMALL_INPUT, "--mode", "training", "--passes", "fold_conv_bn"], ["'fold_conv_bn'", "inference mode", "not training"]),
    "model_rejects_input": (["optimize", RESNET, "--input", "2x3x32"], ["raised", "[2, 3, 32]", "Pass example inputs"]),
    "model_rejects_second_input": (["optimize", RESNET, "--input", SMALL_INPUT, "--input", "2x3"], ["raised TypeError", "[2, 3]", "number of arguments"]),
}


@pytest.mark.parametrize(("argv", "fragments"), list(ERROR_CASES.values()), ids=list(ERROR_CASES))
def test_errors_exit_2_with_a_message_saying_what_to_do(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragments: list[str]
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("graphopt: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize("target", ["graphopt.models:__all__", "graphopt.models.resnet:nn"], ids=["list", "module"])
def test_a_target_that_is_not_callable_is_a_usage_error(capsys: pytest.CaptureFixture[str], target: str) -> None:
    code, _, err = run(capsys, "optimize", target, "--input", SMALL_INPUT)
    assert code == 2
    assert err.startswith("graphopt: error: ") and target in err


def test_a_factory_that_needs_arguments_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "optimize", "graphopt.models:get_reference_model", "--input", SMALL_INPUT)
    assert code == 2
    assert err.startswith("graphopt: error: ") and "get_reference_model" in err


def test_a_misspelt_factory_name_suggests_the_close_match(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "optimize", "graphopt.models:resnet_smal", "--input", SMALL_INPUT)
    assert code == 2
    assert "resnet_small" in err


FACTORY_FILE = """
import torch.nn as nn


def build():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
"""


def test_a_factory_in_a_python_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "net_in_a_file.py").write_text(FACTORY_FILE)
    code, out, err = run(capsys, "optimize", f"{tmp_path}/models/net_in_a_file.py:build", "--input", SMALL_INPUT, "--memory-format", "preserve")
    assert code == 0, err
    assert int(table_rows(out)["fold_conv_bn"][0]) == 1
    code, _, err = run(capsys, "optimize", f"{tmp_path}/models/missing.py:build", "--input", SMALL_INPUT)
    assert code == 2 and "is not a file" in err


def test_a_factory_in_a_module_of_the_current_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "net_in_this_folder.py").write_text(FACTORY_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])  # as the installed script runs
    code, out, err = run(capsys, "optimize", "net_in_this_folder:build", "--input", SMALL_INPUT, "--memory-format", "preserve")
    assert code == 0, err
    assert int(table_rows(out)["fold_conv_bn"][0]) == 1


def test_errors_name_the_command_line_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    existing = tmp_path / "model.onnx"
    existing.write_text("")
    code, _, err = run(capsys, "export", RESNET, str(existing), "--input", SMALL_INPUT)
    assert code == 2 and "pass --overwrite to replace it" in err and "overwrite=True" not in err
    code, _, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--passes", "to_channels_last", "--memory-format", "preserve")
    assert code == 2 and "--passes asks for to_channels_last but --memory-format preserve forbids it" in err


def test_optimize_saves_the_module_and_run_loads_and_times_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    saved = tmp_path / "resnet.pt2"
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--save", str(saved))
    assert code == 0, err
    assert f"saved to {saved}" in out and saved.is_file()
    code, out, err = run(capsys, "run", str(saved), "--rounds", "2")
    assert code == 0, err
    assert "graphopt module; accepts (x: Tensor[*, 3, 32, 32] float32 on cpu)" in out
    assert "inputs [[2, 3, 32, 32]] -> outputs [[2, 10]]" in out and "median latency" in out
    code, out, err = run(capsys, "run", str(saved), "--input", "5x3x32x32", "--rounds", "1")
    assert code == 0, err
    assert "inputs [[5, 3, 32, 32]] -> outputs [[5, 10]]" in out
    code, _, err = run(capsys, "run", str(saved), "--input", "5x3x31x32")
    assert code == 2 and "x has shape [5, 3, 31, 32], but this optimized module accepts" in err
    code, _, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--save", str(saved))
    assert code == 2 and "pass --overwrite to replace it" in err
    code, _, err = run(capsys, "run", str(tmp_path / "missing.pt2"))
    assert code == 2 and "no file at" in err


def test_optimize_packages_the_module_with_aotinductor(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--package reaches graphopt.package (the compile itself is tested in test_saving: it takes a while)."""

    def no_compiler(program: Any, package_path: str) -> str:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--package", str(tmp_path / "model.pt2"))
    assert code == 2 and "AOTInductor could not compile the graph (RuntimeError: no C++ compiler found). Nothing was written." in err
    assert list(tmp_path.iterdir()) == []


def test_the_module_entry_point_exits_with_the_error_status() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "graphopt.cli", "optimize", RESNET, "--input", "8x3xfoo"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("graphopt: error: ")]
    assert len(errors) == 1 and "'8x3xfoo'" in errors[0], result.stderr


# --------------------------------------------------------------------------- parse_input_spec


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("spec", "shape", "dtype"),
    [
        ("2x3x4x5", (2, 3, 4, 5), torch.float32),
        ("7", (7,), torch.float32),
        ("2X3", (2, 3), torch.float32),
        ("2x3:float32", (2, 3), torch.float32),
        ("2x3:float64", (2, 3), torch.float64),
        ("2x3:float16", (2, 3), torch.float16),
        ("2x3:bfloat16", (2, 3), torch.bfloat16),
        ("4x6:int64", (4, 6), torch.int64),
        ("4x6:int32", (4, 6), torch.int32),
    ],
)
def test_parse_input_spec_shapes_and_dtypes(spec: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    tensor = cli.parse_input_spec(spec, generator())
    assert tuple(tensor.shape) == shape
    assert tensor.dtype == dtype


def test_parse_input_spec_draws_integers_from_0_to_7() -> None:
    tensor = cli.parse_input_spec("64x64:int64", generator())
    assert tensor.min() >= 0 and tensor.max() < 8
    assert set(tensor.unique().tolist()) == set(range(8))


def test_parse_input_spec_draws_standard_normal_floats() -> None:
    tensor = cli.parse_input_spec("64x64", generator())
    assert abs(tensor.mean().item()) < 0.1
    assert 0.9 < tensor.std().item() < 1.1


def test_parse_input_spec_is_determined_by_the_generator() -> None:
    first = cli.parse_input_spec("3x5", generator(0))
    torch.testing.assert_close(cli.parse_input_spec("3x5", generator(0)), first)
    assert not torch.equal(cli.parse_input_spec("3x5", generator(1)), first)


@pytest.mark.parametrize("spec", ["", "x", "8x", "8x3xfoo", "8x3:complex", "0x3", "-1x3", "8x3:int8", "8,3", "2.5x3", ":int64"])
def test_parse_input_spec_rejects_malformed_specs(spec: str) -> None:
    with pytest.raises(GraphoptError, match=r"is not SHAPE\[:DTYPE\]"):
        cli.parse_input_spec(spec, generator())


# --------------------------------------------------------------------------- demo


@pytest.fixture
def timing_stub(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the latency measurement: call each variant once and report fixed times.

    Records each variant's output and whether it ran the module `optimize` returned.
    """
    optimized_calls: list[int] = []
    record: dict[str, Any] = {"outputs": {}, "ran_optimized": {}}
    real_optimize = cli_bench.optimize

    def spying_optimize(*args: Any, **kwargs: Any) -> Any:
        module = real_optimize(*args, **kwargs)
        module.register_forward_hook(lambda *_: optimized_calls.append(1))
        return module

    def fake_median_latencies(variants: dict[str, Callable[[], Any]]) -> dict[str, float]:
        for name, variant in variants.items():
            before = len(optimized_calls)
            record["outputs"][name] = variant()
            record["ran_optimized"][name] = len(optimized_calls) > before
        return {name: 0.004 / (index + 1) for index, name in enumerate(variants)}

    monkeypatch.setattr(cli_bench, "optimize", spying_optimize)
    monkeypatch.setattr(cli_bench, "median_latencies", fake_median_latencies)
    return record


def test_demo_prints_the_report_and_the_latency_ratio(capsys: pytest.CaptureFixture[str], timing_stub: dict[str, Any]) -> None:
    code, out, err = run(capsys, "demo", "--model", "resnet", "--batch", "2")
    assert code == 0, err
    assert "graphopt demo: resnet" in out
    assert "input [2, 3, 64, 64]" in out
    assert list(table_rows(out)) == list(PRESETS["inference"])
    ratio_lines = [line for line in out.splitlines() if "x vs eager" in line]
    assert len(ratio_lines) == 2
    assert ratio_lines[0].split()[0] == "eager" and ratio_lines[1].split()[0] == "graphopt"
    # the variants compared are the eager model and the optimized one, computing the same thing
    assert timing_stub["ran_optimized"] == {"eager (no_grad)": False, "graphopt": True}
    eager, optimized = timing_stub["outputs"]["eager (no_grad)"], timing_stub["outputs"]["graphopt"]
    assert eager.shape[0] == 2
    torch.testing.assert_close(optimized, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", ["0", "-1"])
def test_demo_rejects_a_batch_size_below_one(capsys: pytest.CaptureFixture[str], timing_stub: dict[str, Any], batch: str) -> None:
    with pytest.raises(SystemExit) as info:  # argparse's own usage error
        run(capsys, "demo", "--model", "resnet", "--batch", batch)
    assert info.value.code == 2
    assert "argument --batch: must be 1 or more" in capsys.readouterr().err


def test_optimize_in_bf16_adds_the_precision_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "optimize", RESNET, "--input", SMALL_INPUT, "--precision", "bf16", "--memory-format", "preserve")
    assert code == 0, err
    expected = [name for name in preset("inference", measure=False) if name != "to_channels_last"]
    expected.insert(expected.index("use_global_pool_kernel"), "use_low_precision")  # the pool kernel choice needs the final dtype
    assert list(table_rows(out)) == expected
    assert "of conv/linear/matmul FLOPs in low precision" in out


# --------------------------------------------------------------------------- int8: --precision int8 --calibration SOURCE

TINY_CNN = f"{__name__}:tiny_cnn"
TINY_INPUT = "4x1x8x8"


def tiny_cnn() -> torch.nn.Module:
    """A digits-sized CNN: one conv and one linear, the two layers int8 quantizes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10))


def calibration_images(count: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 1, 8, 8, generator=generator) for _ in range(count)]


def calibration_list() -> list[torch.Tensor]:
    """A ``--calibration MODULE:FUNCTION`` returning its batches."""
    return calibration_images()


def calibration_that_fails() -> list[torch.Tensor]:
    raise ValueError("the dataset is not mounted")


def calibration_generator_that_fails():
    yield calibration_images()[0]
    raise OSError("batch 2 is unreadable")


def calibration_returning_a_tensor() -> torch.Tensor:
    return calibration_images()[0]


def calibration_returning_nothing() -> list[torch.Tensor]:
    return []


GENERATOR_FILE = """
import torch


def batches():
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        yield torch.randn(4, 1, 8, 8, generator=generator), torch.zeros(4, dtype=torch.int64)  # (inputs, labels), as a DataLoader gives
"""


class RunsCodeWhenUnpickled:
    """Unpickling it creates ``marker``: what ``torch.load(weights_only=False)`` of a hostile file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def same_batches(given: list[Any], expected: list[Any]) -> bool:
    """Whether two lists of batches hold the same structures and tensor values."""
    return len(given) == len(expected) and all(
        torch.utils._pytree.tree_structure(a) == torch.utils._pytree.tree_structure(b)
        and all(torch.equal(x, y) for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b), strict=True))
        for a, b in zip(given, expected)
    )


def calibration_folder(tmp_path: Path) -> tuple[str, list[Any]]:
    """A folder of .pt files, one batch each, in each form a batch may take: a tensor, (inputs, labels), forward()'s keywords."""
    images = calibration_images()
    batches = [images[0], (images[1], torch.zeros(4, dtype=torch.int64)), {"input": images[2]}]
    for index, batch in enumerate(batches):
        torch.save(batch, tmp_path / f"batch_{index}.pt")
    (tmp_path / "notes.txt").write_text("not a batch: only .pt files are read")
    return str(tmp_path), batches


def calibration_file(tmp_path: Path) -> tuple[str, list[Any]]:
    torch.save(calibration_images(), tmp_path / "batches.pt")
    return str(tmp_path / "batches.pt"), calibration_images()


def calibration_module_function(tmp_path: Path) -> tuple[str, list[Any]]:
    return f"{__name__}:calibration_list", calibration_images()


def calibration_file_generator(tmp_path: Path) -> tuple[str, list[Any]]:
    (tmp_path / "calibration_data.py").write_text(GENERATOR_FILE)
    labels = torch.zeros(4, dtype=torch.int64)
    return f"{tmp_path}/calibration_data.py:batches", [(images, labels) for images in calibration_images()]


@pytest.fixture
def int8_measures_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test times anything: int8 'measures' 2x faster than float32 (as on a CPU with VNNI), so the layers stay in int8."""
    quantize = importlib.import_module("graphopt.passes.quantize_int8")  # the package attribute is the pass function

    def twice_as_fast(baseline: Callable[[], Any], candidate: Callable[[], Any], threshold: float, budget_s: float, asks: timing.Question) -> timing.Comparison:
        baseline()
        candidate()
        return measured_as(2.0, 1.0, threshold)

    monkeypatch.setattr(quantize, "compare_latency", twice_as_fast)


@pytest.fixture
def calibration_given(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``calibration`` each call of optimize from the CLI received (the call itself runs)."""
    received: list[Any] = []
    real_optimize = cli_optimize.optimize

    def spying_optimize(*args: Any, **kwargs: Any) -> Any:
        received.append(kwargs["calibration"])
        return real_optimize(*args, **kwargs)

    monkeypatch.setattr(cli_optimize, "optimize", spying_optimize)
    return received


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="int8 runs on oneDNN's kernels")
@pytest.mark.parametrize(
    "source",
    [calibration_folder, calibration_file, calibration_module_function, calibration_file_generator],
    ids=["folder_of_pt_files", "pt_file_of_a_list", "module_function", "file_py_generator"],
)
def test_optimize_in_int8_calibrated_from_each_kind_of_source(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, int8_measures_faster: None, calibration_given: list[Any], source: Callable[[Path], tuple[str, list[Any]]]
) -> None:
    reference, batches = source(tmp_path)
    code, out, err = run(capsys, "optimize", TINY_CNN, "--input", TINY_INPUT, "--precision", "int8", "--calibration", reference, "--accuracy", "0.2")
    assert code == 0, err
    assert len(calibration_given) == 1 and same_batches(calibration_given[0], batches)
    assert table_rows(out)["quantize_int8"][0] == "2"  # the conv and the linear
    assert "2 of 2 convs/linears in int8" in out and "calibrated on 3 batches" in out and "accuracy=0.2" in out


def test_int8_cannot_be_asked_for_without_a_flag_that_exists(capsys: pytest.CaptureFixture[str], tmp_path: Path, int8_measures_faster: None) -> None:
    """`graphopt passes` and the error of --passes quantize_int8 name flags that exist, and following them works."""
    _, out, _ = run(capsys, "passes")
    assert "opt-in: --precision int8" in {line.split()[0]: line for line in out.splitlines()}["quantize_int8"]
    code, _, err = run(capsys, "optimize", TINY_CNN, "--input", TINY_INPUT, "--passes", "use_onednn_kernels,quantize_int8")
    assert code == 2 and "--precision int8 and --calibration" in err, err
    reference, _ = calibration_file(tmp_path)
    code, out, err = run(
        capsys, "optimize", TINY_CNN, "--input", TINY_INPUT, "--passes", "use_onednn_kernels,quantize_int8", "--precision", "int8",
        "--calibration", reference, "--accuracy", "0.2",
    )  # fmt: skip
    assert code == 0, err
    assert list(table_rows(out)) == ["use_onednn_kernels", "quantize_int8"]
    assert table_rows(out)["quantize_int8"][0] == "1"  # the linear: without to_channels_last the conv stays off oneDNN


def write_files(**contents: Any) -> Callable[[Path], None]:
    """Writes each ``name=value`` into the test's folder with torch.save (bytes as they are)."""

    def write(folder: Path) -> None:
        for name, value in contents.items():
            path = folder / name.replace("__", ".")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(value) if isinstance(value, bytes) else torch.save(value, path)

    return write


CALIBRATION_ERRORS = {
    "no_calibration": (None, None, ["--precision int8 needs --calibration SOURCE", "a folder of .pt files", "MODULE:FUNCTION"]),
    "missing_folder": (write_files(), "{tmp}/no_such_folder", ["--calibration", "no_such_folder: no such folder", "a .pt file holding a list"]),
    "missing_file": (write_files(), "{tmp}/missing.pt", ["missing.pt: no such file", "a folder of .pt files"]),
    "empty_folder": (write_files(), "{tmp}", ["the folder holds no .pt file", "torch.save(batch, "]),
    "file_of_one_tensor": (write_files(one__pt=torch.randn(4, 1, 8, 8)), "{tmp}/one.pt", ["one.pt holds one Tensor, not a list of batches", "torch.save([batch, ...], path)"]),
    "file_of_an_empty_list": (write_files(none__pt=[]), "{tmp}/none.pt", ["none.pt holds an empty list, not a list of batches"]),
    "file_of_strings": (write_files(words__pt=["a", "b"]), "{tmp}/words.pt", ["words.pt item 0 holds one str, not a batch", "a batch is a tensor, or a tuple/list/dict of tensors"]),
    "folder_file_not_a_batch": (write_files(batch_0__pt=torch.randn(4, 1, 8, 8), batch_1__pt=3), "{tmp}", ["batch_1.pt holds one int, not a batch"]),
    "not_a_torch_file": (write_files(text__pt=b"hello"), "{tmp}/text.pt", ["cannot read", "text.pt as a torch.save file"]),
    "batch_of_wrong_rank": (write_files(flat__pt=[torch.randn(4, 64)]), "{tmp}/flat.pt", ["calibration batch 0 holds", "numbers of dimensions"]),
    "function_fails": (None, f"{__name__}:calibration_that_fails", ["calibration_that_fails() failed (ValueError: the dataset is not mounted)"]),
    "generator_fails": (None, f"{__name__}:calibration_generator_that_fails", ["calibration_generator_that_fails() failed (OSError: batch 2 is unreadable)"]),
    "function_returns_a_tensor": (None, f"{__name__}:calibration_returning_a_tensor", ["returned one Tensor", "return or yield the batches"]),
    "function_returns_nothing": (None, f"{__name__}:calibration_returning_nothing", ["calibration_returning_nothing() gave no batch"]),
    "function_misspelt": (None, f"{__name__}:calibration_lst", ["--calibration: module", "no attribute 'calibration_lst'", "did you mean", "calibration_list"]),
    "not_a_function": (None, f"{__name__}:TINY_INPUT", ["TINY_INPUT is a str: name a function that returns or yields batches"]),
    "missing_python_file": (None, "{tmp}/data.py:batches", ["--calibration:", "data.py is not a file"]),
}


@pytest.mark.parametrize(("setup", "source", "fragments"), list(CALIBRATION_ERRORS.values()), ids=list(CALIBRATION_ERRORS))
def test_calibration_errors_say_what_to_give(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, setup: Callable[[Path], None] | None, source: str | None, fragments: list[str]
) -> None:
    if setup is not None:
        setup(tmp_path)
    calibration = [] if source is None else ["--calibration", source.format(tmp=tmp_path)]
    code, out, err = run(capsys, "optimize", TINY_CNN, "--input", TINY_INPUT, "--precision", "int8", *calibration)
    assert code == 2 and out == ""
    assert err.startswith("graphopt: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_calibration_files_never_run_code(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    torch.save([RunsCodeWhenUnpickled(marker)], tmp_path / "hostile.pt")
    code, _, err = run(capsys, "optimize", TINY_CNN, "--input", TINY_INPUT, "--precision", "int8", "--calibration", str(tmp_path / "hostile.pt"))
    assert not marker.exists(), "loading the calibration file ran code from it"
    assert code == 2 and "hostile.pt holds objects other than tensors, which graphopt does not load" in err, err


def test_calibration_without_int8_or_tune_is_refused_in_the_command_line_s_words(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    reference, _ = calibration_file(tmp_path)
    code, _, err = run(capsys, "optimize", TINY_CNN, "--input", TINY_INPUT, "--calibration", reference)
    assert code == 2 and "--calibration is for --precision int8 (or --tune" in err, err


def test_a_torchvision_model_that_fails_to_import_says_which_build_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphopt import cli_arguments

    def broken(module_name: str) -> None:
        raise RuntimeError("operator torchvision::nms does not exist")  # PyPI's CUDA build beside a CPU torch

    monkeypatch.setattr(cli_arguments, "_import", broken)
    with pytest.raises(cli_arguments.UsageError, match=r"torchvision must match torch .*--index-url https://download.pytorch.org/whl/") as raised:
        cli_arguments.load_factory("torchvision.models:resnet50")
    major, minor = torch.__version__.split(".")[:2]
    assert f"torchvision==0.{int(minor) + 15}.*" in str(raised.value) and "graphopt.models.anchors" in str(raised.value)
    with pytest.raises(cli_arguments.UsageError, match="is it on PYTHONPATH"):
        cli_arguments.load_factory("my_models:resnet50")


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--tune-target", "throughput", "--tune-batch-size", "8"], "--tune-target throughput says what --tune ranks candidates by: pass --tune too"),
        (["--tune", "--tune-target", "throughput"], "give that size, e.g. --tune-batch-size 32"),
        (["--tune", "--tune-batch-size", "8"], "--tune-batch-size 8 is the batch --tune-target throughput times the candidates at"),
        (["--tune", "--tune-target", "throughput", "--tune-batch-size", "0"], "--tune-batch-size 0: give the number of samples per call"),
        (["--tune", "--tune-target", "throughput", "--tune-batch-size", "8", "--dynamic-shapes", "none"], "every size is fixed (--dynamic-shapes none or dynamic_batch=False)"),
    ],
)
def test_tune_target_errors_are_in_the_command_line_s_words(capsys: pytest.CaptureFixture[str], arguments: list[str], fragment: str) -> None:
    code, out, err = run(capsys, "optimize", TINY_CNN, "--input", TINY_INPUT, *arguments)
    assert code == 2 and out == "" and fragment in err, err

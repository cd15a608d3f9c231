"""The benchmark's variants: each builds on a small model, agrees with eager, and leaves the model alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from graphopt.bench.harness import relative_error
from graphopt.errors import EngineError
from graphopt.bench.variants import Setup, VariantSkipped, _graphopt, select, variants
from tests.conftest import model_state, randomize_batch_norms

# the tolerance of each variant's output, relative to the output's scale
TOLERANCES = {"fp32": 1e-4, "low": 3e-2, "int8": 1e-1}
BY_KEY = {variant.key: variant for variant in variants("bf16")}


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return randomize_batch_norms(model).eval()


def setup_for(tmp_path: Path, device: str = "cpu") -> Setup:
    generator = torch.Generator().manual_seed(0)
    return Setup(small_cnn(), (torch.randn(2, 3, 16, 16, generator=generator),), torch.device(device), "bf16", tmp_path)


def test_keys_are_unique_and_every_role_is_known() -> None:
    keys = [variant.key for variant in variants("fp16")]
    assert len(keys) == len(set(keys))
    assert {variant.role for variant in variants()} == {"baseline", "graphopt", "peer", "noise"}
    assert variants()[0].role == "baseline"
    assert any("fp16" in variant.label for variant in variants("fp16"))


def test_each_engine_through_graphopt_is_paired_with_the_same_engine_used_directly() -> None:
    by_key = {variant.key: variant for variant in variants()}
    pairs = {variant.key: variant.direct for variant in by_key.values() if variant.direct is not None}
    assert pairs == {
        "graphopt-openvino": "openvino-f32", "graphopt-openvino-low": "openvino", "graphopt-ort": "ort-plain", "graphopt-inductor": "compile-freeze-cl",
        "graphopt-inductor-low": "compile-freeze-amp-cl", "graphopt-openvino-int8": "openvino-int8", "openvino-f32-again": "openvino-f32",
        "ort-plain-again": "ort-plain",
    }  # fmt: skip
    assert all(by_key[direct].role == "peer" for direct in pairs.values())
    noises = [variant for variant in by_key.values() if variant.role == "noise"]
    assert [noise.key for noise in noises] == ["ort-plain-again", "openvino-f32-again"]
    assert all(noise.precision == by_key[noise.direct].precision for noise in noises)


def openvino_native_bf16() -> bool:
    from graphopt.backends import openvino_engine

    return "BF16" in openvino_engine.core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


# torch.compile takes seconds per model even this small, and graphopt's export checks the file in onnxruntime
SLOW = {
    "compile", "compile-amp-cl", "compile-freeze-cl", "compile-freeze-amp-cl", "ort-graphopt", "graphopt-cl-fuse", "graphopt-low-cl-fuse",
    "graphopt-low-cl-graph", "graphopt-tune", "graphopt-tune-exact", "graphopt-inductor", "graphopt-inductor-low", "openvino-int8", "pt2e-int8",
}  # fmt: skip


@pytest.mark.parametrize("key", [pytest.param(key, marks=pytest.mark.slow) if key in SLOW else key for key in BY_KEY])
def test_variant_builds_runs_and_matches_eager(key: str, tmp_path: Path) -> None:
    setup = setup_for(tmp_path)
    before = model_state(setup.model)
    if key == "graphopt-openvino-low" and not openvino_native_bf16():  # OpenVINO would compute in f32: graphopt refuses it
        with pytest.raises(EngineError, match="this CPU has no native bf16 .*use precision='fp32'"):
            BY_KEY[key].build(setup)
        return
    with torch.inference_mode():
        expected = setup.model(*setup.inputs)
        output = BY_KEY[key].build(setup)()
    # tune may pick any candidate within its accuracy (3e-2), OpenVINO runs bf16 by default where the CPU has it
    precision = BY_KEY[key].precision
    assert relative_error(expected, output) < TOLERANCES["low" if precision in ("low", "auto") else precision]
    assert model_state(setup.model) == before, f"{key} changed the shared model"


def test_each_variant_declares_the_precision_it_computes_in() -> None:
    by_precision = {precision: {v.key for v in variants() if v.precision == precision} for precision in ("fp32", "low", "int8", "auto")}
    assert by_precision["auto"] == {"graphopt-tune", "graphopt-tune-exact", "openvino"}
    assert by_precision["int8"] == {
        "graphopt-int8", "graphopt-int8-1e-1", "graphopt-openvino-int8", "graphopt-ort-int8", "graphopt-tune-int8", "openvino-int8", "pt2e-int8"
    }  # fmt: skip
    assert by_precision["low"] == {key for key in BY_KEY if "amp" in key or "low" in key}
    assert sum(map(len, by_precision.values())) == len(BY_KEY)
    # graphopt's public default for each precision class: the default call, and precision=
    assert {v.class_default: v.key for v in variants() if v.class_default} == {"exact": "graphopt-default", "low": "graphopt-low", "int8": "graphopt-int8"}


def test_an_option_graphopt_does_not_accept_skips_the_variant(tmp_path: Path) -> None:
    with pytest.raises(VariantSkipped, match=r"does not accept tune_harder=, not_an_option= yet"):
        _graphopt(tune_harder=True, not_an_option=1)(setup_for(tmp_path))


def test_a_tuned_variant_notes_its_choice_and_tunes_own_time_of_it() -> None:
    from graphopt.bench.variants import _tune_note
    from graphopt.report import TuneCandidate, TuneReport

    rows = [TuneCandidate("openvino fp32", {}, "measured", seconds=0.03341), TuneCandidate("default call", {}, "measured", seconds=0.04)]
    assert _tune_note(TuneReport("openvino fp32", "fastest", rows, 1e-4)) == "chose openvino fp32, timed at 33.41 ms by tune"
    assert _tune_note(TuneReport("openvino fp32", "fastest", rows, 1e-4, cache="hit")) == "chose openvino fp32, timed at 33.41 ms by tune (remembered)"
    assert _tune_note(None) is None


def test_cpu_only_and_provider_less_variants_skip_on_cuda(tmp_path: Path) -> None:
    setup = setup_for(tmp_path, "cuda")  # nothing is moved to the device: they refuse before
    with pytest.raises(VariantSkipped, match="runs on CPU only"):
        BY_KEY["fx-ofi"].build(setup)
    for key in ("openvino", "openvino-int8"):
        with pytest.raises(VariantSkipped, match="run on CPU only"):
            BY_KEY[key].build(setup)
    with pytest.raises(VariantSkipped, match="runs on CPU only"):
        BY_KEY["pt2e-int8"].build(setup)
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(VariantSkipped, match="no CUDAExecutionProvider"):
            BY_KEY["ort-plain"].build(setup)


def test_select_keeps_the_baseline_and_matches_shell_patterns() -> None:
    available = variants()
    assert [v.key for v in select(available, ["graphopt-*"], ["*fuse", "*graph", "*tune*", "*onednn", "graphopt-openvino*", "graphopt-inductor*"])] == [
        "eager", "graphopt-default", "graphopt-low", "graphopt-cl", "graphopt-low-cl", "graphopt-ort", "graphopt-int8", "graphopt-int8-1e-1",
        "graphopt-ort-int8",
    ]  # fmt: skip
    assert [v.key for v in select(available, None, ["*"])] == ["eager"]
    assert select(available, None) == available
    with pytest.raises(ValueError, match=r"no variant matches 'tensorrt'; the variants are: eager, eager-cl"):
        select(available, ["tensorrt"])

"""The benchmark's renderings on given numbers: implausible figures flagged with their reason, distinct bar styles.

Results are built by hand (no model is run, nothing is timed), so the flags are checked on
exact figures: a matrix-multiply rate a loaded machine measures, a roofline fraction over 100%.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from graphopt.bench.results import (
    BenchResult,
    ModelResult,
    VariantResult,
    bar_styles,
    implausible_rate,
    implausible_roofline,
    to_markdown,
    write_plot,
)


def machine(fp32_gflops: float, device: str = "cpu", threads: int = 2) -> dict[str, Any]:
    return {
        "cpu": "test CPU", "cores": 2, "torch_threads": threads, "device": device, "torch": "2", "onnxruntime": "1",
        "matmul_size": 256, "matmul_gflops": {"fp32": fp32_gflops},
    }  # fmt: skip


def timed(key: str, role: str, median_ms: float) -> VariantResult:
    """A variant timed at ``median_ms`` every round, with an exact output (the fp32 class)."""
    return VariantResult(key, f"variant {key}", role, max_error=0.0, samples_ms=[median_ms] * 3, round_ratios=[1.0] * 3)


def result_of(rate_gflops: float, flops: float, **machine_fields: Any) -> BenchResult:
    """One model of ``flops`` per call, eager at 1 ms and a graphopt variant at 2 ms, on a machine of ``rate_gflops``."""
    model = ModelResult("tiny", [[2, 3, 8, 8]], flops=flops, variants=[timed("eager", "baseline", 1.0), timed("graphopt", "graphopt", 2.0)])
    return BenchResult("graphopt bench", machine(rate_gflops, **machine_fields), {"rounds": 3, "warmup": 1, "low_precision": "bf16"}, "RSS", [model])


def test_a_cpu_matmul_rate_far_below_what_a_cpu_does_is_flagged_with_the_reason() -> None:
    reason = implausible_rate(machine(1.0))  # what a loaded 2-core machine measured in issue 40
    assert reason is not None and "1.0 GFLOP/s on 2 torch thread(s)" in reason and "loaded" in reason
    assert implausible_rate(machine(60.0)) is None
    assert implausible_rate(machine(1.0, threads=1)) is not None and implausible_rate(machine(5.0, threads=1)) is None
    assert implausible_rate(machine(1.0, device="NVIDIA H200")) is None  # the floor is a CPU's


def test_a_roofline_over_100_percent_is_flagged_and_one_below_is_not() -> None:
    reason = implausible_roofline(16.55)
    assert reason is not None and "roofline 1655% is over 100%" in reason and "loaded" in reason
    assert implausible_roofline(1.0) is None and implausible_roofline(0.4) is None and implausible_roofline(None) is None


def test_implausible_figures_are_marked_in_the_json_and_the_printed_table() -> None:
    # 1.655e9 FLOP per call at 1 ms is 1655 GFLOP/s: 1655% of a 100 GFLOP/s machine for eager, 828% for graphopt
    result = result_of(100.0, 1.655e9)
    data = result.to_dict()
    eager, ours = data["models"][0]["variants"]
    assert eager["roofline_fraction"] == pytest.approx(16.55) and "roofline 1655% is over 100%" in eager["implausible"]
    assert "roofline 828% is over 100%" in ours["implausible"]
    assert data["implausible"] == [f"tiny: variant eager: {eager['implausible']}", f"tiny: variant graphopt: {ours['implausible']}"]
    markdown = to_markdown(result)
    assert "(1655% implausible) |" in markdown and "(828% implausible) |" in markdown
    assert f"> **implausible:** tiny: variant eager: {eager['implausible']}" in markdown


def test_a_low_machine_rate_is_marked_and_plausible_figures_are_not() -> None:
    loaded = result_of(1.0, 1e6)  # 1 GFLOP/s machine; the variants reach 100% and 50% of it
    data = loaded.to_dict()
    assert data["implausible"] == [f"matrix-multiply rate: {implausible_rate(loaded.machine)}"]
    assert [v["implausible"] for v in data["models"][0]["variants"]] == [None, None]
    assert "fp32 1 GFLOP/s (implausible: see below)." in to_markdown(loaded)

    quiet = result_of(100.0, 1e6)
    assert quiet.to_dict()["implausible"] == []
    assert "implausible" not in to_markdown(quiet)


def test_an_int8_variant_over_the_default_budget_is_flagged_in_the_class_table() -> None:
    def int8(key: str, role: str, median_ms: float, error: float) -> VariantResult:
        return VariantResult(key, f"variant {key}", role, max_error=error, samples_ms=[median_ms] * 3, round_ratios=[1.0] * 3, int8=True)

    variants = [timed("eager", "baseline", 4.0), int8("peer-int8", "peer", 1.0, 1.1e-1), int8("graphopt-int8", "graphopt", 2.0, 3e-2)]
    model = ModelResult("tiny", [[2, 3, 8, 8]], flops=1e6, variants=variants)
    markdown = to_markdown(BenchResult("graphopt bench", machine(100.0), {"rounds": 3, "warmup": 1, "low_precision": "bf16"}, "RSS", [model]))
    row = next(line for line in markdown.splitlines() if line.startswith("| tiny | int8 |"))
    assert "variant peer-int8 (error 1.1e-01: over the 0.05 budget)" in row
    assert "variant graphopt-int8 |" in row  # within the budget: not flagged


def test_each_engine_is_shown_used_directly_and_through_graphopt_beside_the_noise_floor() -> None:
    def paired(key: str, role: str, samples_ms: list[float], direct: str | None = None) -> VariantResult:
        return VariantResult(key, f"variant {key}", role, max_error=0.0, samples_ms=samples_ms, round_ratios=[1.0] * 3, direct=direct)

    variants = [
        timed("eager", "baseline", 4.0),
        paired("openvino-f32", "peer", [1.0, 1.2, 1.0]),
        paired("openvino-f32-again", "noise", [1.0, 1.0, 1.1], direct="openvino-f32"),
        paired("graphopt-openvino", "graphopt", [1.25, 1.5, 1.25], direct="openvino-f32"),  # 0.8x its peer every round
        paired("graphopt-ort", "graphopt", [1.0, 1.0, 1.0], direct="ort-plain"),  # its peer did not run: no row
    ]
    model = ModelResult("tiny", [[2, 3, 8, 8]], flops=1e6, variants=variants)
    assert [(ours.key, direct.key, ratio) for ours, direct, ratio in model.engine_pairs()] == [
        ("openvino-f32-again", "openvino-f32", 1.0), ("graphopt-openvino", "openvino-f32", 0.8),
    ]  # fmt: skip
    assert model.noise_floor == 1.0
    # onnxruntime's copy gives the floor where it ran (OpenVINO cannot convert ViT-B/16)
    without_openvino = [v for v in variants if "openvino" not in v.key]
    without_openvino += [paired("ort-plain", "peer", [2.0, 2.0, 2.0]), paired("ort-plain-again", "noise", [2.5, 2.5, 2.0], direct="ort-plain")]
    assert ModelResult("tiny", [[2, 3, 8, 8]], flops=1e6, variants=without_openvino).noise_floor == 0.8
    result = BenchResult("graphopt bench", machine(100.0), {"rounds": 3, "warmup": 1, "low_precision": "bf16"}, "RSS", [model])
    data = result.to_dict()["models"][0]
    assert data["noise_floor"] == 1.0 and data["direct_vs_through_graphopt"] == {"graphopt-openvino": {"direct": "openvino-f32", "ratio": 0.8}}
    markdown = to_markdown(result)
    assert "| tiny | variant openvino-f32 | variant graphopt-openvino | 0.80x | 1.00x |" in markdown
    assert "graphopt-ort |" not in markdown.split("The same engine used directly")[1].split("###")[0]


def test_a_variant_note_is_printed_beside_its_label() -> None:
    noted = VariantResult("graphopt-tune", "graphopt tuned", "graphopt", max_error=0.0, samples_ms=[1.0] * 3, round_ratios=[1.0] * 3, note="chose openvino fp32, timed at 0.98 ms by tune")
    model = ModelResult("tiny", [[2, 3, 8, 8]], flops=1e6, variants=[timed("eager", "baseline", 4.0), noted])
    markdown = to_markdown(BenchResult("graphopt bench", machine(100.0), {"rounds": 3, "warmup": 1, "low_precision": "bf16"}, "RSS", [model]))
    assert "| graphopt tuned (chose openvino fp32, timed at 0.98 ms by tune) | 1.00 ms |" in markdown


@pytest.mark.parametrize("count", [29, 250])
def test_every_bar_gets_its_own_colour_and_hatch(count: int) -> None:
    styles = bar_styles(count)
    assert len(styles) == count and len(set(styles)) == count
    assert len({colour for colour, _ in styles[:10]}) == 10  # the first ten differ by colour alone


def test_the_plot_draws_each_variant_in_its_own_style(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib comes with graphopt[bench] (installed by make test/bench)")
    from matplotlib.axes import Axes

    drawn: list[tuple[Any, Any]] = []
    real_bar = Axes.bar

    def recording_bar(self: Axes, *args: Any, **kwargs: Any) -> Any:
        drawn.append((kwargs.get("color"), kwargs.get("hatch")))
        return real_bar(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", recording_bar)
    variants = [timed("eager", "baseline", 1.0)] + [timed(f"v{index}", "peer", 1.0 + index) for index in range(28)]
    result = result_of(100.0, 1e6)
    result.models[0].variants = variants
    assert write_plot(result, tmp_path / "bench.png") is None
    assert len(drawn) == 29 and None not in {colour for colour, _ in drawn} and len(set(drawn)) == 29

"""generate() in low precision: int8 weights and bf16 on OpenVINO, held to their tolerance on the logits, a token allowed
to differ from the original's only after a tie; tune=True with an accuracy budget choosing among the precisions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import graphopt
from graphopt import generation_build, tuning
from graphopt.backends import ENGINES
from graphopt.errors import EngineError, InvalidOptionError, VerificationError
from graphopt.report import GenerationReport, Report
from tests.test_generation import original_generate, prompt, tiny

openvino = pytest.importorskip("openvino")  # installed by make test


def native_bf16() -> bool:
    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@pytest.fixture(scope="module")
def int8_gpt2() -> tuple[Any, graphopt.OptimizedModule]:
    model = tiny("gpt2")
    ids, mask = prompt(2, 6, padded=2)
    return model, graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, engine="openvino", precision="int8")


def test_int8_generation_compresses_the_weights_and_is_held_to_the_accuracy_budget(int8_gpt2: tuple[Any, graphopt.OptimizedModule]) -> None:
    model, optimized = int8_gpt2
    report = optimized.graphopt_report.generation
    assert (report.engine, report.precision, report.tolerance) == ("openvino", "int8", 5e-2)  # the default int8 budget
    assert 0 < report.max_error <= report.tolerance  # int8 weights: not exact, within the budget
    assert report.verified == ["greedy on the example prompt", "greedy on a second prompt (another batch size and length, left-padded)"]
    assert "precision='int8' applies to generate(); calls of the module compute in fp32" in optimized.graphopt_report.notes
    for runner in (optimized.generator.steps.prefill, optimized.generator.steps.decode):
        weights = [op for op in runner.model.get_ordered_ops() if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() in ("i8", "u8")]
        assert len(weights) >= 2 * 2 + 1  # each layer's attention and MLP weights, and the embedding/head
    ids, mask = prompt(1, 9, seed=5)  # a fresh prompt: the tiny model's greedy margins are wide, so no tie here
    assert torch.equal(optimized.generate(ids, mask, max_new_tokens=6), original_generate(model, ids, mask, max_new_tokens=6))
    with torch.inference_mode():
        calls, original = optimized(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(calls, original, rtol=0, atol=1e-4 * float(original.abs().max()))  # the calls stay fp32


def test_int8_generation_over_its_budget_is_refused() -> None:
    ids, mask = prompt(2, 6, padded=2)
    with pytest.raises(VerificationError, match=r"logits of step 1 differently .* over its tolerance 1.0e-03.*larger accuracy= for int8"):
        graphopt.optimize(tiny("gpt2", n_layer=1), {"input_ids": ids, "attention_mask": mask}, engine="openvino", precision="int8", accuracy=1e-3)


def test_bf16_generation_is_held_to_twice_autocasts_error_on_the_logits() -> None:
    model = tiny("llama", num_hidden_layers=1)
    ids, mask = prompt(2, 6, padded=2)
    if not native_bf16():
        with pytest.raises(EngineError, match="no native bf16"):
            graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, engine="openvino", precision="bf16")
        return
    report = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, engine="openvino", precision="bf16").graphopt_report.generation
    assert report.precision == "bf16" and report.max_error <= report.tolerance


def test_the_bf16_tolerance_is_twice_autocasts_own_logit_error_and_at_least_one_rounding() -> None:
    model = tiny("gpt2")
    ids, mask = prompt(2, 6, padded=2)
    model.generation_config.pad_token_id = 2
    allowed = generation_build.tolerance(model, "bf16", None, [("the example prompt", ids, mask)])
    with torch.inference_mode():
        exact = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1].float()
    first_step = float((exact - low).abs().max() / exact.abs().max())
    assert allowed >= max(2 * first_step, torch.finfo(torch.bfloat16).eps) > 0
    assert generation_build.tolerance(model, "int8", 3e-2, []) == 3e-2
    assert generation_build.tolerance(model, "fp32", None, []) == 1e-4


def step_logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows)


def test_a_token_may_differ_only_after_a_tie_which_is_named() -> None:
    # the original's step 2: row 0 has two logits 0.01 apart at scale 10 (a tie for a tolerance of 1e-3), row 1 does not
    expected = SimpleNamespace(
        sequences=torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3]]), logits=[step_logits([[0, 10, 0], [0, 10, 0]]), step_logits([[0, 9.99, 10], [0, 5, 10]]), step_logits([[10, 0, 0]] * 2)]
    )
    tied = torch.tensor([[5, 1, 1, 0], [5, 1, 2, 3]])  # row 0 differs from step 2 on
    ties = generation_build._ties(expected, tied, 1, "the example prompt", "int8", 1e-3)
    assert ties == ["row 0, step 2 on the example prompt (the original's top two logits 1.0e-03 apart)"]
    not_tied = torch.tensor([[5, 1, 2, 3], [5, 1, 1, 3]])  # row 1 differs at step 2, where its top two are 0.5 apart
    with pytest.raises(VerificationError, match=r"another token .* at row 1, step 2 on the example prompt, .* 5.0e-01 apart .* \(not a tie\)"):
        generation_build._ties(expected, not_tied, 1, "the example prompt", "int8", 1e-3)
    assert generation_build._ties(expected, expected.sequences, 1, "the example prompt", "int8", 1e-3) == []
    stopped_early = torch.tensor([[5, 1, 2], [5, 1, 2]])  # at an end-of-sequence token the original did not choose
    with pytest.raises(VerificationError, match="row 0, step 3"):
        generation_build._ties(expected, stopped_early, 1, "the example prompt", "int8", 1e-3)


def test_ties_are_in_the_report_and_survive_its_round_trip() -> None:
    generation = GenerationReport("openvino", "int8", 128, 1024, verified=["greedy on the example prompt"], max_error=1e-2, tolerance=5e-2, ties=["row 0, step 2 on x"])
    report = Report(mode="inference", frontend="torch.export", generation=generation)
    assert Report.from_dict(report.to_dict()).generation == generation
    lines = generation.lines()
    assert "tokens equal to the original's up to a tie" in lines[1] and "(allowed 5.0e-02)" in lines[1]
    assert lines[2] == "    a token differs from the original's after a tie: row 0, step 2 on x"


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"precision": "bf16"}, r"precision='bf16' on engine='pytorch' \(generation computes in fp32 on pytorch; fp32, bf16, int8 on openvino"),
        ({"precision": "fp16", "engine": "openvino"}, "fp16"),
        ({"precision": "int8", "engine": "openvino", "calibration": "batches"}, r"calibration= \(int8 generation compresses the weights alone"),
    ],
    ids=["bf16 on pytorch", "fp16", "calibration"],
)
def test_precisions_generation_does_not_compute_in_are_refused_saying_what_to_do(options: dict[str, Any], refused: str) -> None:
    ids, mask = prompt(1, 4)
    if options.get("calibration"):
        options = {**options, "calibration": [{"input_ids": ids, "attention_mask": mask}]}
    with pytest.raises(InvalidOptionError, match=refused):
        graphopt.optimize(tiny("gpt2"), {"input_ids": ids, "attention_mask": mask}, **options)


def test_tune_candidates_are_the_precisions_accuracy_admits_lowest_first() -> None:
    pytorch, ov = ENGINES["pytorch"], ENGINES["openvino"]
    names = lambda candidates: [(info.name, precision) for info, precision in candidates]  # noqa: E731
    assert names(tuning.generation_candidates([pytorch, ov], 1e-4)) == [("pytorch", "fp32"), ("openvino", "fp32")]
    assert names(tuning.generation_candidates([pytorch, ov], 1e-2)) == [("pytorch", "fp32"), ("openvino", "int8"), ("openvino", "fp32")]
    assert names(tuning.generation_candidates([pytorch, ov], 3e-2)) == [("pytorch", "fp32"), ("openvino", "int8"), ("openvino", "bf16"), ("openvino", "fp32")]
    assert names(tuning.generation_candidates([pytorch, ov], 3e-2, fixed="bf16")) == [("openvino", "bf16")]


def test_tune_with_an_accuracy_budget_builds_each_admitted_precision_and_keeps_one_within_it() -> None:
    model = tiny("gpt2", n_layer=1)
    ids, mask = prompt(2, 6, padded=2)
    optimized = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, tune=True, engine="openvino", accuracy=3e-2)
    rows = {row.name: row for row in optimized.graphopt_report.tune.candidates}
    assert list(rows) == ["openvino int8 generate", "openvino bf16 generate", "openvino fp32 generate"]
    assert rows["openvino int8 generate"].status == "measured" and 0 < rows["openvino int8 generate"].max_error <= 3e-2
    assert rows["openvino bf16 generate"].status == ("measured" if native_bf16() else "failed")
    winner = optimized.graphopt_report.generation
    assert (winner.engine, f"{winner.engine} {winner.precision} generate") == ("openvino", optimized.graphopt_report.tune.winner)
    ids, mask = prompt(1, 9, seed=5)
    assert torch.equal(optimized.generate(ids, mask, max_new_tokens=6), original_generate(model, ids, mask, max_new_tokens=6))


def test_a_tune_candidate_over_the_accuracy_budget_is_not_kept() -> None:
    errors = {"int8": 0.5, "fp32": 1e-7}  # as if the int8 result's logit error were over the budget tune was given

    def build(info: Any, precision: str) -> Any:
        return SimpleNamespace(report=SimpleNamespace(max_error=errors[precision], precision=precision))

    candidates = tuning.generation_candidates([ENGINES["openvino"]], 1e-2)
    generator, report = tuning.tune_generation(build, candidates, lambda generator: lambda: None, 1e-2, budget_s=5)
    rows = {row.name: row for row in report.candidates}
    assert (rows["openvino int8 generate"].status, rows["openvino int8 generate"].reason) == ("over budget", "logit error 5.0e-01 over accuracy=0.01")
    assert (report.winner, generator.report.precision, rows["openvino fp32 generate"].status) == ("openvino fp32 generate", "fp32", "measured")

"""A language model's ``generate()`` built on an engine and verified (`build`).

The captured prefill and decode graphs (`graphopt.generation`) run on the engine in the precision
asked for, and the result is checked against the original model's own ``generate()`` on the
example prompt and on a second one (another batch size and length, left-padded):

- fp32: the same greedy tokens, each step's logits within the fp32 tolerance, and the same
  sampled tokens from one seed;
- bf16: each step's logits within twice what ``torch.autocast`` in bf16 costs the original on the
  same tokens; int8 (the weights alone): within the ``accuracy`` budget. A token may differ from
  the original's only where the original's top two logits are closer than such an error can
  move them (a tie: within twice the tolerance), and the report names each tie.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from graphopt import verify as verify_outputs
from graphopt.backends import EngineInfo
from graphopt.backends.fuse_compile import compile_regions
from graphopt.backends.inductor_engine import compiled_step
from graphopt.errors import EngineError, VerificationError, VerificationWarning, error_summary, warn_at_caller
from graphopt.generation import Generator, State, Steps, neutral_config, pad_token, cache_bytes_per_token, capture_steps, on_engine, positions, prompt_of, timed_steps
from graphopt.passes import PassContext, PassInfo
from graphopt.passes.compute_in_place import compute_in_place
from graphopt.pipeline import run_passes
from graphopt.precision import DEFAULT_INT8_ACCURACY
from graphopt.report import GenerationReport
from graphopt.timing import compare_latency

VERIFY_NEW_TOKENS = 8  # greedy tokens compared with the original's generate() on each verification prompt
# the dtype each precision computes in, for the tolerance's floor (int8: the weights alone; activations stay float)
_COMPUTES_IN = {"fp32": None, "bf16": torch.bfloat16, "int8": torch.int8}
Prompt = tuple[str, torch.Tensor, torch.Tensor]  # (description, input_ids, attention_mask)
REGION_BACKENDS = ("inductor", "torchscript")  # the fuse= backends that compile pointwise regions ("graph": the whole graph)
# passes the decode graph is left out of: its values are one token per sequence, which allocating costs less than
# compute_in_place's run-time check (decode step 1.04x GPT-2, 1.05x the small Llama without it; AMD EPYC Zen 2, 2 threads)
PREFILL_ONLY = (compute_in_place,)
COMPILE_MEASURE_BUDGET_S = 1.0  # about how long the decode graph compiled is timed against its ops (`compile_decode`)


@dataclass(frozen=True)
class StepPasses:
    """graphopt's passes for the prefill and decode graphs on the PyTorch engine (`optimize`'s selection), how its
    measured kernel choices are timed, and how the decode graph is compiled after them."""

    infos: Sequence[PassInfo]
    remeasure: bool = False
    # optimize(fuse=...): None (the default) compiles the decode graph whole where it measures faster (`compile_decode`),
    # "graph" compiles it whole, a region backend compiles its pointwise regions, False compiles nothing
    fuse: str | bool | None = None


def build(
    model: nn.Module, example_inputs: Any, owned: nn.Module, engine: EngineInfo, precision: str = "fp32", accuracy: float | None = None,
    passes: StepPasses | None = None,
) -> Generator:
    """``generate()`` for ``model`` (the caller's, only read) on graphs captured from ``owned`` (graphopt's copy of it),
    on ``engine`` in ``precision`` (int8: ``accuracy`` is its budget), verified against the original's own ``generate()``;
    its `GenerationReport` says how. On the PyTorch engine the graphs go through ``passes`` first; where the result fails
    verification, the passes are rolled back (a `VerificationWarning` says why) and the graphs run as captured."""
    ids, mask = prompt_of(example_inputs)
    captured = capture_steps(owned, ids, mask)
    report = GenerationReport(engine.name, precision, captured.max_length, cache_bytes_per_token(owned))
    # verified greedy, without what the model's generation_config may add that generate() refuses (repetition_penalty)
    original = copy.deepcopy(model).eval()
    original.generation_config = neutral_config(owned.generation_config)
    vocabulary = owned.get_output_embeddings().weight.shape[0] if owned.get_output_embeddings() is not None else int(ids.max()) + 1
    prompts = [("the example prompt", ids, mask), ("a second prompt (another batch size and length, left-padded)", *second_prompt(ids, mask, vocabulary))]
    fits = [prompt for prompt in prompts if prompt[1].shape[1] + VERIFY_NEW_TOKENS <= captured.max_length]
    report.tolerance = tolerance(original, precision, accuracy, fits[:1])
    if not engine.own_passes:
        return _verified(original, on_engine(captured, engine, precision), report, fits, owned.generation_config)
    steps, report.passes = with_passes(captured, passes) if passes is not None else (captured, [])
    if passes is not None and passes.fuse in (None, "graph"):
        steps, report.compiled = compile_decode(steps, measured=passes.fuse is None)
        report.decode_compiled = steps.compiled_decode
    try:
        return _verified(original, steps, report, fits, owned.generation_config)
    except VerificationError as error:
        if not report.passes:
            raise
        warn_at_caller(
            f"graphopt rolled back its passes on the generation graphs, which failed verification: {error.reason}. generate() runs the "
            "graphs as captured; please report the model.",
            VerificationWarning,
        )
        report.passes = [f"rolled back, failing verification ({error.reason})"]
        if report.decode_compiled:
            report.compiled, report.decode_compiled = "rolled back with the passes: the decode graph runs as ops", False
        return _verified(original, as_captured(captured), report, fits, owned.generation_config)


def _verified(original: nn.Module, steps: Steps, report: GenerationReport, prompts: Sequence[Prompt], generation_config: Any) -> Generator:
    """The `Generator` on ``steps``, verified against ``original`` on ``prompts`` (`verify_generation`), its report filled."""
    precision = report.precision
    assert report.tolerance is not None
    errors, report.ties = verify_generation(original, Generator(steps, original.generation_config, report), prompts, precision, report.tolerance)
    sampling = ["seeded sampling on the example prompt"] if precision == "fp32" else []
    report.verified = [f"greedy on {description}" for description, _, _ in prompts] + sampling * bool(prompts)
    report.max_error = max(errors, default=None)
    generator = Generator(steps, generation_config, report)
    report.prefill_seconds, report.token_seconds = timed_steps(generator, *prompts[0][1:], VERIFY_NEW_TOKENS) if prompts else (0.0, 0.0)
    return generator


def with_passes(steps: Steps, passes: StepPasses) -> tuple[Steps, list[str]]:
    """``steps`` with each graph after ``passes`` (run on the step's arguments at capture), and what each pass changed.

    The passes that decide by timing the whole graph (`PassInfo.measured`) are left out: a step's graph is mostly its
    weights' matrix multiplications, which `use_onednn_linear` times one by one; the end-to-end verification of
    generate() stands for the checks `graphopt.pipeline` would run after each pass. The decode graph leaves out
    `PREFILL_ONLY`'s passes. With a region backend
    (``passes.fuse``), the decode graph's pointwise regions are compiled (`compile_regions`, the batch dynamic); the
    prefill, run once per generate() at any prompt length, keeps its ops. (`compile_decode` compiles the whole decode
    graph after these passes.)"""
    infos = [info for info in passes.infos if not info.measured]
    graphs, changed = [], []
    for name, graph, example in zip(("prefill", "decode"), (steps.prefill, steps.decode), steps.examples, strict=True):
        context = PassContext(mode="inference", example_inputs=example, measure=True, remeasure=passes.remeasure)
        regions = name == "decode" and passes.fuse in REGION_BACKENDS
        kept = [info for info in infos if (regions or info.fuse != "regions") and not (name == "decode" and info.function in PREFILL_ONLY)]
        graph, reports, _, _ = run_passes(graph, kept, context, None)
        changed += [f"{name}: {report.name} ({len(report.rewrites)} rewrite(s))" for report in reports if report.rewrites]
        if regions:
            assert isinstance(passes.fuse, str)
            fusion = compile_regions(graph, passes.fuse, example, context=torch.inference_mode, dynamic_batch=True)
            changed.append(f"{name}: {fusion.lines()[0]}")
        graphs.append(graph)
    return dataclasses.replace(steps, prefill=graphs[0], decode=graphs[1], rewritten=bool(changed)), changed


def compile_decode(steps: Steps, measured: bool) -> tuple[Steps, str]:
    """``steps`` with the decode graph compiled whole by Inductor (freezing, the C++ wrapper: `compiled_step`), and what
    the report says of it. A decode step is a few hundred small ops at one token per sequence, whose calls cost more than
    their work: compiled, they become a few loops called from C++. ``measured``: the compiled step is timed against the
    ops on the capture's decode arguments (paired rounds) and kept unless clearly slower. Where Inductor cannot compile
    it (no C++ compiler), the graph runs as ops and the line says why."""
    try:
        runner = compiled_step(steps.programs[1], steps.decode, steps.outputs)
    except EngineError as error:
        return steps, f"decode graph left as ops: Inductor could not compile it ({error_summary(error.__cause__ or error)})"
    compiled = dataclasses.replace(steps, decode=runner, compiled_decode=True)
    how = "decode graph compiled whole by Inductor (freezing, C++ wrapper)"
    if not measured:
        return compiled, f"{how}, as fuse='graph' asks"
    args = runner.inputs(steps.examples[1])
    with torch.inference_mode():  # as generate() runs the steps
        comparison = compare_latency(lambda: steps.decode(*args), lambda: runner(*args), budget_s=COMPILE_MEASURE_BUDGET_S, asks="slower")
    figures = f"{comparison.candidate_s * 1e3:.2f} ms per step against {comparison.baseline_s * 1e3:.2f} ms as ops ({comparison.ratio:.2f}x)"
    if comparison.slower:
        return steps, f"decode graph left as ops: compiled by Inductor it measured slower ({figures}); fuse='graph' compiles it anyway"
    return compiled, f"{how}: {figures}; fuse=False leaves it as ops"


def as_captured(steps: Steps) -> Steps:
    """``steps`` running torch.export's modules of its programs, as captured (after passes that failed verification)."""
    prefill, decode = (program.module() for program in steps.programs)
    return dataclasses.replace(steps, prefill=prefill, decode=decode, rewritten=False)


def tolerance(original: nn.Module, precision: str, accuracy: float | None, prompts: Sequence[Prompt]) -> float:
    """The largest logit error, relative to the logits' scale, that ``precision`` is allowed: fp32's tolerance; bf16:
    twice autocast's own error on the original's greedy steps from the first of ``prompts`` (at least one bf16
    rounding); int8: ``accuracy`` (default `DEFAULT_INT8_ACCURACY`)."""
    if precision == "int8":
        return DEFAULT_INT8_ACCURACY if accuracy is None else accuracy
    if precision == "fp32" or not prompts:
        return verify_outputs.tolerance_for(torch.float32)
    _, ids, mask = prompts[0]
    with torch.inference_mode():
        sequences = original.generate(input_ids=ids, attention_mask=mask, **_greedy(original))
        full = torch.cat([mask, torch.ones_like(sequences[:, ids.shape[1] :])], dim=1)
        inputs = {"input_ids": sequences[:, :-1], "attention_mask": full[:, :-1], "position_ids": positions(full[:, :-1]), "use_cache": False}
        exact = original(**inputs).logits[:, ids.shape[1] - 1 :].float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = original(**inputs).logits[:, ids.shape[1] - 1 :].float()
    error = max(verify_outputs.compare(exact[:, step], low[:, step]).max_error for step in range(exact.shape[1]))
    return max(verify_outputs.AUTOCAST_FACTOR * error, verify_outputs.low_precision_floor(torch.bfloat16))


def second_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocabulary: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Another batch size and prompt length than the example's, left-padded: one row more, three tokens longer, the first
    row's first three tokens padding."""
    generator = torch.Generator().manual_seed(0)
    batch, length = input_ids.shape[0] + 1, input_ids.shape[1] + 3
    ids = torch.randint(0, vocabulary, (batch, length), generator=generator, dtype=input_ids.dtype)
    ids[: input_ids.shape[0], 3:] = input_ids
    mask = torch.ones_like(ids)
    mask[: attention_mask.shape[0], 3:] = attention_mask
    mask[0, :3] = 0
    return ids, mask


def _greedy(model: Any) -> dict[str, Any]:
    pad = pad_token(model.generation_config)  # what transformers would choose, passed to spare its warning
    return {"max_new_tokens": VERIFY_NEW_TOKENS, "do_sample": False, **({"pad_token_id": pad} if pad is not None else {})}


def verify_generation(original: nn.Module, generator: Generator, prompts: Sequence[Prompt], precision: str = "fp32", tolerance: float = 1e-4) -> tuple[list[float], list[str]]:
    """Greedy generation against the original's ``generate()`` on each prompt (both with ``generator``'s generation_config,
    which ``original`` must hold too): each step's logits (given the same tokens before it) within ``tolerance``, and the
    same tokens (in low precision: except after a tie); in fp32, sampling from one seed on the first prompt gives the
    same tokens too. Else `VerificationError`; returns each prompt's largest logit error relative to the logits' scale,
    and the ties."""
    greedy = _greedy(generator)
    errors, ties = [], []
    for description, ids, mask in prompts:
        with torch.inference_mode():
            expected = original.generate(input_ids=ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **greedy)
        actual = generator.generate(ids, mask, **greedy)
        errors.append(_logits_error(generator, ids, mask, expected, description, precision, tolerance))
        if precision == "fp32" and not torch.equal(actual, expected.sequences):
            raise VerificationError(
                f"generation gives other tokens than the original model's generate() on {description}: "
                f"{actual[:, ids.shape[1]:].tolist()} instead of {expected.sequences[:, ids.shape[1]:].tolist()}. Your model is unchanged; please report it.",
                reason=f"tokens differ on {description}",
            )
        ties += _ties(expected, actual, ids.shape[1], description, precision, tolerance)
    if prompts and precision == "fp32":
        _verify_sampling(original, generator, *prompts[0][1:], greedy)
    return errors, ties


def _logits_error(generator: Generator, ids: torch.Tensor, mask: torch.Tensor, expected: Any, description: str, precision: str, tolerance: float) -> float:
    """The largest error of the captured graphs' logits, fed the original's tokens, against the original's at each step."""
    worst = 0.0
    for step, (want, got) in enumerate(zip(expected.logits, _logits_along(generator, ids, mask, expected.sequences), strict=True)):
        comparison = verify_outputs.compare(want.float(), got.float(), _COMPUTES_IN[precision], tolerance)
        if not comparison.ok:
            raise VerificationError(
                f"generation ({precision}) computes the logits of step {step + 1} differently from the original model on {description} by "
                f"{comparison.max_error:.3e} relative to their scale, over its tolerance {comparison.tolerance:.1e}: {comparison.detail}. "
                + ("Your model is unchanged; please report it." if precision == "fp32" else "Use a higher precision (precision='fp32'), or a larger accuracy= for int8."),
                max_error=comparison.max_error,
                reason=f"step {step + 1} logits differ on {description}",
            )
        worst = max(worst, comparison.max_error)
    return worst


def _ties(expected: Any, actual: torch.Tensor, prompt_length: int, description: str, precision: str, tolerance: float) -> list[str]:
    """Where each row's tokens first differ from the original's: allowed only at a tie, a step whose top two logits in
    the original are within twice ``tolerance`` of each other relative to the logits' scale (an error within the
    tolerance can swap them); `VerificationError` elsewhere."""
    ties = []
    length = min(actual.shape[1], expected.sequences.shape[1])
    for row in range(actual.shape[0]):
        differ = (actual[row, prompt_length:length] != expected.sequences[row, prompt_length:length]).nonzero()
        if actual.shape[1] != expected.sequences.shape[1] and not len(differ):
            differ = torch.tensor([[length - prompt_length]])  # one stopped at its end-of-sequence token, the other did not
        if not len(differ):
            continue
        step = int(differ[0])
        logits = expected.logits[step].float()
        top = logits[row].topk(2).values
        gap = float(top[0] - top[1]) / float(logits.abs().max().clamp_min(torch.finfo(torch.float32).tiny))
        where = f"row {row}, step {step + 1} on {description}"
        if gap > 2 * tolerance:
            raise VerificationError(
                f"generation ({precision}) chooses another token than the original model's generate() at {where}, where the original's top two "
                f"logits are {gap:.1e} apart relative to their scale: more than an error within the tolerance {tolerance:.1e} can swap (not a tie). "
                "Use a higher precision (precision='fp32'), or a larger accuracy= for int8.",
                reason=f"tokens differ on {description} beyond a tie",
            )
        ties.append(f"{where} (the original's top two logits {gap:.1e} apart)")
    return ties


def _verify_sampling(original: nn.Module, generator: Generator, ids: torch.Tensor, mask: torch.Tensor, options: dict[str, Any]) -> None:
    """Sampled tokens from one seed against the original's (its generation_config's processors, torch.multinomial on the
    global generator), else `VerificationError`; the caller's random state is left as it was."""
    sampled: list[torch.Tensor] = []
    options = {**options, "do_sample": True}
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        for generate in (lambda: original.generate(input_ids=ids, attention_mask=mask, **options), lambda: generator.generate(ids, mask, **options)):
            torch.manual_seed(0)
            sampled.append(generate())
    expected, actual = sampled
    if not torch.equal(actual, expected):
        raise VerificationError(
            f"generation samples other tokens than the original model's generate() from the same seed on the example prompt: "
            f"{actual[:, ids.shape[1]:].tolist()} instead of {expected[:, ids.shape[1]:].tolist()}. Your model is unchanged; please report it.",
            reason="sampled tokens differ on the example prompt",
        )


def _logits_along(generator: Generator, ids: torch.Tensor, mask: torch.Tensor, sequences: torch.Tensor) -> list[torch.Tensor]:
    """Each step's raw logits from the captured graphs, fed the tokens of ``sequences`` (the original's) after the prompt."""
    with torch.inference_mode():
        state = State(generator.steps, ids, mask)
        return [state.logits, *(state.advance(token) for token in sequences[:, ids.shape[1] : -1].T)]

"""Causal language models with their key/value cache: OptimizedModule.generate() gives the original's tokens, greedy
and sampled, at other prompt lengths and left-padded batches; what it does not do is refused saying what to do.

Tiny GPT-2 and Llama configs (random weights, two layers): each optimize takes seconds, so each (model, engine) pair is
built once for the module (`optimized_once`) and every test that reads such a module shares it; the generation graphs'
passes on PyTorch and OpenVINO's inputs read in place are checked here for that reason. On PyTorch the decode graph is
left as ops (``fuse=False``): the generation loop is the subject here, and compiling a tiny model's decode graph takes
longer than all its tests; tests/test_generation_compile.py runs these checks on the compiled step.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch
import torch.fx as fx
import torch.nn as nn

import graphopt
from graphopt import timing, tuning
from graphopt.backends import ENGINES
from graphopt.errors import CaptureError, InputMismatchError, InvalidInputsError, InvalidModelError, InvalidOptionError, ModeSwitchError, VerificationError, VerificationWarning
from graphopt.report import GenerationReport, Report
from tests.conftest import model_state

VOCABULARY, POSITIONS, EOS = 100, 128, 2
aten = torch.ops.aten


def tiny(kind: str, **config: Any) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        settings = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCABULARY, n_positions=POSITIONS, bos_token_id=1, eos_token_id=EOS)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**settings, **config})).eval()
    settings = dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128, vocab_size=VOCABULARY,
        max_position_embeddings=POSITIONS, bos_token_id=1, eos_token_id=EOS,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **config})).eval()


def prompt(batch: int, length: int, padded: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids avoiding EOS, the last row left-padded by ``padded`` tokens."""
    ids = torch.randint(3, VOCABULARY, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[-1, :padded] = 0
    return ids, mask


def ops(graph: fx.GraphModule) -> list[object]:
    return [node.target for node in graph.graph.nodes if node.op == "call_function"]


def original_generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, **options: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=EOS, **options)


def optimize_tiny(kind: str, engine: str) -> tuple[nn.Module, graphopt.OptimizedModule]:
    """A tiny ``kind`` model and its optimize on ``engine`` (the example prompt: a batch of 2, one row left-padded), the
    report's engine checked; optimize must leave the user's model as it was, cache on."""
    if engine == "openvino":
        pytest.importorskip("openvino")  # installed by make test
    model = tiny(kind)
    before = model_state(model)
    ids, mask = prompt(2, 6, padded=2)
    options = {"fuse": False} if engine == "pytorch" else {}  # the decode graph as ops (see the module's docstring)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, engine=engine, **options)
    assert model.config.use_cache is True and model_state(model) == before, "optimize changed the user's model"
    assert fast.graphopt_report.generation.engine == engine
    calls_elsewhere = "engine='openvino' runs generate(); calls of the module run graphopt's PyTorch graph"
    assert (calls_elsewhere in fast.graphopt_report.notes) == (engine == "openvino") and fast.graphopt_report.engine is None
    return model, fast


@pytest.fixture(scope="module")
def optimized_once() -> Callable[[str, str], tuple[nn.Module, graphopt.OptimizedModule]]:
    """`optimize_tiny` of each (model, engine) pair once for the module, at the first test that asks for it. Tests only read
    what they get; one that changes a module changes its deep copy."""
    return functools.cache(optimize_tiny)


@pytest.fixture(scope="module", params=[("gpt2", "pytorch"), ("llama", "pytorch"), ("gpt2", "openvino"), ("llama", "openvino")], ids="-".join)
def optimized(request: pytest.FixtureRequest, optimized_once: Callable[[str, str], tuple[nn.Module, graphopt.OptimizedModule]]) -> tuple[nn.Module, graphopt.OptimizedModule]:
    return optimized_once(*request.param)


def assert_threads_and_a_deep_copy_generate_the_originals_tokens(model: nn.Module, fast: graphopt.OptimizedModule, smallest_batch: int) -> None:
    """Six prompts (batches of ``smallest_batch`` and one more, some left-padded) from three threads, on ``fast`` and on
    its deep copy in turn: each gives the original's tokens."""
    copied = copy.deepcopy(fast)
    prompts = [prompt(smallest_batch + index % 2, 4 + index, padded=index % 2, seed=index) for index in range(6)]
    expected = [original_generate(model, ids, mask, max_new_tokens=6) for ids, mask in prompts]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        got = list(pool.map(lambda index: (fast if index % 2 else copied).generate(*prompts[index], max_new_tokens=6), range(len(prompts))))
    assert all(torch.equal(tokens, want) for tokens, want in zip(got, expected, strict=True))


def test_tune_has_every_engine_that_generates_among_its_candidates_or_the_engine_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidates come from the registry (`EngineInfo.generates`). Each is built as optimize(engine=...) builds it, which
    the fixtures check; here, to spare the builds, each candidate is a generator that is never run, under its engine's name."""
    built = []

    def build(model: nn.Module, example_inputs: Any, owned: nn.Module, engine: Any, precision: str = "fp32", accuracy: float | None = None, passes: Any = None) -> Any:
        built.append(engine.name)
        return graphopt.generation.Generator(None, owned.generation_config, GenerationReport(engine.name, precision, POSITIONS, 0, max_error=0.0))  # type: ignore[arg-type]

    monkeypatch.setattr(graphopt.generation_build, "build", build)
    monkeypatch.setattr(tuning, "measure_latencies", lambda runs, budget_s: timing.Ranking.of({name: [1e-3 if name.startswith("inductor") else 2e-3] * 5 for name in runs}))
    ids, mask = prompt(2, 6, padded=2)
    model = tiny("gpt2", n_layer=1)  # one layer is enough: no candidate is built, what is under test is which ones tune asks for
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, tune=True)
    assert all(info.generates for info in ENGINES.values())
    assert built == [name for name, info in ENGINES.items() if not info.missing()] and {"onnxruntime", "inductor"} <= set(built)
    assert [row.name for row in fast.graphopt_report.tune.candidates] == [f"{name} fp32 generate" for name in ENGINES]
    assert fast.graphopt_report.tune.winner == "inductor fp32 generate" and fast.graphopt_report.generation.engine == "inductor"
    del built[:]
    pinned = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, tune=True, engine="onnxruntime")  # an engine given is kept
    assert built == ["onnxruntime"] and [row.name for row in pinned.graphopt_report.tune.candidates] == ["onnxruntime fp32 generate"]


@pytest.mark.parametrize("batch, length, padded", [(1, 5, 0), (1, 11, 0), (2, 7, 3), (3, 1, 0)])
def test_greedy_tokens_equal_the_originals_at_other_lengths_and_left_padded_batches(optimized: Any, batch: int, length: int, padded: int) -> None:
    model, fast = optimized
    ids, mask = prompt(batch, length, padded, seed=length)
    tokens = fast.generate(ids, mask, max_new_tokens=12)
    assert torch.equal(tokens, original_generate(model, ids, mask, max_new_tokens=12))
    assert tokens.shape == (batch, length + 12)


@pytest.mark.parametrize("options", [{"temperature": 0.8, "top_k": 20, "top_p": 0.9}, {}, {"top_k": 0, "temperature": 1.5}])
def test_sampling_with_a_seed_gives_the_originals_tokens(optimized: Any, options: dict[str, Any]) -> None:
    model, fast = optimized
    ids, mask = prompt(2, 6, padded=1)
    for seed in (0, 1):
        torch.manual_seed(seed)
        tokens = fast.generate(ids, mask, max_new_tokens=10, do_sample=True, **options)
        torch.manual_seed(seed)
        assert torch.equal(tokens, original_generate(model, ids, mask, max_new_tokens=10, do_sample=True, **options))


def test_eos_ends_a_sequence_and_min_new_tokens_holds_it_off_as_in_transformers(optimized: Any) -> None:
    model, fast = optimized
    ids, mask = prompt(2, 6, padded=2)
    greedy = original_generate(model, ids, mask, max_new_tokens=12, eos_token_id=None)
    eos = int(greedy[0, 6 + 3])  # the first row's fourth new token: it ends there, the other row may go on
    for options in ({"eos_token_id": eos}, {"eos_token_id": eos, "min_new_tokens": 6}, {"eos_token_id": [eos, 7], "pad_token_id": 0}):
        assert options["eos_token_id"] != EOS
        with torch.inference_mode():  # no pad_token_id: transformers pads with the (first) eos token, as generate() must
            expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **options)
        assert torch.equal(fast.generate(ids, mask, max_new_tokens=12, **options), expected), options


def test_calling_the_module_still_returns_the_models_logits(optimized_once: Callable[[str, str], Any]) -> None:
    model, fast = optimized_once("llama", "pytorch")  # the user's model left as it was: optimize_tiny checks it
    other_ids, other_mask = prompt(3, 9, padded=4)
    with torch.inference_mode():
        expected = model(input_ids=other_ids, attention_mask=other_mask, use_cache=False)
    out = fast(input_ids=other_ids, attention_mask=other_mask)
    assert type(out) is type(expected)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)


def test_the_report_says_how_generation_runs_and_was_verified(optimized: Any) -> None:
    model, fast = optimized
    report = fast.graphopt_report.generation
    config = model.config
    layers, heads = getattr(config, "n_layer", None) or config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or config.n_head
    assert (report.max_length, report.cache_bytes_per_token) == (POSITIONS, 2 * layers * heads * 16 * 4)  # head size 64 / 4 heads, fp32
    assert report.verified == [
        "greedy on the example prompt", "greedy on a second prompt (another batch size and length, left-padded)", "seeded sampling on the example prompt",
    ]  # fmt: skip
    assert report.max_error is not None and report.max_error < 1e-4
    text = str(fast.graphopt_report)
    assert f"up to {POSITIONS} positions" in text and "ms per new token" in text and "tokens equal to the original's: greedy on the example prompt" in text
    assert Report.from_dict(fast.graphopt_report.to_dict()).generation == report


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda fast, ids, mask: fast.generate(ids, mask, num_beams=2), InvalidOptionError, r"num_beams=2: beam search is not supported; use num_beams=1"),
        (lambda fast, ids, mask: fast.generate(ids, mask, repetition_penalty=1.3), InvalidOptionError, r"takes max_new_tokens, .* not repetition_penalty"),
        (lambda fast, ids, mask: fast.generate(ids, mask, max_new_tokens=POSITIONS), InputMismatchError, r"plus max_new_tokens=128 is 134 positions, beyond the model's 128"),
        (lambda fast, ids, mask: fast.generate(ids, torch.flip(mask, [1])), InvalidInputsError, r"ends in a 0: pad prompts on the left"),
        (lambda fast, ids, mask: fast.generate(ids.float(), mask), InvalidInputsError, r"generate\(\) takes input_ids, a tensor of token ids"),
        (lambda fast, ids, mask: fast.generate(ids, mask, do_sample=True, top_p=-0.5), InvalidOptionError, r"generate\(\): .*top_p"),
    ],
    ids=["beam search", "another option", "beyond the position limit", "right padding", "float ids", "a value out of range"],
)
def test_what_generate_does_not_take_is_refused_saying_what_to_do(optimized: Any, call: Any, error: type[Exception], message: str) -> None:
    _, fast = optimized
    ids, mask = prompt(2, 6, padded=2)
    with pytest.raises(error, match=message):
        call(fast, ids, mask)


def test_a_generation_config_setting_it_does_not_apply_is_refused() -> None:
    model = tiny("gpt2", n_layer=1)  # one layer is enough: what is under test is the refusal of the config's setting
    model.generation_config.repetition_penalty = 1.2
    ids, mask = prompt(1, 6)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, fuse=False)  # verified greedy, which it also sets; not compiled
    with pytest.raises(InvalidOptionError, match=r"generation_config sets repetition_penalty, which generate\(\) of an optimized model does not apply"):
        fast.generate(ids, mask)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"engine": "onnxruntime"}, r"does not take engine='onnxruntime' \(generation runs on engine='pytorch', 'openvino' or 'inductor' so far\)"),
        ({"precision": "bf16"}, r"does not take precision='bf16' on engine='pytorch' \(generation computes in fp32 on pytorch; "),
        ({"mode": "training"}, r"generates with its key/value cache, which is for inference: call model.eval\(\)"),
    ],
)
def test_options_generation_does_not_take_yet_are_refused_before_anything_runs(monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], message: str) -> None:
    if options.get("engine") == "onnxruntime":
        pytest.importorskip("onnxruntime")  # installed by make test
        # every engine generates today: one that does not (an engine without run_program) is refused, naming those that do
        monkeypatch.setitem(ENGINES, "onnxruntime", dataclasses.replace(ENGINES["onnxruntime"], run_program=None))
    ids, mask = prompt(1, 6)
    with pytest.raises(InvalidOptionError, match=message + r".*model.config.use_cache = False|" + message):
        graphopt.optimize(tiny("gpt2"), {"input_ids": ids, "attention_mask": mask}, **options)


def test_a_sliding_window_cache_is_refused_with_the_fix() -> None:
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128, vocab_size=VOCABULARY,
        max_position_embeddings=POSITIONS, sliding_window=16,
    )  # fmt: skip
    ids, mask = prompt(1, 6)
    with pytest.raises(InvalidModelError, match=r"MistralForCausalLM uses sliding-window attention \(sliding_window=16\).*Set model.config.use_cache = False"):
        graphopt.optimize(transformers.MistralForCausalLM(config).eval(), {"input_ids": ids, "attention_mask": mask})


def test_example_inputs_without_token_ids_are_refused_with_the_form_to_use() -> None:
    with pytest.raises(InvalidInputsError, match=r"a causal language model's example inputs are \{'input_ids': ids, 'attention_mask': mask\}"):
        graphopt.generation.prompt_of({"inputs_embeds": torch.randn(1, 4, 64)})


def test_a_model_without_its_cache_keeps_todays_behaviour_and_has_no_generate() -> None:
    model = tiny("gpt2", use_cache=False)
    ids, mask = prompt(2, 6, padded=2)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask})
    assert fast.graphopt_report.generation is None and "generation:" not in str(fast.graphopt_report)
    with pytest.raises(InvalidOptionError, match=r"generate\(\) is for a causal language model optimized with its key/value cache on"):
        fast.generate(ids, mask)


def test_a_capture_that_fails_becomes_a_capture_error_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Could not guard on data-dependent expression")

    monkeypatch.setattr(torch.export, "export", refuse)
    model = tiny("gpt2")
    ids, mask = prompt(1, 6)
    with pytest.raises(CaptureError, match=r"could not capture GPT2LMHeadModel's generation step .*Set model.config.use_cache = False"):
        graphopt.generation.capture_steps(model, ids, mask)


def test_new_weights_or_another_device_are_refused_where_generate_would_not_see_them(optimized: Any) -> None:
    model, fast = optimized
    with pytest.raises(ModeSwitchError, match=r"this module's generate\(\) runs graphs with their own copy of the weights"):
        fast.load_state_dict(fast.state_dict())
    with pytest.raises(ModeSwitchError, match=r"\.to\(meta\): this module's generate\(\)"):
        fast.to("meta")


def test_threads_and_a_deep_copy_generate_the_originals_tokens(optimized: Any) -> None:
    """A server's threads share one optimized model: each generate() keeps its own cache (and OpenVINO request)."""
    assert_threads_and_a_deep_copy_generate_the_originals_tokens(*optimized, smallest_batch=1)


def test_on_the_pytorch_engine_both_graphs_go_through_graphopts_passes_unless_passes_are_turned_off(optimized_once: Callable[[str, str], Any]) -> None:
    model, fast = optimized_once("gpt2", "pytorch")  # with dropout (Llama has none)
    ids, mask = prompt(2, 6, padded=2)
    report = fast.graphopt_report.generation
    names = {entry.split(" (")[0] for entry in report.passes}
    assert {"prefill: remove_redundant_transfers", "decode: remove_redundant_transfers", "prefill: compute_in_place", "decode: remove_dropout"} <= names
    assert "decode: compute_in_place" not in names  # one token's values: allocating costs less than the run-time check
    assert aten.dropout.default not in ops(fast.generator.steps.graphs[1])  # the decode graph
    assert "graphopt's passes on the graphs: prefill: " in str(fast.graphopt_report)
    plain = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, passes=[], fuse=False)
    assert plain.graphopt_report.generation.passes == [] and aten.dropout.default in ops(plain.generator.steps.graphs[1])
    for optimized in (fast, plain):
        assert torch.equal(optimized.generate(ids, mask, max_new_tokens=5, pad_token_id=EOS), original_generate(model, ids, mask, max_new_tokens=5))


def test_openvino_reads_a_generation_steps_inputs_in_place_each_made_contiguous(optimized_once: Callable[[str, str], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, shared = optimized_once("llama", "openvino")
    fast = copy.deepcopy(shared)  # its runners spied on, the shared module's left as they are
    calls: list[tuple[bool, list[bool]]] = []
    for runner in (fast.generator.steps.prefill, fast.generator.steps.decode):
        request = runner.infer_request(runner.other_sizes_compiled)

        class Spy:
            def infer(self, arrays: list, share_inputs: bool, request=request) -> object:  # type: ignore[no-untyped-def]
                calls.append((share_inputs, [array.flags["C_CONTIGUOUS"] for array in arrays]))
                return request.infer(arrays, share_inputs=share_inputs)

        monkeypatch.setattr(runner, "infer_request", lambda compiled, spy=Spy(): spy)
    ids, mask = prompt(2, 6, padded=2)
    tokens = fast.generate(ids, mask, max_new_tokens=4, pad_token_id=EOS)
    assert torch.equal(tokens, original_generate(model, ids, mask, max_new_tokens=4))
    assert len(calls) == 4 and all(shared and all(contiguous) for shared, contiguous in calls)


@pytest.mark.slow  # builds and verifies generation on both engines
def test_tune_generates_on_the_engine_that_generates_fastest_with_the_originals_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("openvino")  # installed by make test
    timed: list[list[str]] = []

    def fake_timer(runs: dict[str, Any], budget_s: float) -> Any:
        timed.append(sorted(runs))
        for run in runs.values():
            run()  # each candidate generates, as timing would
        return timing.Ranking.of({name: [2e-3 if name.startswith("openvino") else 3e-3] * 5 for name in runs})

    monkeypatch.setattr(tuning, "measure_latencies", fake_timer)
    for name in ("onnxruntime", "inductor"):  # two real builds timed here; the others' builds are the on_engine fixture's
        monkeypatch.setitem(ENGINES, name, dataclasses.replace(ENGINES[name], run_program=None))
    model = tiny("gpt2", n_layer=1)  # one layer is enough: what is under test is which build tune keeps
    ids, mask = prompt(2, 6, padded=2)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, tune=True, fuse=False)  # kept: the decode graph not compiled
    report = fast.graphopt_report
    assert timed == [["openvino fp32 generate", "pytorch fp32 generate"]]
    assert report.tune.winner == "openvino fp32 generate" and report.generation.engine == "openvino"
    assert {row.name: row.status for row in report.tune.candidates} == {"pytorch fp32 generate": "measured", "openvino fp32 generate": "measured"}
    assert "per new token, 16 decode steps in" in report.tune.why and "fp32, the original's greedy tokens" in report.tune.why
    other_ids, other_mask = prompt(3, 9, padded=4)
    assert torch.equal(fast.generate(other_ids, other_mask, max_new_tokens=8), original_generate(model, other_ids, other_mask, max_new_tokens=8))


def test_the_reports_times_are_the_prefill_and_the_median_decode_step(optimized: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from graphopt.generation.clock, replaced here by one whose readings are known: no test times anything."""
    _, fast = optimized
    readings = iter([0.0, 0.5, *[value for step, seconds in enumerate([3.0, 1.0, 2.0]) for value in (10.0 * step, 10.0 * step + seconds)]])
    monkeypatch.setattr(graphopt.generation, "clock", lambda: next(readings))
    ids, mask = prompt(2, 6, padded=2)
    assert graphopt.generation.timed_steps(fast.generator, ids, mask, new_tokens=3) == (0.5, 2.0)  # decode steps of 3, 1 and 2 s


def test_sampling_that_differs_from_the_originals_with_the_same_seed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = graphopt.generation._processors

    def colder(config: Any, prompt_length: int, eos: list[int]) -> Any:  # as if generate() sampled at another temperature
        processors = real(config, prompt_length, eos)
        if config.do_sample:  # a low one: the tiny model's random logits are so flat that a higher one samples the same tokens
            processors.append(transformers.generation.logits_process.TemperatureLogitsWarper(0.05))
        return processors

    monkeypatch.setattr(graphopt.generation, "_processors", colder)
    ids, mask = prompt(2, 6, padded=2)
    model = tiny("gpt2")  # seeds torch's generator itself
    state = torch.random.get_rng_state()
    # greedy agrees: only sampling differs, with graphopt's passes (rolled back, with a warning) and without them
    with pytest.raises(VerificationError, match=r"samples other tokens than the original model's generate\(\) from the same seed"):
        with pytest.warns(VerificationWarning, match="rolled back its passes on the generation graphs"):
            graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, fuse=False)  # the decode graph not compiled: sooner
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left as it was


@pytest.mark.skipif(graphopt.generation._openmp() is None, reason="torch's OpenMP runtime is reachable on Linux only; elsewhere the block changes nothing")
def test_the_logits_processors_run_on_the_generating_thread_alone_other_threads_keeping_their_count(
    optimized_once: Callable[[str, str], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between steps torch's OpenMP threads would spin on the cores an engine's own threads run the next step on
    (`graphopt.generation.on_this_thread_alone`): the processors and the token's choice run on one thread, and neither
    the thread count of another thread nor that of a thread starting torch meanwhile changes; a thread whose first torch
    call is in the block keeps torch's count after it (not OpenMP's default, one per core)."""
    model, fast = optimized_once("gpt2", "openvino")
    real, counts = graphopt.generation._processors, []

    def counted(config: Any, prompt_length: int, eos: list[int]) -> Any:
        processors = real(config, prompt_length, eos)
        return lambda ids, scores: counts.append(torch.get_num_threads()) or processors(ids, scores)

    monkeypatch.setattr(graphopt.generation, "_processors", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids, mask = prompt(2, 6, padded=2)
        assert torch.equal(fast.generate(ids, mask, max_new_tokens=4, min_new_tokens=2), original_generate(model, ids, mask, max_new_tokens=4, min_new_tokens=2))
        assert counts == [1, 1, 1, 1] and torch.get_num_threads() == 2
        with concurrent.futures.ThreadPoolExecutor(1) as started, concurrent.futures.ThreadPoolExecutor(1) as fresh:
            started.submit(torch.get_num_threads).result()  # torch set up on that thread
            with graphopt.generation.on_this_thread_alone():
                assert torch.get_num_threads() == 1
                assert started.submit(torch.get_num_threads).result() == 2
                assert fresh.submit(torch.get_num_threads).result() == 2  # its first torch call
            assert torch.get_num_threads() == 2
        torch.set_num_threads(cores := (os.cpu_count() or 1) + 1)  # other than OpenMP's default

        def first_call_in_the_block() -> tuple[int, int]:
            with graphopt.generation.on_this_thread_alone():
                inside = torch.get_num_threads()
            return inside, torch.get_num_threads()

        with concurrent.futures.ThreadPoolExecutor(1) as fresh:
            assert fresh.submit(first_call_in_the_block).result() == (1, cores)
    finally:
        torch.set_num_threads(threads)

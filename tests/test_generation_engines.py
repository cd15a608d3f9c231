"""generate() on the engines outside PyTorch and OpenVINO (onnxruntime, Inductor): tokens equal to the original's, greedy
and sampled, from threads and a deep copy, compiled once, and the engines' tool errors as EngineError. Kept apart from
tests/test_generation.py so that the suite's workers (one test file each) share the builds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.backends import ENGINES
from graphopt.errors import EngineError, InputMismatchError
from tests.test_generation import POSITIONS, assert_threads_and_a_deep_copy_generate_the_originals_tokens, original_generate, prompt, tiny
from tests.test_generation_compile import compiled_code_or_an_error


@pytest.fixture(
    scope="module",
    params=[pytest.param(pair, marks=[pytest.mark.slow] if ENGINES[pair[1]].compiles else []) for pair in [("gpt2", "onnxruntime"), ("llama", "inductor")]],
    ids="-".join,
)
def on_engine(request: pytest.FixtureRequest) -> tuple[nn.Module, graphopt.OptimizedModule]:
    """generate() on the engines the `optimized` fixture leaves out, one model each (Inductor, which compiles for tens of
    seconds, marked slow as in test_engines, on a Llama of one layer: its compile time grows with the graph)."""
    kind, engine = request.param
    if ENGINES[engine].missing():
        pytest.skip(ENGINES[engine].missing())
    model = tiny(kind, **({"num_hidden_layers": 1} if ENGINES[engine].compiles else {}))
    ids, mask = prompt(2, 6, padded=2)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, engine=engine)
    report = fast.graphopt_report
    assert report.generation.engine == engine and report.engine is None and report.generation.max_error < 1e-4
    assert f"engine={engine!r} runs generate(); calls of the module run graphopt's PyTorch graph" in report.notes
    return model, fast


def test_onnxruntime_and_inductor_generate_the_originals_tokens_greedy_and_sampled(on_engine: Any) -> None:
    model, fast = on_engine
    for batch, length, padded in [(3, 4, 0), (2, 11, 3)]:  # two prompt lengths, a left-padded batch of 2
        ids, mask = prompt(batch, length, padded, seed=length)
        assert torch.equal(fast.generate(ids, mask, max_new_tokens=12), original_generate(model, ids, mask, max_new_tokens=12))
    ids, mask = prompt(2, 6, padded=1)
    torch.manual_seed(0)
    tokens = fast.generate(ids, mask, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20)
    torch.manual_seed(0)
    assert torch.equal(tokens, original_generate(model, ids, mask, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20))
    with pytest.raises(InputMismatchError, match=r"plus max_new_tokens=128 is 134 positions, beyond the model's 128"):
        fast.generate(ids, mask, max_new_tokens=POSITIONS)


def test_onnxruntime_and_inductor_generate_the_originals_tokens_from_threads_and_a_deep_copy(on_engine: Any) -> None:
    """A server's threads share one optimized model and its copies (batches of 2 and 3: Inductor's compiled sizes)."""
    assert_threads_and_a_deep_copy_generate_the_originals_tokens(*on_engine, smallest_batch=2)


def test_no_engine_compiles_again_for_another_batch_or_length(on_engine: Any) -> None:
    """Inductor's compiled code runs every step at a new cache length, prompt length or batch size (one included,
    compiled apart), nothing compiled again nor run as ops; onnxruntime runs its sessions' dynamic shapes."""
    model, fast = on_engine
    with compiled_code_or_an_error(fast):
        for batch, length, padded in [(1, 3, 0), (2, 3, 1), (4, 17, 5)]:
            ids, mask = prompt(batch, length, padded, seed=length)
            assert torch.equal(fast.generate(ids, mask, max_new_tokens=9), original_generate(model, ids, mask, max_new_tokens=9))


@pytest.fixture(scope="module")
def gpt2_steps() -> graphopt.generation.Steps:
    """A tiny GPT-2's generation steps, captured once for the module: each engine's tool fails on its prefill below."""
    ids, mask = prompt(2, 6, padded=2)
    return graphopt.generation.capture_steps(tiny("gpt2"), ids, mask)


def _fail(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("unsupported op aten.made_up")


@pytest.mark.parametrize(
    "engine, break_tool, message",
    [
        ("onnxruntime", lambda patch: patch.setattr(torch.onnx, "export", _fail), r"engine='onnxruntime': torch.onnx.export could not export the generation step \(RuntimeError: unsupported op"),
        # torch.compile's result fails at its first call, where Inductor compiles
        ("inductor", lambda patch: patch.setattr(torch, "compile", lambda module, **options: _fail), r"engine='inductor' could not compile the generation step \(RuntimeError: unsupported op.*\): use another engine"),
    ],
)
def test_an_engine_tool_that_fails_on_a_generation_step_raises_engine_error(
    monkeypatch: pytest.MonkeyPatch, engine: str, break_tool: Any, message: str, gpt2_steps: graphopt.generation.Steps
) -> None:
    if ENGINES[engine].missing():
        pytest.skip(ENGINES[engine].missing())
    break_tool(monkeypatch)
    with pytest.raises(EngineError, match=message):
        ENGINES[engine].make_program_runner(gpt2_steps.programs[0], "fp32", gpt2_steps.outputs)

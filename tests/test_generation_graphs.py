"""The graphs generate() runs: GPT-2's Conv1D captured as linears, the prefill's head on the last position only, the
prompt's attention with no query left attending to nothing, and graphopt's passes on the PyTorch engine (rolled back
where they fail verification). Tiny GPT-2 and Llama configs, random weights. The passes optimize applies and OpenVINO's
inputs read in place are checked in tests/test_generation.py, on the modules its tests build."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import os
from collections.abc import Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch
import torch.fx as fx
import torch.nn as nn
from transformers.pytorch_utils import Conv1D

import graphopt
from graphopt import generation, generation_build
from graphopt.backends import ENGINES
from graphopt.errors import VerificationWarning
from graphopt.passes import PassContext, PassInfo, PassResult
from graphopt.report import GenerationReport, PassReport
from tests.conftest import measured_as
from tests.test_generation import EOS, original_generate, ops, prompt, tiny

aten = torch.ops.aten


@pytest.fixture(scope="module")
def captured() -> Callable[[str], tuple[nn.Module, generation.Steps]]:
    """A tiny model of each kind and the generation graphs captured from its copy (the example prompt: a batch of 2, one
    row left-padded), once for the module at the first test that asks; tests only read them."""

    def capture(kind: str) -> tuple[nn.Module, generation.Steps]:
        model = tiny(kind)
        return model, generation.capture_steps(copy.deepcopy(model), *prompt(2, 6, padded=2))

    return functools.cache(capture)


def test_gpt2s_conv1d_layers_are_captured_as_the_linears_they_compute_and_the_users_model_keeps_them(captured: Callable[[str], tuple[nn.Module, generation.Steps]]) -> None:
    model, steps = captured("gpt2")
    ids, mask = prompt(2, 6, padded=2)
    for graph in (steps.prefill, steps.decode):
        assert aten.addmm.default not in ops(graph)
        assert ops(graph).count(aten.linear.default) == 2 * 4 + 1  # per layer: attention in and out, MLP up and down; the head
    assert type(model.transformer.h[0].attn.c_attn) is Conv1D
    with torch.inference_mode():
        logits = steps.prefill(ids, mask, generation.positions(mask))[0]
        expected = model(input_ids=ids, attention_mask=mask, position_ids=generation.positions(mask)).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_prefill_computes_the_head_on_the_last_position_only(kind: str, captured: Callable[[str], tuple[nn.Module, generation.Steps]]) -> None:
    model, steps = captured(kind)
    head = model.get_output_embeddings().weight
    (linear,) = [node for node in steps.prefill.graph.nodes if node.target is aten.linear.default and node.args[1].meta["val"].shape == head.shape]
    assert linear.args[0].meta["val"].shape[1] == 1  # (batch, 1 position, width), whatever the prompt's length


def test_a_pad_token_attends_to_itself_only_so_that_no_query_attends_to_nothing() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    attention = generation._prompt_attention(mask)
    assert attention.shape == (2, 1, 4, 4) and attention.dtype == torch.bool
    expected_padded = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(attention[0, 0], expected_padded)
    assert torch.equal(attention[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def _scale_the_first_linear(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """A broken pass: the first linear's output times 1.5."""
    linear = next(node for node in gm.graph.nodes if node.target is aten.linear.default)
    with gm.graph.inserting_after(linear):
        scaled = gm.graph.call_function(aten.mul.Tensor, (linear, 1.5))
    linear.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    gm.recompile()
    report = PassReport("scale_the_first_linear")
    report.rewrite(scaled, "times 1.5")
    return PassResult(gm, True, report)


def test_passes_that_break_the_graphs_are_rolled_back_with_a_warning_and_the_graphs_run_as_captured() -> None:
    model = tiny("llama", num_hidden_layers=1)  # one layer is enough: the broken pass scales the first linear
    ids, mask = prompt(2, 6, padded=2)
    broken = PassInfo("scale_the_first_linear", _scale_the_first_linear, ("inference",), "a broken pass")
    with pytest.warns(VerificationWarning, match="rolled back its passes on the generation graphs, which failed verification: step 1 logits differ"):
        generator = generation_build.build(
            model, {"input_ids": ids, "attention_mask": mask}, copy.deepcopy(model), ENGINES["pytorch"], passes=generation_build.StepPasses([broken], fuse=False)
        )  # the decode graph not compiled (a compiled one rolled back: tests/test_generation_compile.py)
    assert generator.report.passes == ["rolled back, failing verification (step 1 logits differ on the example prompt)"]
    assert not [node for node in generator.steps.decode.graph.nodes if node.target is aten.mul.Tensor and node.args[1] == 1.5]
    assert torch.equal(generator.generate(ids, mask, max_new_tokens=5, pad_token_id=EOS), original_generate(model, ids, mask, max_new_tokens=5))


def test_tune_times_decode_steps_after_one_prefill_made_at_the_first_call(captured: Callable[[str], tuple[nn.Module, generation.Steps]]) -> None:
    model, steps = captured("llama")
    ids, mask = prompt(1, 5)
    calls = {"prefill": 0, "decode": 0}

    def counted(name: str, step: object) -> object:
        def run(*args: object) -> object:
            calls[name] += 1
            return step(*args)  # type: ignore[operator]

        return run

    counting = dataclasses.replace(steps, prefill=counted("prefill", steps.prefill), decode=counted("decode", steps.decode))
    decode = generation.decoding(generation.Generator(counting, model.generation_config, GenerationReport("pytorch", "fp32", 128, 0)), ids, mask, 3)
    first, second = decode(), decode()
    assert calls == {"prefill": 1, "decode": 6}
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # the prefilled state is reused as it was
    with torch.inference_mode():
        state = generation.State(steps, ids, mask)
        for _ in range(3):
            state.advance(state.logits.argmax(-1))
    torch.testing.assert_close(first, state.logits, rtol=0, atol=0)


def test_large_linears_of_the_generation_graphs_run_on_onednn_where_timed_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPT-2 one layer deep and 1024 wide: its linears are large enough for use_onednn_linear (a stub timer says oneDNN
    is faster), and generate() still gives the original's tokens."""
    linear_pass = importlib.import_module("graphopt.passes.use_onednn_linear")
    monkeypatch.setattr(linear_pass, "compare_latency", lambda aten, onednn, budget_s, asks: measured_as(2.0, 1.0))
    model = tiny("gpt2", n_layer=1, n_embd=1024, n_head=16)
    ids, mask = prompt(2, 6, padded=2)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, fuse=False)  # the graphs' kernels, not compiled
    kernels = (torch.ops.mkldnn._linear_pointwise.default, torch.ops.graphopt.linear_add.default)
    for graph in (fast.generator.steps.prefill, fast.generator.steps.decode):
        assert sum(target in kernels for target in ops(graph)) == 4  # attention in and out, MLP up and down; the 100-row head is small
    assert "decode: use_onednn_linear (4 rewrite(s))" in fast.graphopt_report.generation.passes
    other_ids, other_mask = prompt(3, 9, padded=4, seed=7)
    assert torch.equal(fast.generate(other_ids, other_mask, max_new_tokens=6), original_generate(model, other_ids, other_mask, max_new_tokens=6))

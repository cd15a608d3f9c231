"""generate()'s decode graph on the PyTorch engine compiled whole by Inductor after graphopt's passes
(`graphopt.generation_build.compile_decode`): by default where it is not measured slower, with fuse="graph" always,
never with fuse=False; a compile that fails leaves the graph as ops, saying why; the compiled step compiles nothing more
for other batch sizes and lengths; a loaded file compiles it again.

One real default build of a tiny Llama is shared by the tests that read it (each compile takes seconds); the choices
are tested on a stub compiler and a stub timer. tests/test_generation.py checks the generation loop on the decode graph
as ops (other lengths, batches, sampling options, eos); the compiled step's tokens are checked here (other batches and
lengths, seeded sampling, threads and a deep copy), and in a fresh process by tests/test_generation_saving.py.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import graphopt
from graphopt import generation, generation_archive, generation_build
from graphopt.backends import ENGINES, inductor_engine
from graphopt.backends.inductor_engine import InductorStepRunner
from graphopt.errors import CompileWarning, EngineError, InvalidOptionError, VerificationWarning
from graphopt.passes import PassInfo
from tests.conftest import measured_as
from tests.test_generation import EOS, assert_threads_and_a_deep_copy_generate_the_originals_tokens, original_generate, prompt, tiny

ONEDNN_LINEARS = ("mkldnn._linear_pointwise.default", "graphopt.linear_add.default")


@contextlib.contextmanager
def compiled_code_or_an_error(fast: graphopt.OptimizedModule) -> Iterator[None]:
    """Each compiled step of ``fast`` called through its compiling function under ``fail_on_recompile``: a call that the
    compiled code's guards reject raises, where the runner's own call (`torch._dynamo.run`) would quietly run it as ops."""
    steps = fast.generator.steps
    with pytest.MonkeyPatch.context() as patch, torch.compiler.set_stance("fail_on_recompile"):
        for runner in (steps.prefill, steps.decode):
            if isinstance(runner, InductorStepRunner):
                patch.setitem(runner.__dict__, "compiled_only", runner.compiled)
        yield


@pytest.fixture(scope="module")
def compiled() -> tuple[nn.Module, graphopt.OptimizedModule]:
    """A tiny Llama (one layer) and its default optimize, every linear on oneDNN (as on a language model's sizes: a stub timer and a
    lowered size threshold), which Inductor's freezing must hand the weights to as constants."""
    model = tiny("llama", num_hidden_layers=1)
    ids, mask = prompt(2, 6, padded=2)
    with pytest.MonkeyPatch.context() as patch:
        linear_pass = importlib.import_module("graphopt.passes.use_onednn_linear")  # the module (graphopt.passes names the function)
        patch.setattr(linear_pass, "MIN_WEIGHT_ELEMENTS", 1)
        patch.setattr(linear_pass, "compare_latency", lambda aten, onednn, budget_s, asks: measured_as(2.0, 1.0))
        patch.setattr(generation_build, "compare_latency", lambda ops, step, budget_s, asks: measured_as(1.0, 1.0))  # a tie keeps it compiled
        return model, graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask})


def test_the_default_compiles_the_decode_graph_after_graphopts_passes_and_says_so(compiled: Any) -> None:
    _, fast = compiled
    steps, report = fast.generator.steps, fast.graphopt_report.generation
    assert steps.compiled_decode and isinstance(steps.decode, InductorStepRunner) and report.decode_compiled
    assert isinstance(steps.prefill, torch.fx.GraphModule)  # run once per generate(), at any prompt length: kept as ops
    _, decode = steps.graphs
    linears = sum(node.target is torch.ops.aten.linear.default for node in steps.programs[1].graph.nodes)  # 7 in its layer, the head
    assert decode is steps.decode.graph and sum(str(node.target) in ONEDNN_LINEARS for node in decode.graph.nodes) == linears == 8
    # graphopt's linear_add (a Python op: compiled code would call back into Python) compiled as oneDNN's linear and an add
    adds = sum(str(node.target) == ONEDNN_LINEARS[1] for node in decode.graph.nodes)
    compiled_graph = steps.decode.compiled._orig_mod
    assert compiled_graph is not decode and adds == 2  # the layer's two residual connections
    assert [str(node.target) for node in compiled_graph.graph.nodes].count(ONEDNN_LINEARS[0]) == linears
    assert not any(str(node.target) == ONEDNN_LINEARS[1] for node in compiled_graph.graph.nodes)
    assert report.compiled.startswith("decode graph compiled whole by Inductor (freezing, C++ wrapper): ")
    assert "fuse=False leaves it as ops" in report.compiled and report.compiled in str(fast.graphopt_report)


def test_the_compiled_step_runs_compiled_for_other_batches_lengths_or_strides(compiled: Any) -> None:
    """Built for a batch of one and for the rest (Dynamo specializes size one): the compiled code runs for any batch,
    prompt or cache length, and a position sliced from a longer mask (strides other than a contiguous tensor's, which
    Dynamo guards on) is copied, not run as ops."""
    model, fast = compiled
    with compiled_code_or_an_error(fast):
        for batch, length, padded in ((1, 3, 0), (1, 9, 0), (2, 5, 1), (3, 7, 2)):
            ids, mask = prompt(batch, length, padded, seed=length)
            assert torch.equal(fast.generate(ids, mask, max_new_tokens=6, pad_token_id=EOS), original_generate(model, ids, mask, max_new_tokens=6))
    with torch.inference_mode():
        position = generation.positions(torch.ones(1, 11, dtype=torch.long))[:, -1:]  # as State.advance slices it
    assert position.stride() != (1, 1) and position.is_contiguous()
    (copied,) = InductorStepRunner.inputs((position,))
    assert copied.stride() == (1, 1) and torch.equal(copied, position)


def test_the_decode_graph_keeps_the_kernels_the_passes_chose_and_the_engines_steps_get_inductors(compiled: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """graphopt's decode graph is compiled without Inductor's own packing of ATen's linears (the passes measured ATen's
    and oneDNN's kernels); engine='inductor' compiles the captured program with Inductor's settings."""
    settings: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def recorded(what: str, **given: Any) -> Iterator[None]:
        settings.append(given)
        yield

    monkeypatch.setattr(inductor_engine, "_compiling", recorded)
    monkeypatch.setattr(torch, "compile", lambda module, fullgraph: module)  # run as ops: the settings are the subject
    steps = compiled[1].generator.steps
    InductorStepRunner(steps.programs[1], steps.outputs, steps.graphs[1])
    InductorStepRunner(steps.programs[1], steps.outputs)
    assert settings == [inductor_engine.PASSES_STEP_SETTINGS] * 2 + [inductor_engine.STEP_SETTINGS] * 2  # a batch of one, the rest
    assert inductor_engine.PASSES_STEP_SETTINGS == {**inductor_engine.STEP_SETTINGS, "cpp.weight_prepack": False}


def test_a_call_the_compiled_code_does_not_take_runs_as_ops_and_compiles_nothing(compiled: Any) -> None:
    """A call whose guards fail (here: the capture's arguments, not inference tensors) runs the graph as ops, with the
    same results, rather than compiling it again in the middle of a generation."""
    from torch._dynamo.utils import counters

    _, fast = compiled
    decode = fast.generator.steps.decode
    args = fast.generator.steps.examples[1]
    assert not any(tensor.is_inference() for tensor in pytree.tree_leaves(args))
    expected = pytree.tree_leaves(decode.run(args))  # copied into inference tensors: the compiled code
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        as_ops = pytree.tree_leaves(decode.compiled_only(*args))
    assert counters["stats"]["unique_graphs"] == before
    torch.testing.assert_close(as_ops, expected)


def test_the_compiled_step_samples_the_originals_tokens_from_a_seed(compiled: Any) -> None:
    model, fast = compiled
    ids, mask = prompt(2, 6, padded=1)
    for seed in (0, 1):
        torch.manual_seed(seed)
        tokens = fast.generate(ids, mask, max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
        torch.manual_seed(seed)
        assert torch.equal(tokens, original_generate(model, ids, mask, max_new_tokens=8, do_sample=True, top_k=20, top_p=0.9, temperature=0.8))


def test_threads_and_a_deep_copy_share_the_compiled_step(compiled: Any) -> None:
    """Threads call the compiled code at once (nothing is set around a call), and a deep copy calls the same code."""
    assert_threads_and_a_deep_copy_generate_the_originals_tokens(*compiled, smallest_batch=1)


@pytest.fixture()
def stub_compiler(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`compiled_step` replaced by the graph itself under a marker (no compile): what it was asked to compile."""
    asked: list[str] = []

    def compile_stub(program: Any, graph: Any, outputs: Any) -> Any:
        asked.append(type(graph).__name__)
        step = lambda *args: graph(*args)  # noqa: E731 - a callable standing for the compiled runner
        step.graph = graph  # type: ignore[attr-defined]
        step.inputs = lambda args: args  # type: ignore[attr-defined]
        return step

    monkeypatch.setattr(generation_build, "compiled_step", compile_stub)
    return asked


def _optimize(**options: Any) -> graphopt.OptimizedModule:
    ids, mask = prompt(2, 6, padded=2)
    return graphopt.optimize(tiny("gpt2", n_layer=1), {"input_ids": ids, "attention_mask": mask}, **options)


@pytest.mark.parametrize(
    ("ops_s", "step_s", "kept"), [(2.0, 1.0, True), (1.0, 1.0, True), (1.0, 2.0, False)], ids=["faster", "a tie", "slower"]
)
def test_by_default_the_compiled_step_is_kept_unless_it_measures_clearly_slower(
    stub_compiler: list[str], monkeypatch: pytest.MonkeyPatch, ops_s: float, step_s: float, kept: bool
) -> None:
    timed: list[int] = []

    def timer(ops: Callable[[], Any], step: Callable[[], Any], budget_s: float, asks: str) -> Any:
        assert asks == "slower", "the compiled step is the default: dropped only where clearly slower"
        assert torch.equal(ops()[0], step()[0])  # both run the decode step on the capture's arguments
        timed.append(1)
        return measured_as(ops_s, step_s)

    monkeypatch.setattr(generation_build, "compare_latency", timer)
    fast = _optimize()
    report = fast.graphopt_report.generation
    assert stub_compiler == ["GraphModule"] and timed == [1]
    assert fast.generator.steps.compiled_decode is kept and report.decode_compiled is kept
    if kept:
        assert report.compiled.startswith("decode graph compiled whole by Inductor") and f"({ops_s / step_s:.2f}x)" in report.compiled
    else:
        assert report.compiled.startswith("decode graph left as ops: compiled by Inductor it measured slower (") and "fuse='graph' compiles it anyway" in report.compiled


def test_fuse_graph_compiles_it_unmeasured_and_fuse_false_compiles_nothing(stub_compiler: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation_build, "compare_latency", lambda *args, **kwargs: pytest.fail("timed"))
    always = _optimize(fuse="graph")
    assert always.generator.steps.compiled_decode and always.graphopt_report.generation.compiled.endswith(", as fuse='graph' asks")
    never = _optimize(fuse=False)
    assert stub_compiler == ["GraphModule"]  # fuse="graph"'s alone
    assert not never.generator.steps.compiled_decode and never.graphopt_report.generation.compiled == ""
    assert never.graphopt_report.generation.passes  # graphopt's passes still ran
    with pytest.raises(InvalidOptionError, match="unknown fuse True: use None, False or one of"):
        _optimize(fuse=True)


def test_a_compile_that_fails_leaves_the_decode_graph_as_ops_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler(program: Any, graph: Any, outputs: Any) -> Any:
        raise EngineError("engine='inductor' could not compile the generation step (InvalidCxxCompiler: no working C++ compiler found)") from RuntimeError(
            "InvalidCxxCompiler: no working C++ compiler found"
        )

    monkeypatch.setattr(generation_build, "compiled_step", no_compiler)
    fast = _optimize()
    report = fast.graphopt_report.generation
    assert not fast.generator.steps.compiled_decode and not report.decode_compiled
    assert report.compiled == "decode graph left as ops: Inductor could not compile it (RuntimeError: InvalidCxxCompiler: no working C++ compiler found)"


def test_a_file_loaded_where_inductor_cannot_compile_runs_the_decode_graph_as_ops_and_warns(
    compiled: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, fast = compiled
    path = graphopt.save(fast, tmp_path / "llama.pt2")

    def no_compiler(program: Any, graph: Any, outputs: Any) -> Any:
        raise EngineError("no") from RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(generation_archive, "compiled_step", no_compiler)
    with pytest.warns(CompileWarning, match="ran compiled by Inductor when saved; here it could not be compiled .*runs as ops"):
        loaded = graphopt.load(path)
    report = loaded.graphopt_report.generation
    assert not loaded.generator.steps.compiled_decode and not report.decode_compiled
    assert report.compiled.startswith("decode graph left as ops at load: Inductor could not compile it (RuntimeError: InvalidCxxCompiler")
    ids, mask = prompt(2, 5, padded=1, seed=3)
    assert torch.equal(loaded.generate(ids, mask, max_new_tokens=5, pad_token_id=EOS), original_generate(model, ids, mask, max_new_tokens=5))
    assert fast.graphopt_report.generation.decode_compiled  # the saved module's own report is untouched


def test_passes_rolled_back_take_the_compiled_step_with_them(stub_compiler: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that breaks the graphs fails verification after the decode graph was compiled: both are rolled back."""
    from tests.test_generation_graphs import _scale_the_first_linear

    monkeypatch.setattr(generation_build, "compare_latency", lambda ops, step, budget_s, asks: measured_as(2.0, 1.0))
    model = tiny("llama", num_hidden_layers=1)
    ids, mask = prompt(2, 6, padded=2)
    broken = PassInfo("scale_the_first_linear", _scale_the_first_linear, ("inference",), "a broken pass")
    with pytest.warns(VerificationWarning, match="rolled back its passes on the generation graphs"):
        generator = generation_build.build(
            model, {"input_ids": ids, "attention_mask": mask}, copy.deepcopy(model), ENGINES["pytorch"], passes=generation_build.StepPasses([broken])
        )
    assert stub_compiler == ["GraphModule"] and not generator.steps.compiled_decode and not generator.report.decode_compiled
    assert generator.report.compiled == "rolled back with the passes: the decode graph runs as ops"
    assert torch.equal(generator.generate(ids, mask, max_new_tokens=5, pad_token_id=EOS), original_generate(model, ids, mask, max_new_tokens=5))

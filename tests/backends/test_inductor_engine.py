"""The Inductor engine built directly: freezing, a graph compiled for the example's shapes and one for every other call, bf16, its errors, its settings.

What every engine does through ``optimize(engine=...)`` (verified on a second input, a token
model at other batch sizes and sequence lengths, a saved result loaded in a fresh process,
training and other options refused) is tested for Inductor too in tests/test_engines.py.
Compiling takes seconds even for these tiny models: the runners are built once per module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.utils import counters

import graphopt
from tests.engine_models import TokenModel, conv_net, tokens
from graphopt.backends import inductor_engine
from graphopt.backends.engine import EngineInput, export_program
from graphopt.errors import EngineError
from graphopt.verify import compare, tolerance_for

BATCH = (frozenset({0}),)


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process (a recompile adds one)."""
    return counters["stats"]["unique_graphs"]


def built(model: nn.Module, args: tuple[Any, ...], dims: tuple[frozenset[int], ...], precision: str = "fp32") -> inductor_engine.InductorRunner:
    return inductor_engine.build(EngineInput(fx.symbolic_trace(model), args, dims, precision))


def assert_matches(expected: Any, actual: Any, compute_dtype: torch.dtype | None = None) -> float:
    comparison = compare(expected, actual, compute_dtype)
    assert comparison.ok, comparison.detail
    return comparison.max_error


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return conv_net()


@pytest.fixture(scope="module")
def example() -> torch.Tensor:
    return torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def fp32(model: nn.Module, example: torch.Tensor) -> inductor_engine.InductorRunner:
    return built(model, (example,), BATCH)


@pytest.fixture(scope="module")
def bf16(model: nn.Module, example: torch.Tensor) -> inductor_engine.InductorRunner:
    return built(model, (example,), BATCH, "bf16")


def test_the_compiled_graphs_serve_other_batches_strides_and_inference_tensors(fp32: inductor_engine.InductorRunner, model: nn.Module, example: torch.Tensor) -> None:
    before = compiled_graphs()
    other = torch.randn(5, 3, 12, 12)
    with torch.no_grad():
        expected, expected_other = model(example), model(other)
    assert_matches(expected, fp32(example))
    outputs = fp32(other)
    assert set(outputs) == {"logits", "features"} and isinstance(outputs["features"], tuple)  # the model's structure
    assert assert_matches(expected_other, outputs) <= 1e-5
    # graphopt's second input has other strides, and verification copies inputs under torch.inference_mode
    assert_matches(expected_other, fp32(other.contiguous(memory_format=torch.channels_last)))
    with torch.inference_mode():
        assert_matches(expected_other, fp32(other.clone()))
    assert_matches(expected_other, fp32(other.clone().requires_grad_()))
    assert compiled_graphs() == before  # every call ran the graph compiled (and frozen) in build


def test_the_examples_shapes_run_on_a_graph_compiled_for_them_other_sizes_on_the_dynamic_one(
    fp32: inductor_engine.InductorRunner, example: torch.Tensor
) -> None:
    assert fp32.example_compiled is not fp32.compiled
    calls: list[tuple[str, int]] = []
    originals = {name: getattr(fp32, name) for name in ("compiled", "example_compiled")}

    def spy(name: str) -> Any:
        return lambda *args: calls.append((name, args[0].shape[0])) or originals[name](*args)

    try:
        for name in originals:
            object.__setattr__(fp32, name, spy(name))  # held, not registered, as the runner holds them
        before = compiled_graphs()
        fp32(example), fp32(torch.randn(5, 3, 12, 12)), fp32(example.contiguous(memory_format=torch.channels_last))
        assert compiled_graphs() == before, "both were compiled in build"
    finally:
        for name, original in originals.items():
            object.__setattr__(fp32, name, original)
    assert calls == [("example_compiled", 2), ("compiled", 5), ("example_compiled", 2)]
    fixed = built(Scale().eval(), (torch.randn(3, 6),), (frozenset(),))  # nothing dynamic: one graph, compiled once
    assert fixed.example_compiled is fixed.compiled


def test_the_callers_graph_and_inputs_are_left_alone(model: nn.Module) -> None:
    gm, x = fx.symbolic_trace(model), torch.randn(2, 3, 12, 12)
    code, values = gm.code, x.clone()
    inductor_engine.build(EngineInput(gm, (x,), BATCH, "fp32"))
    assert gm.code == code
    assert torch.equal(x, values) and not hasattr(x, "_dynamo_dynamic_indices")  # the dynamic marks went on a copy


def test_a_channels_last_example_is_compiled_for_channels_last_inputs(model: nn.Module) -> None:
    channels_last = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    runner = built(model, (channels_last,), BATCH)
    before = compiled_graphs()
    other = torch.randn(3, 3, 12, 12)
    with torch.no_grad():
        expected = model(other)
    assert_matches(expected, runner.run_compiled((other.contiguous(memory_format=torch.channels_last),)))  # taken as it is, not copied
    assert_matches(expected, runner(other))  # a contiguous input is copied to channels_last
    assert compiled_graphs() == before


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def test_the_weights_are_frozen_into_the_compiled_code() -> None:
    gm, x = fx.symbolic_trace(Scale().eval()), torch.randn(3, 6)
    runner = inductor_engine.build(EngineInput(gm, (x,), BATCH, "fp32"))
    with torch.no_grad():
        expected = gm(x)
        gm.linear.weight.zero_()  # read at every call unless frozen in as a constant
    assert_matches(expected, runner(x))


def test_a_token_model_runs_at_other_batch_sizes_and_sequence_lengths_without_compiling_again() -> None:
    torch.manual_seed(0)
    model, example = TokenModel().eval(), tokens(2, 8)
    runner = built(model, example, (frozenset({0, 1}), frozenset({0, 1})))
    before = compiled_graphs()
    for batch, length in ((3, 5), (4, 11)):
        inputs = tokens(batch, length)
        with torch.no_grad():
            expected = model(*inputs)
        assert assert_matches(expected, runner(*inputs)) <= 1e-5
    assert compiled_graphs() == before


def test_bf16_computes_in_bf16_within_its_tolerance_and_returns_the_models_dtypes(
    bf16: inductor_engine.InductorRunner, fp32: inductor_engine.InductorRunner, model: nn.Module, example: torch.Tensor
) -> None:
    for x in (example, torch.randn(4, 3, 12, 12)):
        with torch.no_grad():
            expected = model(x)
        outputs = bf16(x)
        assert {t.dtype for t in (outputs["logits"], *outputs["features"])} == {torch.float32}
        error = assert_matches(expected, outputs, compute_dtype=torch.bfloat16)
        assert error > 100 * compare(expected, fp32(x)).max_error  # really rounded to bf16: fp32 matches far closer


def test_no_cpp_compiler_raises_engine_error_saying_what_to_install() -> None:
    from torch._inductor import config

    # without the cache: a cached build of the same graph would need no compiler
    with config.patch({"cpp.cxx": ("no-such-compiler",), "fx_graph_cache": False}), pytest.raises(EngineError) as raised:
        built(Scale().eval(), (torch.randn(3, 6),), BATCH)
    assert re.fullmatch(
        r"engine='inductor' could not compile graphopt's graph \(InvalidCxxCompiler: No working C\+\+ compiler found .*\): install a C\+\+ compiler \(g\+\+ or clang\) or use another engine",
        str(raised.value),
    )


@torch.fx.wrap
def _breaks_the_graph(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.graph_break()
    return x


class Unsupported(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _breaks_the_graph(x) + 1


def test_a_graph_inductor_cannot_take_raises_engine_error_quoting_it() -> None:
    with pytest.raises(EngineError, match=r"could not compile graphopt's graph \(Unsupported: .*\): use another engine$"):
        built(Unsupported(), (torch.randn(2, 3),), BATCH)


def test_other_devices_and_precisions_are_refused(model: nn.Module, example: torch.Tensor) -> None:
    with pytest.raises(EngineError, match="computes in fp32 or bf16, not 'fp16'"):
        built(model, (example,), BATCH, "fp16")
    with pytest.raises(EngineError, match="runs on the CPU here"):
        built(model, (example.to("meta"),), BATCH)


LOAD_AND_COMPARE = """
import json, torch
from pathlib import Path
from graphopt.backends import inductor_engine
from graphopt.verify import compare
example, other, expected = torch.load("inputs.pt")
graph = torch.export.load("graph.pt2").module()  # as graphopt.load reads the graph saved beside the engine's settings
runner = inductor_engine.load(Path("engine"), json.loads(Path("settings.json").read_text()), graph, example)
outputs = dict(runner(other))  # the exported graph returns fx's immutable_dict
print(runner.precision, compare(expected, outputs, torch.bfloat16).max_error)
"""


@pytest.mark.slow
def test_load_compiles_the_saved_graph_again_in_a_fresh_process(bf16: inductor_engine.InductorRunner, model: nn.Module, example: torch.Tensor, tmp_path: Path) -> None:
    folder = tmp_path / "engine"
    folder.mkdir()
    settings = bf16.save(folder)
    assert list(folder.iterdir()) == []  # no compiled code is written
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    other = torch.randn(4, 3, 12, 12)
    torch.export.save(export_program(fx.symbolic_trace(model), (example,), BATCH, "inductor"), tmp_path / "graph.pt2")
    with torch.no_grad():
        torch.save(((example,), other, model(other)), tmp_path / "inputs.pt")
    (tmp_path / "load.py").write_text(LOAD_AND_COMPARE)
    tested = {**os.environ, "PYTHONPATH": str(Path(graphopt.__file__).parents[1])}  # the graphopt under test, wherever it is
    done = subprocess.run([sys.executable, "load.py"], cwd=tmp_path, env=tested, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    precision, error = done.stdout.split()
    assert precision == "bf16"
    assert 1e-5 < float(error) <= tolerance_for(torch.bfloat16)  # bf16 again, at the saved dynamic batch


def test_optimize_verifies_and_serves_the_graphs_compiled_in_bf16(model: nn.Module) -> None:
    x, other = torch.randn(2, 3, 12, 12), torch.randn(3, 3, 12, 12)
    before = compiled_graphs()
    optimized = graphopt.optimize(model, x, engine="inductor", precision="bf16")
    report = optimized.graphopt_report.engine
    assert (report.name, report.precision) == ("inductor", "bf16")
    assert 1e-5 < report.max_error <= tolerance_for(torch.bfloat16) and report.second_input_error is not None
    with torch.no_grad():
        assert_matches(model(other), optimized(other), compute_dtype=torch.bfloat16)
    # the example's shapes and the other sizes, each compiled once in build: the second input and the call compile nothing
    assert compiled_graphs() == before + 2


class _PerRow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2 + 1


def test_an_input_whose_size_one_dimension_has_another_stride_compiles_nothing_more() -> None:
    """A (batch, 1, 8) input whose size-1 dimension has another stride than a copy's is contiguous to ``is_contiguous``,
    but Dynamo guards on that stride: the runner copies it (values kept) rather than compile again, without freezing."""
    runner = built(_PerRow(), (torch.randn(3, 1, 8),), (frozenset({0}),))
    odd = torch.randn(4, 1, 8).as_strided((4, 1, 8), (8, 99, 1))
    assert odd.is_contiguous() and odd.stride() != (8, 8, 1)
    before = compiled_graphs()
    with torch.compiler.set_stance("fail_on_recompile"):
        out = runner(odd)
    assert compiled_graphs() == before
    assert_matches(_PerRow()(odd), out)

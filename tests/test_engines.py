"""optimize(engine=...): every registered engine behind the same contract.

Each engine other than PyTorch (graphopt.backends.ENGINES) is checked through the public API:
its result is verified on a second input (another batch, and for a token model another
sequence length), a call at other sizes matches the model, a saved module computes the same in
a fresh process, training and options only PyTorch serves are refused with the reason, a
missing runtime names the extra, a wrong engine result raises instead of being returned, new
weights cannot be loaded into a compiled engine, and tune's report lists every engine. No
test times anything: tune's timer is a fake.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import graphopt
from tests.engine_models import TokenModel, conv_net, tokens
from graphopt import timing, tuning
from graphopt.backends import ENGINES, EngineRunner
from graphopt.errors import EngineError, InvalidOptionError, ModeSwitchError, VerificationError

ENGINE_NAMES = [name for name, info in ENGINES.items() if not info.own_passes]
SLOW = {name for name in ENGINE_NAMES if ENGINES[name].compiles}  # a compiling engine costs a compilation per test


def engines(*marks: Any) -> list[Any]:
    """The engine names as parameters, the compiling ones marked slow."""
    return [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in ENGINE_NAMES]


def assert_matches(expected: Any, actual: Any, tolerance: float = 1e-4) -> None:
    comparison = graphopt.verify.compare(expected, actual)
    assert comparison.max_error <= tolerance, comparison.detail


@pytest.fixture(scope="module")
def conv_on() -> Callable[[str], tuple[nn.Module, graphopt.OptimizedModule]]:
    """`conv_net` optimized on an engine (example: a batch of 2), once for the module at the first test that asks for that
    engine; the tests only read what they get (call it, save it)."""

    @functools.cache
    def build(engine: str) -> tuple[nn.Module, graphopt.OptimizedModule]:
        model = conv_net()
        return model, graphopt.optimize(model, torch.randn(2, 3, 12, 12), engine=engine)

    return build


@pytest.mark.parametrize("engine", engines())
def test_an_engine_result_is_verified_and_matches_at_other_sizes(engine: str, conv_on: Callable[[str], tuple[nn.Module, graphopt.OptimizedModule]]) -> None:
    model, optimized = conv_on(engine)
    report = optimized.graphopt_report
    assert report.engine.name == engine and report.engine.precision == "fp32"
    assert report.engine.max_error is not None and report.engine.second_input_error is not None  # both checks ran
    assert type(optimized.runner).__module__.startswith("graphopt.backends.")  # forward runs the engine, not the graph
    assert f"engine: {engine} (fp32)" in str(report)
    other = torch.randn(5, 3, 12, 12)
    with torch.no_grad():
        expected = model(other)
    actual = optimized(other)
    assert set(actual) == {"logits", "features"}  # the model's output structure
    assert_matches(expected, actual)
    assert report.max_error <= 1e-4


@pytest.mark.parametrize("engine", engines())
def test_a_token_model_runs_at_another_batch_and_sequence_length(engine: str) -> None:
    model = TokenModel().eval()
    optimized = graphopt.optimize(model, tokens(2, 8), engine=engine)
    assert "dims 0, 1" in optimized.graphopt_report.dynamic
    for batch, length in ((3, 5), (1, 11)):
        inputs = tokens(batch, length)
        with torch.no_grad():
            expected = model(*inputs)
        assert_matches(expected, optimized(*inputs))
        assert_matches(expected, optimized(input_ids=inputs[0], attention_mask=inputs[1]))  # by name too


LOAD_AND_COMPARE = """
import sys, torch, graphopt
results = {}
for key, (inputs, expected) in torch.load(sys.argv[1]).items():
    module = graphopt.load(key + ".pt2")
    error = graphopt.verify.compare(expected, module(*inputs)).max_error
    results[key] = (module.graphopt_report.engine.name, type(module.runner).__name__, error)
torch.save(results, "results.pt")
"""


def loaded_in_one_fresh_process(saved: Mapping[str, tuple[graphopt.OptimizedModule, tuple[Any, ...], Any]], folder: Path) -> dict[str, tuple[str, str, float]]:
    """Each (optimized, inputs, expected) of ``saved`` saved, then all loaded by `graphopt.load` in one fresh process (one
    start of Python, torch and the engines) and called on their ``inputs``: by key, (its engine's name, its runner's class
    name, its error against ``expected``)."""
    for key, (optimized, _, _) in saved.items():
        graphopt.save(optimized, folder / f"{key}.pt2")
    torch.save({key: (inputs, expected) for key, (_, inputs, expected) in saved.items()}, folder / "checks.pt")
    (folder / "load.py").write_text(LOAD_AND_COMPARE)
    done = subprocess.run([sys.executable, "load.py", "checks.pt"], cwd=folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(folder / "results.pt")


def loaded_in_a_fresh_process(optimized: graphopt.OptimizedModule, inputs: tuple[Any, ...], expected: Any, folder: Path) -> tuple[str, str, float]:
    """``optimized`` saved, loaded by `graphopt.load` in a fresh process and called on ``inputs``: (its engine's name,
    its runner's class name, its error against ``expected``)."""
    return loaded_in_one_fresh_process({"model": (optimized, inputs, expected)}, folder)["model"]


@pytest.fixture(scope="module")
def loaded_in_a_fresh_process_each(request: pytest.FixtureRequest, conv_on: Callable[[str], tuple[nn.Module, graphopt.OptimizedModule]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str, float]]:
    """Each engine's `conv_on` module that a collected test below asks for, saved and loaded in one fresh process
    (`loaded_in_one_fresh_process`), called on a batch of 4: by engine, (the loaded module's engine name, its runner's
    class name, its error against the original model)."""
    asked = [item.callspec.params["engine"] for item in request.session.items if item.originalname == "test_a_saved_engine_result_computes_the_same_in_a_fresh_process"]
    folder = tmp_path_factory.mktemp("saved")
    saved: dict[str, tuple[graphopt.OptimizedModule, tuple[Any, ...], Any]] = {}
    with pytest.MonkeyPatch.context() as monkeypatch:  # a build made here has an empty tuning cache, as in a test
        monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(folder / "cache"))
        monkeypatch.setattr(tuning, "_memory_cache", {})
        for engine in dict.fromkeys(asked):
            model, optimized = conv_on(engine)
            other = torch.randn(4, 3, 12, 12)
            with torch.no_grad():
                saved[engine] = (optimized, (other,), model(other))
        return loaded_in_one_fresh_process(saved, folder)


@pytest.mark.parametrize("engine", engines())
def test_a_saved_engine_result_computes_the_same_in_a_fresh_process(engine: str, conv_on: Callable[[str], tuple[nn.Module, graphopt.OptimizedModule]], loaded_in_a_fresh_process_each: dict[str, tuple[str, str, float]]) -> None:
    _, optimized = conv_on(engine)
    name, runner, error = loaded_in_a_fresh_process_each[engine]
    assert (name, runner) == (engine, type(optimized.runner).__name__)
    assert error <= 1e-4


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_what_only_pytorch_serves_is_refused_before_anything_is_built(engine: str) -> None:
    model, x = conv_net(), torch.randn(2, 3, 12, 12)
    with pytest.raises(InvalidOptionError, match=f"engine='{engine}' serves inference only"):
        graphopt.optimize(model.train(), x, engine=engine)
    with pytest.raises(InvalidOptionError, match="computes in .* not precision='fp16'"):
        graphopt.optimize(model.eval(), x, engine=engine, precision="fp16")
    with pytest.raises(InvalidOptionError, match="leave fuse= out"):
        graphopt.optimize(model, x, engine=engine, fuse="graph")
    with pytest.raises(InvalidOptionError, match="chooses its own memory layouts"):
        graphopt.optimize(model, x, engine=engine, memory_format="channels_last")
    with pytest.raises(InvalidOptionError, match="use_onednn_kernels, whose result only PyTorch runs"):
        graphopt.optimize(model, x, engine=engine, passes=["fold_conv_bn", "use_onednn_kernels"])


def test_an_unknown_engine_names_the_close_one() -> None:
    with pytest.raises(InvalidOptionError, match="unknown engine 'openvno' \\(did you mean 'openvino'\\?\\)"):
        graphopt.optimize(conv_net(), torch.randn(2, 3, 12, 12), engine="openvno")


@pytest.mark.parametrize("engine", [name for name in ENGINE_NAMES if ENGINES[name].requires])
def test_a_missing_runtime_names_what_to_install(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    info = ENGINES[engine]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == info.requires else find_spec(name, *rest))
    install = f"pip install 'graphopt[{info.extra}]'" if info.extra else f"pip install {info.requires}"
    with pytest.raises(EngineError, match=re.escape(f"needs {info.requires}, which is not installed: {install}")):
        graphopt.optimize(conv_net(), torch.randn(2, 3, 12, 12), engine=engine)


class _Shifted(EngineRunner):
    """An engine runner whose outputs are off by 1%: what verification must catch."""

    def __init__(self, runner: nn.Module) -> None:
        super().__init__()
        self.runner = runner

    def forward(self, *args: Any) -> Any:
        return torch.utils._pytree.tree_map(lambda t: t * 1.01, self.runner(*args))


def _with_build(monkeypatch: pytest.MonkeyPatch, engine: str, build: Callable[..., Any]) -> None:
    monkeypatch.setitem(ENGINES, engine, dataclasses.replace(ENGINES[engine], build=build))


def test_an_engine_that_computes_wrongly_raises_instead_of_returning(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ENGINE_NAMES[0]
    original = ENGINES[engine].build
    _with_build(monkeypatch, engine, lambda request: _Shifted(original(request)))
    with pytest.raises(VerificationError, match=f"engine='{engine}' \\(fp32\\) computes .* differently from the original model on the example inputs"):
        graphopt.optimize(conv_net(), torch.randn(2, 3, 12, 12), engine=engine)


def test_an_engine_that_cannot_take_the_graph_raises_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ENGINE_NAMES[0]

    def refuses(request: Any) -> Any:
        raise EngineError(f"engine={engine!r} could not convert or compile graphopt's graph (RuntimeError: unsupported op)")

    _with_build(monkeypatch, engine, refuses)
    with pytest.raises(EngineError, match="unsupported op"):
        graphopt.optimize(conv_net(), torch.randn(2, 3, 12, 12), engine=engine)


def test_weights_cannot_be_changed_under_a_compiled_engine() -> None:
    model, x = conv_net(), torch.randn(2, 3, 12, 12)
    optimized = graphopt.optimize(model, x, engine=ENGINE_NAMES[0])
    with pytest.raises(ModeSwitchError, match="compiled its own copy of the weights"):
        optimized.load_state_dict(optimized.state_dict())
    with pytest.raises(ModeSwitchError, match="compiled its own copy of the weights"):
        optimized.load_original_state_dict(model.state_dict())
    with pytest.raises(ModeSwitchError, match="this module was optimized for inference"):
        optimized.train()
    optimized.to("cpu")  # where it already is: nothing changes


class FakeTimer:
    """Latencies by candidate name (others 10 ms); runs every candidate once, so a broken one fails."""

    def __init__(self, latencies: Mapping[str, float]) -> None:
        self.latencies = latencies

    def __call__(self, runs: Mapping[str, Callable[[], Any]], **settings: Any) -> timing.Ranking:
        for run in runs.values():
            run()
        return timing.Ranking.of({name: [self.latencies.get(name, 10e-3)] * timing.MIN_ROUNDS for name in runs}, foreign_cores=0.0)


@pytest.fixture
def fake_timer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[Mapping[str, float]], None]:
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_memory_cache", {})
    return lambda latencies: monkeypatch.setattr(tuning, "measure_latencies", FakeTimer(latencies))


def test_tune_tries_every_engine_and_returns_the_fastest_verified_one(fake_timer: Callable[[Mapping[str, float]], None]) -> None:
    engine = ENGINE_NAMES[0]
    fake_timer({f"{engine} fp32": 1e-3})
    model, x = conv_net(), torch.randn(2, 3, 12, 12)
    tuned = graphopt.optimize(model, x, tune=True)
    report = tuned.graphopt_report
    assert report.tune.winner == f"{engine} fp32" and report.engine.name == engine
    listed = {candidate.name.split()[0] for candidate in report.tune.candidates}
    assert set(ENGINE_NAMES) <= listed  # built, or left out with the reason (those that compile, under this budget)
    assert all(candidate.reason for candidate in report.tune.candidates if candidate.status == "not built")
    assert {"captured graph, no passes", "default call"} <= {c.name for c in report.tune.candidates if c.status == "measured"}
    assert_matches(model(x), tuned(x))


def test_tune_never_returns_something_slower_than_the_default_call(fake_timer: Callable[[Mapping[str, float]], None]) -> None:
    fake_timer({"default call": 1e-3})
    tuned = graphopt.optimize(conv_net(), torch.randn(2, 3, 12, 12), tune=True)
    assert tuned.graphopt_report.tune.winner == "default call"
    assert tuned.graphopt_report.engine is None


def test_tune_with_an_engine_given_tunes_its_precisions_only(fake_timer: Callable[[Mapping[str, float]], None]) -> None:
    engine = ENGINE_NAMES[0]
    fake_timer({})
    report = graphopt.optimize(conv_net(), torch.randn(2, 3, 12, 12), tune=True, engine=engine, accuracy=3e-2).graphopt_report
    built = [c.name for c in report.tune.candidates if c.status == "measured"]
    assert built and all(name.startswith(f"{engine} ") for name in built)
    assert "fp32" in {name.split()[1] for name in built} <= set(ENGINES[engine].precisions)

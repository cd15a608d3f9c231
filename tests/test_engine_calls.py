"""Engines under hostile use: calls from several threads, sizes beyond a limit torch.export found, a runtime
that fails on a call, calibration batches of another shape, a runtime that is installed but broken, and
model outputs of a type torch's pytree flattens only without key paths.

Every case computes what the original computes or raises a `GraphoptError` saying what to do.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import graphopt
from graphopt.backends import ENGINES, EngineRunner, openvino_engine
from graphopt.errors import EngineError, InputMismatchError, InvalidInputsError
from graphopt.trees import leaves_with_paths

ENGINE_NAMES = [name for name, info in ENGINES.items() if not info.own_passes]


def engines() -> list[Any]:
    """The engine names as parameters, the compiling ones marked slow."""
    return [pytest.param(name, marks=[pytest.mark.slow] if ENGINES[name].compiles else []) for name in ENGINE_NAMES]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)).eval()


def calls_from_threads(modules: list[nn.Module], reference: nn.Module, calls: int = 40) -> tuple[int, list[str]]:
    """Each module called ``calls`` times from its own thread, all at once: how many results differ from
    ``reference``'s, and the errors raised."""
    wrong, errors = [], []
    start = threading.Barrier(len(modules))

    def work(module: nn.Module, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        start.wait()
        for _ in range(calls):
            x = torch.randn(8, 32, generator=generator)
            try:
                actual = module(x)
            except Exception as error:  # noqa: BLE001 - counted: the test asserts there are none
                errors.append(repr(error))
                continue
            with torch.no_grad():
                if graphopt.verify.compare(reference(x), actual).max_error > 1e-4:
                    wrong.append(seed)

    threads = [threading.Thread(target=work, args=(module, seed)) for seed, module in enumerate(modules)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(wrong), errors


@pytest.mark.parametrize("engine", ["pytorch", *engines()])
def test_an_engine_result_called_from_several_threads_and_its_copy_computes_right(engine: str) -> None:
    model = mlp()
    optimized = graphopt.optimize(model, torch.randn(8, 32), engine=engine)
    wrong, errors = calls_from_threads([optimized, optimized, copy.deepcopy(optimized)], model)
    assert errors == []
    assert wrong == 0


def test_each_thread_gets_its_own_openvino_infer_request() -> None:
    runner = graphopt.optimize(mlp(), torch.randn(8, 32), engine="openvino").runner
    mine = runner.infer_request(runner.example_compiled)
    others: list[Any] = []
    thread = threading.Thread(target=lambda: others.append(runner.infer_request(runner.example_compiled)))
    thread.start()
    thread.join()
    assert runner.infer_request(runner.example_compiled) is mine  # made once per thread, then reused
    assert others[0] is not mine
    assert copy.deepcopy(runner) is runner  # copies share the compiled models, and so take requests per thread too


def small_bert(positions: int) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=positions)
    return BertModel(config).eval()


def bert_inputs(batch: int, length: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 50, (batch, length)), "attention_mask": torch.ones(batch, length, dtype=torch.int64)}


@pytest.mark.parametrize("engine", ["pytorch", *engines()])
def test_a_call_beyond_the_models_position_limit_is_refused_on_every_engine(engine: str) -> None:
    model = small_bert(positions=32)
    optimized = graphopt.optimize(model, bert_inputs(2, 16), engine=engine)
    inside = bert_inputs(3, 24)
    with torch.no_grad():
        assert graphopt.verify.compare(model(**inside).last_hidden_state, optimized(**inside).last_hidden_state).max_error <= 1e-4
    with pytest.raises(InputMismatchError, match=r"input_ids.size\(\)\[1\] <= 32.*Call it with sizes in that range"):
        optimized(**bert_inputs(2, 40))


def test_a_loaded_engine_module_refuses_a_call_beyond_the_limit_too(tmp_path: Path) -> None:
    optimized = graphopt.optimize(small_bert(positions=32), bert_inputs(2, 16), engine="onnxruntime")
    loaded = graphopt.load(graphopt.save(optimized, tmp_path / "bert.pt2"))
    with pytest.raises(InputMismatchError, match=r"<= 32"):
        loaded(**bert_inputs(2, 40))


class _FailsOnACall(EngineRunner):
    """A runner whose runtime raises its own error on a call, as a runtime does on an input it cannot take."""

    engine = "onnxruntime"

    def run(self, args: tuple[Any, ...]) -> Any:
        raise RuntimeError("Non-zero status code returned while running Expand node")


def test_a_runtime_error_on_a_call_becomes_an_engine_error_saying_what_to_do() -> None:
    with pytest.raises(EngineError, match=r"engine='onnxruntime' failed on this call \(RuntimeError: Non-zero status.*engine='pytorch'"):
        _FailsOnACall()(torch.randn(2, 3))


def _with_build(monkeypatch: pytest.MonkeyPatch, engine: str, build: Callable[..., Any]) -> None:
    monkeypatch.setitem(ENGINES, engine, dataclasses.replace(ENGINES[engine], build=build))


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_an_error_of_an_engines_own_tools_while_building_becomes_an_engine_error(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(request: Any) -> Any:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x12 and 16x32)")

    _with_build(monkeypatch, engine, fails)
    with pytest.raises(EngineError, match=rf"engine='{engine}' could not build graphopt's graph \(RuntimeError: mat1 and mat2"):
        graphopt.optimize(mlp(), torch.randn(8, 32), engine=engine)


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino", "pytorch"])
def test_int8_calibration_batches_of_another_feature_size_are_refused_before_any_build(engine: str) -> None:
    model = mlp()
    batches = [torch.randn(8, 32), torch.randn(4, 32), torch.randn(8, 24)]  # a smaller last batch is fine; 24 features are not
    with pytest.raises(InvalidInputsError, match=r"calibration batch 2: input 0 is \(8, 24\), the example's \(8, 32\): dimension 1 differs"):
        graphopt.optimize(model, torch.randn(8, 32), engine=engine, precision="int8", calibration=batches)


def test_calibration_batches_may_differ_in_the_dimensions_dynamic_shapes_makes_vary() -> None:
    model = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, 4, 1)).eval()
    batches = [torch.randn(2, 4, length) for length in (16, 24, 12)]
    optimized = graphopt.optimize(model, torch.randn(2, 4, 16), engine="onnxruntime", precision="int8", calibration=batches, dynamic_shapes="auto")
    assert optimized.graphopt_report.engine.max_error is not None


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_an_openvino_that_is_installed_but_fails_to_import_gives_an_engine_error(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module
    failure = ImportError("libopenvino.so.2026.4.1: cannot open shared object file")

    def broken(name: str, *rest: Any) -> Any:
        if name == "openvino" or name.startswith("openvino."):
            raise failure
        return real_import(name, *rest)

    def import_openvino() -> Any:
        raise failure

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(openvino_engine, "_openvino", import_openvino)  # the engine's own `import openvino` fails too
    monkeypatch.setattr(openvino_engine, "core", lambda: openvino_engine._openvino().Core())  # not the process's Core, made before
    calibration = {"calibration": [torch.randn(8, 32)]} if precision == "int8" else {}
    with pytest.raises(EngineError, match=r"needs openvino, which is installed but fails to import \(ImportError: libopenvino.*--force-reinstall"):
        graphopt.optimize(mlp(), torch.randn(8, 32), engine="openvino", precision=precision, **calibration)


@dataclasses.dataclass
class KeylessOutput:
    """An output class registered with torch's pytree without key functions, as transformers 5.5 registers ModelOutput."""

    logits: torch.Tensor
    hidden: torch.Tensor


pytree.register_pytree_node(KeylessOutput, lambda out: ([out.logits, out.hidden], ["logits", "hidden"]), lambda values, context: KeylessOutput(*values))


class ReturnsKeylessOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> KeylessOutput:
        hidden = self.linear(x)
        return KeylessOutput(hidden.relu(), hidden)


def test_paths_of_a_type_registered_without_key_functions_use_its_field_names() -> None:
    with pytest.raises(ValueError, match="flatten_with_keys_fn"):  # what torch's own function does
        pytree.tree_flatten_with_path(KeylessOutput(torch.zeros(1), torch.ones(1)))
    paths = [pytree.keystr(path) for path, _ in leaves_with_paths({"out": KeylessOutput(torch.zeros(1), torch.ones(1))})]
    assert paths == ["['out']['logits']", "['out']['hidden']"]


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("engine", ["pytorch", "onnxruntime"])
def test_a_model_returning_a_type_without_key_functions_is_optimized(frontend: str, engine: str) -> None:
    torch.manual_seed(0)
    model = ReturnsKeylessOutput().eval()
    optimized = graphopt.optimize(model, torch.randn(2, 8), frontend=frontend, engine=engine)
    other = torch.randn(5, 8)
    actual = optimized(other)
    assert isinstance(actual, KeylessOutput)
    with torch.no_grad():
        expected = model(other)
    assert graphopt.verify.compare(expected, actual).max_error <= 1e-4
    wrong = KeylessOutput(actual.logits, actual.hidden + 1)
    assert graphopt.verify.compare(expected, wrong).where == "output['hidden']"  # errors name the field

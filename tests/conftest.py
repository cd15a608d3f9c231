"""Shared test helpers: capture a small model in each graph form and compare outputs."""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

import graphopt
from graphopt import dynamic, quiet, timing, tuning
from graphopt.passes import PassContext
from graphopt.validate import SecondInputs
from graphopt.verify import compare_gradients, confirm_gradients, run_reference

FRONTENDS = ("fx", "export")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs ``-n auto``) the workers share the cores: each gets its share of threads,
    as do the processes the tests start (OMP_NUM_THREADS), instead of every worker's torch using all of them; and the
    files are handed out in the order `pytest_collection_modifyitems` gives them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # Linux; elsewhere all
        threads = max(1, cores // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's option, on by default
        config.option.loadscopereorder = False


@pytest.fixture(scope="session", autouse=True)
def _torchao_imported_quietly() -> None:
    """torchao (the bench extra's PT2E int8 peer) is imported by transformers' quantizers whenever a test builds a Hugging Face model;
    its first import logs that its CUDA and Python 3.10 extension modules fail to load, and torch that torchao registers
    enums torch now handles itself. Imported once here with those notices dropped (`graphopt.quiet.TORCHAO_IMPORT_MESSAGES`,
    as the benchmarks do), no test's output carries them; graphopt itself filters nothing on import."""
    with contextlib.suppress(ImportError), quiet.log_messages_dropped(quiet.TORCHAO_IMPORT_MESSAGES):
        import transformers.quantizers  # noqa: F401 - what imports torchao's modules when transformers builds a model


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a test marked slow first, then the others, each group's files with the most tests first; each file's
    tests stay together and in their order. ``make test`` hands whole files to its workers in this order (pytest-xdist's
    own, by number of tests alone, is turned off in `pytest_configure`): by it, a file of a few long tests, such as the
    README's, started last and one worker ran it alone after the other had finished."""
    tests_in = collections.Counter(item.path for item in items)
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slow, -tests_in[item.path]))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Module and session fixtures build before each test's `_private_cache` is set: theirs is this run's own empty one,
    never ~/.cache, so no decision from an earlier run or the user's machine is reused."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path_factory.mktemp("graphopt-session-cache")))
        patch.delenv("GRAPHOPT_REMEASURE", raising=False)
        yield


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured decisions (and tune's choices) are remembered in $GRAPHOPT_CACHE_DIR: each test gets an empty one,
    never ~/.cache, so a decision one test's fake timer made is not another test's."""
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path_factory.mktemp("graphopt-cache")))
    monkeypatch.setattr(tuning, "_memory_cache", {})  # tune's copy of the file in this process
    monkeypatch.delenv("GRAPHOPT_REMEASURE", raising=False)


def measured_as(baseline_s: float, candidate_s: float, threshold: float = 1.0) -> timing.Comparison:
    """What `graphopt.timing.compare_latency` returns when every round times ``baseline_s`` and ``candidate_s`` (fake timers)."""
    rounds = timing.MIN_ROUNDS
    return timing.Comparison.of([baseline_s] * rounds, [candidate_s] * rounds, threshold, foreign_cores=0.0)


@pytest.fixture
def convolutions_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """to_channels_last's planning run times the convolutions with the clock and leaves the pass out untimed where they take
    under 2% of it: on a loaded machine a small model's share can fall below that. A test that fakes the pipeline's timer
    and expects channels_last fakes this too."""
    channels_last = importlib.import_module("graphopt.passes.to_channels_last")  # the package attribute is the pass function
    monkeypatch.setattr(channels_last, "_cannot_pay", lambda planner, run_seconds: None)


def model_state(model: nn.Module) -> tuple[Any, ...]:
    """Everything a public call must leave alone: tensors (bytes), training flags, hooks."""
    tensors = tuple((name, t.dtype, tuple(t.shape), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for name, t in model.state_dict().items())
    flags = tuple(m.training for m in model.modules())
    hooks = tuple(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    return tensors, flags, hooks


def captured(model: nn.Module, inputs: tuple[Any, ...], frontend: str) -> fx.GraphModule:
    """``model`` captured by ``frontend``; checks that ``model`` itself was left untouched."""
    before = model_state(model)
    gm = graphopt.capture(model, inputs, frontend=frontend)
    assert model_state(model) == before, "capture changed the user's model"
    return gm


def context(inputs: tuple[Any, ...], mode: str = "inference") -> PassContext:
    return PassContext(mode=mode, example_inputs=inputs)  # type: ignore[arg-type]


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """max |actual - expected| relative to the largest magnitude of ``expected``."""
    return float((expected.detach() - actual.detach()).abs().max() / expected.detach().abs().max())


def randomize_batch_norms(model: nn.Module) -> nn.Module:
    """Give every BatchNorm non-trivial statistics and affine parameters, so folding is really tested."""
    generator = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            features = module.num_features
            with torch.no_grad():
                if module.running_mean is not None:
                    module.running_mean.copy_(torch.randn(features, generator=generator))
                    module.running_var.copy_(torch.rand(features, generator=generator) + 0.5)
                if module.affine:
                    module.weight.copy_(torch.randn(features, generator=generator))
                    module.bias.copy_(torch.randn(features, generator=generator))
    return model


class ConvOutputReused(nn.Module):
    """A conv whose raw output is also read on a path without the BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


class ShapeBranch(nn.Module):
    """Python control flow on a shape: symbolic_trace cannot follow it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if y.shape[-1] > 2:
            y = torch.relu(y)
        return y


def second_inputs(model: nn.Module, inputs: tuple[Any, ...], vary_batch: bool = True) -> tuple[Any, ...]:
    """An input unlike ``inputs`` that ``model`` accepts: another batch size, fresh values, other strides where it can.

    The one graphopt verifies on (`graphopt.validate.SecondInputs`): the first of its
    candidates, most different first, that the eager model runs on with usable outputs.
    """
    dims = dynamic.requested("batch+sequence" if vary_batch else None, inputs, [f"input{i}" for i in range(len(inputs))])
    accepted = SecondInputs(copy.deepcopy(model), inputs, dims, gradients=False)
    check = next(iter(accepted), None)
    assert check is not None, f"the model accepts no second input: {accepted.refused}"
    return check.args


def _outputs(result: Any) -> list[Any]:
    return [leaf for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)]


def assert_same_outputs(model: nn.Module, optimized: Any, inputs: tuple[Any, ...], tolerance: float = 1e-5, vary_batch: bool = True) -> None:
    """``optimized`` computes what ``model`` does on ``inputs`` and on a second input (`second_inputs`).

    Errors are relative to each output's scale (``tolerance=0``: bit for bit); ``model`` runs
    first, on a copy (its buffers stay as they are), so an ``optimized`` that writes into its
    inputs shows as a wrong output.
    """
    for args in (inputs, second_inputs(model, inputs, vary_batch)):
        with torch.no_grad():
            torch.manual_seed(3)
            expected = _outputs(copy.deepcopy(model)(*args))
            torch.manual_seed(3)
            actual = _outputs(optimized(*args))
        assert len(expected) == len(actual)
        for want, got in zip(expected, actual, strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype, f"{tuple(got.shape)} {got.dtype} instead of {tuple(want.shape)} {want.dtype}"
            if want.is_floating_point() and tolerance > 0:
                assert relative_error(want.float(), got.float()) < tolerance, f"on {'the example' if args is inputs else 'a second input'}"
            else:
                assert torch.equal(want, got), f"not exactly equal on {'the example' if args is inputs else 'a second input'}"


def assert_trains_like(model: nn.Module, optimized: nn.Module, inputs: tuple[Any, ...], tolerance: float = 1e-5, vary_batch: bool = True) -> None:
    """Forward (same dropout masks) and the gradients of a random projection of the outputs match a copy of ``model``.

    Checked on ``inputs`` and on a second input (`second_inputs`). The same parameters
    must receive gradients, except those ``optimized`` no longer has (a pass removed
    them, e.g. a dropped conv bias). Gradients are compared with graphopt's own rule
    (`graphopt.verify.compare_gradients`: each at its scale, floored at 1% of the largest;
    a float32 mismatch must persist in float64, `graphopt.verify.confirm_gradients`).
    """
    for args in (inputs, second_inputs(model, inputs, vary_batch)):
        reference = copy.deepcopy(model)
        expected = run_reference(reference, args, gradients=True)
        actual = run_reference(optimized, args, gradients=True)
        for want, got in zip(_outputs(expected.outputs), _outputs(actual.outputs), strict=True):
            assert relative_error(want, got) < tolerance
        assert expected.gradients is not None and actual.gradients is not None
        removed = set(expected.gradients) - set(actual.gradients)
        graph = getattr(optimized, "graph_module", optimized)  # in float64 (confirm_gradients), past the module's input guard
        comparison = confirm_gradients(compare_gradients(expected.gradients, actual.gradients, tolerance, removed), model, graph, args, removed)
        assert comparison.ok, f"{comparison.where}: {comparison.detail} (error {comparison.max_error:.2e})"

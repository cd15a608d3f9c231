"""The pass registry: every pass has a test file, a description, and its metadata holds (presets, order, state changes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphopt
from graphopt.checkpoint import DroppedBias
from graphopt.models import REFERENCE_MODELS
from graphopt.passes import REGISTRY, PassContext, PassInfo, PassResult
from graphopt.passes.base import finish
from graphopt.pipeline import PRESETS
from graphopt.report import PassReport
from tests.conftest import captured, context

HERE = Path(__file__).parent


def test_every_registered_pass_has_a_test_file() -> None:
    missing = [name for name in REGISTRY if not (HERE / f"test_{name}.py").is_file()]
    assert missing == []


def test_every_pass_lives_in_a_module_named_after_it() -> None:
    for name, info in REGISTRY.items():
        assert info.function.__module__ == f"graphopt.passes.{name}"
        assert info.function.__name__ == name


def test_list_passes_describes_each_pass() -> None:
    infos = graphopt.list_passes()
    assert [info.name for info in infos] == list(REGISTRY)
    for info in infos:
        assert info.description and info.modes
        assert set(info.modes) <= {"inference", "training"}


def test_presets_name_registered_passes_of_their_mode() -> None:
    for mode, names in PRESETS.items():
        for name in names:
            assert mode in REGISTRY[name].modes
            assert REGISTRY[name].exact, "presets run by default: only exact passes belong there"


def test_the_registry_order_honours_each_pass_ordering_constraints() -> None:
    names = list(REGISTRY)
    lowering = [name for name, info in REGISTRY.items() if info.lowers_precision]
    assert len(lowering) == 1
    for name, info in REGISTRY.items():
        if info.after_precision:
            assert names.index(name) > names.index(lowering[0]), name
    last = [name for name, info in REGISTRY.items() if info.runs_last]
    assert last and names[-len(last) :] == last, "passes that run last are the registry's last entries"


def test_opt_in_passes_are_the_ones_no_preset_runs() -> None:
    for name, info in REGISTRY.items():
        assert set(info.presets) <= set(info.modes), name
        if info.lowers_precision or info.quantizes or info.fuse == "regions":
            assert not info.presets, f"{name} is added by an option, not by a preset"
        if info.cpu_kernels and info.presets:  # CPU-specific kernels run by default only where they measure faster
            assert info.measured and info.preset_only_measured, name
        if info.onnx == "inexpressible":
            assert info.cpu_kernels or info.quantizes, name


@pytest.mark.parametrize("model_name", ["resnet", "transformer"])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_passes_that_do_not_declare_state_changes_leave_stored_tensors_alone(model_name: str, mode: str) -> None:
    """``changes_state=False`` is a promise: the keys, shapes and dtypes of the stored tensors stay as they were."""
    reference = REFERENCE_MODELS[model_name]
    model = reference.build().train(mode == "training")
    inputs = reference.example_inputs(batch_size=2)
    checked = 0
    for name, info in REGISTRY.items():
        if info.changes_state or mode not in info.modes:
            continue
        gm = captured(model, inputs, "fx")
        before = {key: (value.shape, value.dtype) for key, value in gm.state_dict().items()}
        result = info.function(gm, context(inputs, mode))
        after = {key: (value.shape, value.dtype) for key, value in result.graph_module.state_dict().items()}
        assert after == before, name
        assert not result.report.state_changes, name
        checked += 1
    assert checked >= 5


def test_the_pipeline_refuses_undeclared_state_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    def drops_a_bias(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        report = PassReport("drops_a_bias")
        report.state_changes.append(DroppedBias("0.bias", "0.weight", None, 2, "1"))
        return finish(gm, False, report)

    monkeypatch.setitem(REGISTRY, "drops_a_bias", PassInfo("drops_a_bias", drops_a_bias, ("inference",), "test pass"))
    model = nn.Sequential(nn.Conv2d(3, 2, 1), nn.BatchNorm2d(2)).eval()
    with pytest.raises(graphopt.GraphoptError, match="changes_state"):
        graphopt.optimize(model, torch.randn(1, 3, 4, 4), passes=["drops_a_bias"])

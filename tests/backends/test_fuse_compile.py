"""optimize(fuse=...): regions compiled by torch.compile or TorchScript, or the whole graph; numerics, sharing, recompilation, fallback."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.backends import fuse_compile
from graphopt.backends.fuse_compile import FusedRegion
from graphopt.errors import InvalidOptionError
from tests.conftest import FRONTENDS


class Block(nn.Module):
    """silu(conv1(x) + conv2(x)) * 0.5 + x: one region of four ops with two conv inputs and x."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.conv1(x) + self.conv2(x)) * 0.5 + x


def two_blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()).eval()


def inputs(batch: int = 4) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 4, 6, 6, generator=torch.Generator().manual_seed(batch)),)


def fused_regions(optimized: graphopt.OptimizedModule) -> dict[str, FusedRegion]:
    return {name: module for name, module in optimized.graph_module.named_children() if isinstance(module, FusedRegion)}


@pytest.fixture(scope="module")
def inductor_model() -> graphopt.OptimizedModule:
    # compilations are counted below: Dynamo's caches start empty, whatever the worker compiled before (a clean-clone
    # make test once counted 3 per region here after other files' compilations in the same worker)
    torch._dynamo.reset()
    return graphopt.optimize(two_blocks(), inputs(), fuse="inductor")


def test_inductor_regions_match_unfused(inductor_model: graphopt.OptimizedModule) -> None:
    unfused = graphopt.optimize(two_blocks(), inputs())
    fusion = inductor_model.graphopt_report.fusion
    assert fusion is not None and fusion.backend == "inductor"
    assert [region.ops for region in fusion.regions] == [["add", "silu", "mul", "add"]] * 2
    assert all(region.status != "eager" for region in fusion.regions)
    for batch in (4, 7):
        torch.testing.assert_close(inductor_model(*inputs(batch)), unfused(*inputs(batch)), rtol=1e-5, atol=1e-5)


def test_identical_regions_share_one_artifact(inductor_model: graphopt.OptimizedModule) -> None:
    first, second = inductor_model.graphopt_report.fusion.regions
    assert (first.status, second.status, second.shares_with) == ("compiled", "shared", first.name)
    compile_times = (first.compile_seconds, second.compile_seconds)
    assert compile_times[0] > 0 and compile_times[1] == 0  # the shared region compiled nothing of its own
    compiled = {id(region.compiled) for region in fused_regions(inductor_model).values()}
    assert len(compiled) == 1


def test_other_batch_sizes_do_not_recompile(inductor_model: graphopt.OptimizedModule) -> None:
    from torch._dynamo.utils import guard_failures

    for batch in (4, 9, 2, 5):
        inductor_model(*inputs(batch))
    # the guards that failed say why Dynamo compiled again (a clean-clone make test once counted 3 per region here)
    assert [region.compilations for region in fused_regions(inductor_model).values()] == [1, 1], dict(guard_failures)


def test_inference_and_ordinary_tensors_share_one_compilation() -> None:
    from torch._dynamo.utils import guard_failures

    # without channels_last (a measured decision, kept or not by the timing: under a loaded make test it once was not),
    # the first block's region is fed the caller's own tensor, while the region sharing its artifact is fed an intermediate
    # (an inference tensor under inference mode): Dynamo's guards on the tensors' dispatch keys once compiled the shared
    # artifact again for the other kind, with the batch size static, and again for the next batch size (3 per region)
    optimized = graphopt.optimize(two_blocks(), inputs(), fuse="inductor", disable=["to_channels_last"])
    placeholder = next(node for node in optimized.graph.nodes if node.op == "placeholder")
    assert any(user.op == "call_module" and str(user.target) in fused_regions(optimized) for user in placeholder.users)
    unfused = graphopt.optimize(two_blocks(), inputs(), disable=["to_channels_last"])
    for inference_mode in (True, False):  # False: forward runs under torch.no_grad(), its intermediates ordinary tensors
        optimized.inference_mode = inference_mode
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                for batch in (4, 9, 2, 5):
                    ordinary = inputs(batch)
                    with torch.inference_mode():
                        inference = tuple(t.clone() for t in ordinary)
                    for args in (ordinary, inference):
                        output = optimized(*args)
                        assert output.is_inference() == inference_mode
                        torch.testing.assert_close(output, unfused(*ordinary), rtol=1e-5, atol=1e-5)
    assert [region.compilations for region in fused_regions(optimized).values()] == [1, 1], dict(guard_failures)


def test_state_dict_and_report(inductor_model: graphopt.OptimizedModule) -> None:
    assert set(inductor_model.state_dict()) == set(graphopt.optimize(two_blocks(), inputs()).state_dict())
    text = str(inductor_model.graphopt_report)
    assert "fusion (inductor): 2/2 regions compiled into 1 artifacts" in text
    assert "shares pointwise_region_0's artifact" in text
    assert inductor_model.graphopt_report.to_dict()["fusion"]["regions"][0]["status"] == "compiled"


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_torchscript_regions_match_unfused(frontend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fuse_compile, "_torchscript_warned", False)
    with pytest.warns(FutureWarning, match="deprecated"):
        optimized = graphopt.optimize(two_blocks(), inputs(), fuse="torchscript", frontend=frontend)
    fusion = optimized.graphopt_report.fusion
    assert [region.status for region in fusion.regions] == ["compiled", "shared"]
    assert all(isinstance(region.compiled, torch.jit.ScriptModule) for region in fused_regions(optimized).values())
    unfused = graphopt.optimize(two_blocks(), inputs(), frontend=frontend)
    for batch in (4, 7):
        torch.testing.assert_close(optimized(*inputs(batch)), unfused(*inputs(batch)), rtol=1e-5, atol=1e-5)


def test_torchscript_deprecation_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fuse_compile, "_torchscript_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphopt.optimize(two_blocks(), inputs(), fuse="torchscript")
        graphopt.optimize(two_blocks(), inputs(), fuse="torchscript")
    said = [w for w in caught if "fuse='torchscript'" in str(w.message)]
    assert len(said) == 1 and said[0].category is FutureWarning
    assert not [w for w in caught if "torch.jit.script` is deprecated" in str(w.message)]  # torch's own, said by us instead


def test_a_failing_backend_leaves_the_region_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler(backend: str, module: nn.Module) -> None:
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(fuse_compile, "_make_compiled", no_compiler)
    optimized = graphopt.optimize(two_blocks(), inputs(), fuse="inductor")
    fusion = optimized.graphopt_report.fusion
    assert [region.status for region in fusion.regions] == ["eager", "eager"]
    assert all("no working C++ compiler found" in region.reason for region in fusion.regions)
    assert "eager: inductor failed: RuntimeError: no working C++ compiler found" in str(optimized.graphopt_report)
    torch.testing.assert_close(optimized(*inputs()), two_blocks()(*inputs()), rtol=1e-5, atol=1e-5)


def test_a_compiled_region_that_fails_later_falls_back_with_a_warning() -> None:
    optimized = graphopt.optimize(two_blocks(), inputs(), fuse="torchscript")

    def broken(*args: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("recompilation failed")

    region = fused_regions(optimized)["pointwise_region_0"]
    region.use(broken)
    with pytest.warns(RuntimeWarning, match="recompilation failed"):
        output = optimized(*inputs())
    torch.testing.assert_close(output, two_blocks()(*inputs()), rtol=1e-5, atol=1e-5)
    assert region.compiled is None and "recompilation failed" in region.fallback_reason


def test_wrong_inputs_raise_the_users_error_and_keep_the_kernel() -> None:
    optimized = graphopt.optimize(two_blocks(), inputs(), fuse="torchscript")
    region = fused_regions(optimized)["pointwise_region_0"]
    with pytest.raises(RuntimeError):
        region(torch.ones(2, 4, 6, 6), torch.ones(2, 4, 5, 5), torch.ones(2, 4, 6, 6))  # shapes that cannot broadcast
    assert region.compiled is not None


def test_copies_run_the_regions_eagerly(inductor_model: graphopt.OptimizedModule) -> None:
    copied = copy.deepcopy(inductor_model)
    assert all(region.compiled is None for region in fused_regions(copied).values())
    torch.testing.assert_close(copied(*inputs()), inductor_model(*inputs()), rtol=1e-5, atol=1e-5)
    assert all(region.compiled is not None for region in fused_regions(inductor_model).values())


def test_export_onnx_exports_the_eager_regions(tmp_path: Path, inductor_model: graphopt.OptimizedModule) -> None:
    report = graphopt.export_onnx(inductor_model, inputs(), tmp_path / "fused.onnx", optimize=False, compare_plain=False)
    assert (tmp_path / "fused.onnx").exists() and report.max_error is not None


@pytest.mark.slow
def test_whole_graph_hand_off() -> None:
    optimized = graphopt.optimize(two_blocks(), inputs(), fuse="graph")
    fusion = optimized.graphopt_report.fusion
    assert [(region.name, region.status) for region in fusion.regions] == [("graph", "compiled")]
    assert not fused_regions(optimized)  # no regions: the whole graph is compiled
    unfused = graphopt.optimize(two_blocks(), inputs())
    for batch in (4, 7, 3):
        torch.testing.assert_close(optimized(*inputs(batch)), unfused(*inputs(batch)), rtol=1e-5, atol=1e-5)
    assert optimized._runner.compilations == 1


def test_training_gradients_match_the_original() -> None:
    model = two_blocks().train()
    optimized = graphopt.optimize(model, inputs(), mode="training", fuse="inductor")
    assert all(region.status != "eager" for region in optimized.graphopt_report.fusion.regions)
    expected, actual = model(*inputs()).square().mean(), optimized(*inputs()).square().mean()
    expected.backward()
    actual.backward()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    gradients = dict(optimized.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(gradients[name].grad, parameter.grad, rtol=1e-4, atol=1e-6)
    assert [region.compilations for region in fused_regions(optimized).values()] == [1, 1]


def test_unknown_fuse_backend() -> None:
    with pytest.raises(InvalidOptionError, match="unknown fuse 'tensorrt'"):
        graphopt.optimize(two_blocks(), inputs(), fuse="tensorrt")


def test_no_regions_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).eval()
    optimized = graphopt.optimize(model, (torch.randn(1, 3, 8, 8),), fuse="inductor")
    assert optimized.graphopt_report.fusion.regions == []
    assert "no pointwise regions" in str(optimized.graphopt_report)

"""extract_pointwise_regions: chains, diamonds, several inputs and outputs become regions; lone ops and visible in-place writes do not."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.models import REFERENCE_MODELS
from graphopt.passes.extract_pointwise_regions import REGION_PREFIX, extract_pointwise_regions
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context


def regions(gm: fx.GraphModule) -> dict[str, fx.GraphModule]:
    return {name: module for name, module in gm.named_children() if name.startswith(REGION_PREFIX)}


def region_ops(region: fx.GraphModule) -> list[str]:
    """The region's computing ops by short name (relu, add, ...), whichever graph form they came from."""
    names = []
    for node in region.graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            names.append(str(name).split(".")[-1] if not isinstance(node.target, torch._ops.OpOverload) else node.target._opname)
    return names


def placeholders(region: fx.GraphModule) -> int:
    return sum(node.op == "placeholder" for node in region.graph.nodes)


def outputs(region: fx.GraphModule) -> int:
    result = region.graph.output_node().args[0]
    return len(result) if isinstance(result, tuple) else 1


class Chain(nn.Module):
    """linear -> relu -> * 2 -> + 1: one region of three ops after the linear."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 2 + 1


class Diamond(nn.Module):
    """y feeds sigmoid and relu, whose results join: one region, one input, one output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return torch.sigmoid(y) * F.relu(y)


class TwoInputs(nn.Module):
    """relu(conv1(x) + conv2(x)): the residual pattern, two region inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv1(x) + self.conv2(x))


class TwoOutputs(nn.Module):
    """a = relu(y + 1) feeds a linear outside the region and a * 2 inside it: two region outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = F.relu(self.linear1(x) + 1)
        return self.linear2(a), a * 2


class LoneActivations(nn.Module):
    """conv -> relu -> conv -> relu: no two pointwise ops touch, so nothing to fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.relu(self.conv1(x))))


SHAPES = {  # model, inputs, expected ops per region, inputs and outputs of the one region
    "chain": (Chain, (4, 8), ["relu", "mul", "add"], 1, 1),
    "diamond": (Diamond, (4, 8), ["sigmoid", "relu", "mul"], 1, 1),
    "two inputs": (TwoInputs, (2, 3, 6, 6), ["add", "relu"], 2, 1),
    "two outputs": (TwoOutputs, (4, 8), ["add", "relu", "mul"], 1, 2),
}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_region_shapes(shape: str, frontend: str) -> None:
    make, input_shape, ops, region_inputs, region_outputs = SHAPES[shape]
    model = make().eval()
    inputs = (torch.randn(input_shape),)
    gm = captured(model, inputs, frontend)
    result = extract_pointwise_regions(gm, context(inputs))
    assert result.modified and len(result.report.rewrites) == 1
    (region,) = regions(gm).values()
    assert sorted(region_ops(region)) == sorted(ops)
    assert (placeholders(region), outputs(region)) == (region_inputs, region_outputs)
    assert not list(region.parameters()) and not list(region.buffers())  # stored tensors stay outside
    assert f"{len(ops)} ops" in result.report.rewrites[0].detail
    assert_same_outputs(model, gm, inputs, tolerance=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_lone_op_is_no_region(frontend: str) -> None:
    model = LoneActivations().eval()
    inputs = (torch.randn(1, 3, 8, 8),)
    gm = captured(model, inputs, frontend)
    result = extract_pointwise_regions(gm, context(inputs))
    assert not result.modified and not regions(gm)
    assert len(result.report.skips) == 2
    assert all("lone pointwise op" in skip.reason for skip in result.report.skips)


class LayerScaleResidual(nn.Module):
    """ConvNeXt's tail: x + gamma * y.permute(...): the permute joins the mul and the add."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(4))
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gamma * self.linear(x.permute(0, 2, 3, 1))
        return x + y.permute(0, 3, 1, 2)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_views_inside_a_region_join_it_and_views_at_its_edges_do_not(frontend: str) -> None:
    model = LayerScaleResidual().eval()
    inputs = (torch.randn(2, 4, 3, 3),)
    gm = captured(model, inputs, frontend)
    extract_pointwise_regions(gm, context(inputs))
    (region,) = regions(gm).values()
    assert region_ops(region) == ["mul", "permute", "add"]
    assert "gamma" in {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}  # the parameter is a region input
    assert_same_outputs(model, gm, inputs, tolerance=0)


class InPlaceUnseen(nn.Module):
    """nn.ReLU(inplace=True) on a value nothing else reads: computed out of place inside the region."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.linear(x) + 1) * 3


def test_in_place_op_whose_input_nothing_else_reads_is_fused_out_of_place() -> None:
    model = InPlaceUnseen().eval()
    inputs = (torch.randn(4, 8),)
    gm = captured(model, inputs, "fx")
    extract_pointwise_regions(gm, context(inputs))
    (region,) = regions(gm).values()
    relu = next(node for node in region.graph.nodes if node.target is F.relu)
    assert relu.kwargs.get("inplace", False) is False
    assert "relu" not in dict(gm.named_modules())  # the module call became a function call
    assert_same_outputs(model, gm, inputs, tolerance=0)


class InPlaceSeen(nn.Module):
    """F.relu(y, inplace=True) while y is read again afterwards: the write is visible."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        z = F.relu(y, inplace=True)
        return (z + 1) * y


def test_in_place_op_whose_write_is_visible_stays() -> None:
    model = InPlaceSeen().eval()
    inputs = (torch.randn(4, 8),)
    gm = captured(model, inputs, "fx")
    result = extract_pointwise_regions(gm, context(inputs))
    assert any("read again" in skip.reason for skip in result.report.skips)
    for region in regions(gm).values():
        assert "relu" not in region_ops(region)
    assert_same_outputs(model, gm, inputs, tolerance=0)


class SizeArithmetic(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.size(0) * x.size(1), -1).relu()


def test_size_arithmetic_is_not_fused() -> None:
    inputs = (torch.randn(2, 3, 4),)
    gm = captured(SizeArithmetic(), inputs, "fx")
    result = extract_pointwise_regions(gm, context(inputs))
    assert any("floating-point tensor" in skip.reason for skip in result.report.skips)
    assert not result.modified


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", ["resnet", "convnext"])
def test_reference_models(name: str, frontend: str) -> None:
    reference = REFERENCE_MODELS[name]
    model, inputs = reference.build().eval(), reference.example_inputs(2)
    gm = captured(model, inputs, frontend)
    result = extract_pointwise_regions(gm, context(inputs))
    # resnet: a residual add + relu per block; convnext: a layer-scale mul + permute + residual add per block
    expected = {"resnet": ["add", "relu"], "convnext": ["mul", "permute", "add"]}[name]
    assert regions(gm) and all(region_ops(region) == expected for region in regions(gm).values())
    assert_same_outputs(model, gm, inputs, tolerance=0)

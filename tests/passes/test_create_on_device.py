"""create_on_device: factory + move becomes one factory call; moved constants are stored where they are used.

A CPU-only machine has no second device to run on: the rewrites are checked for
numerics with CPU-to-CPU moves (and casts), and for structure with torch.export graphs
captured on the 'meta' device, whose factories are created on the CPU and moved to meta.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from graphopt.ops import factory_view, transfer_view
from graphopt.passes.create_on_device import create_on_device
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context


def moves(gm) -> list:
    return [node for node in gm.graph.nodes if transfer_view(gm, node) is not None]


def factories(gm) -> dict:
    return {node.name: node.kwargs for node in gm.graph.nodes if factory_view(gm, node) is not None}


def on_meta(model: nn.Module, x: torch.Tensor):
    """A graph torch.export captured with inputs on 'meta': factories on the CPU, then moved."""
    return torch.export.export(model.to("meta"), (x.to("meta"),), strict=False).module()


class Filled(nn.Module):
    """Factories whose values do not depend on device or dtype, each moved to the input's device and dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.zeros(2, 4).to(x.device)
        b = torch.full((2, 4), 3.0, dtype=torch.float64).to(x.device, torch.float32)
        c = torch.ones_like(x, dtype=torch.float64).to(x)
        d = x.new_ones(2, 4).to(x.device)
        e = torch.eye(4)[:2].to(x) * 0 + torch.arange(4).to(x)
        return x + a + b + c + d + e


def test_factories_on_the_cpu_are_created_with_the_move_arguments_export() -> None:
    model, x = Filled(), torch.randn(2, 4)
    gm = captured(model, (x,), "export")
    report = create_on_device(gm, context((x,))).report
    created = {r.node for r in report.rewrites}
    assert created == {"zeros", "full", "ones_like", "new_ones", "arange"}, report
    assert factories(gm)["full"]["dtype"] == torch.float32 and factories(gm)["ones_like"]["dtype"] == torch.float32
    assert len(moves(gm)) == 1  # eye()[:2] is sliced before its move: not a factory's own move
    assert_same_outputs(model, gm, (x,), tolerance=0)


def test_like_factories_take_the_device_read_at_run_time_fx() -> None:
    model, x = Filled(), torch.randn(2, 4)
    gm = captured(model, (x,), "fx")
    report = create_on_device(gm, context((x,))).report
    assert {"ones_like", "new_ones"} <= {r.node for r in report.rewrites}
    kwargs = factories(gm)
    assert kwargs["new_ones"]["device"].target is getattr and kwargs["new_ones"]["device"].args == (gm.graph.find_nodes(op="placeholder")[0], "device")
    assert kwargs["ones_like"]["dtype"].args[1] == "dtype"  # .to(x): x's dtype, read at run time
    assert_same_outputs(model, gm, (x,), tolerance=0)
    assert_same_outputs(model, gm, (x.double(),), tolerance=0)  # still follows the input's dtype


def test_factories_created_on_the_cpu_are_created_on_the_target_device() -> None:
    x = torch.randn(2, 4)
    gm = on_meta(Filled(), x)
    report = create_on_device(gm, context((x.to("meta"),))).report
    assert "(cpu -> meta" in next(r.detail for r in report.rewrites if r.node == "zeros")
    for name in ("zeros", "full", "ones_like"):
        assert factories(gm)[name]["device"] == torch.device("meta")
    out = gm(x.to("meta"))
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (2, 4)


class Constants(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).to(x)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_moved_constant_is_stored_in_the_dtype_it_is_used_in(frontend: str) -> None:
    model, x = Constants(), torch.randn(2, 4)
    gm = captured(model, (x,), frontend)
    report = create_on_device(gm, context((x,))).report
    assert len(report.rewrites) == 1 and "stored on cpu as torch.float32" in report.rewrites[0].detail
    constants = [t for name, t in [*gm.named_buffers(), *vars(gm).items()] if "constant" in name or "lifted" in name]
    assert [t.dtype for t in constants if isinstance(t, torch.Tensor)] == [torch.float32]
    # export names the dtype in the graph: the move goes; fx reads it from x at run time: the no-op move stays
    assert len(moves(gm)) == (1 if frontend == "fx" else 0)
    assert_same_outputs(model, gm, (x,), tolerance=0)


def test_a_moved_export_constant_is_stored_on_the_target_device() -> None:
    x = torch.randn(2, 4)
    gm = on_meta(Constants(), x)
    report = create_on_device(gm, context((x.to("meta"),))).report
    assert "(cpu -> meta, torch.float64 -> torch.float32)" in report.rewrites[0].detail
    assert gm.lifted_tensor_0.device.type == "meta" and moves(gm) == []
    assert gm(x.to("meta")).device.type == "meta"


# --------------------------------------------------------------------------- guards


def test_guard_random_factory_moved_to_another_device() -> None:
    class Noise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.randn(2, 4).to(x.device)

    x = torch.randn(2, 4)
    gm = on_meta(Noise(), x)
    report = create_on_device(gm, context((x.to("meta"),))).report
    assert report.rewrites == [] and "random factory moved (cpu -> meta)" in report.skips[0].reason
    assert factories(gm)["randn"]["device"] == torch.device("cpu")


def test_guard_random_factory_cast_to_another_dtype() -> None:
    class Noise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x).double()

    x = torch.randn(2, 4)
    gm = captured(Noise(), (x,), "export")
    report = create_on_device(gm, context((x,))).report
    assert report.rewrites == [] and "random factory moved (torch.float32 -> torch.float64)" in report.skips[0].reason


def test_guard_arange_cast_to_a_dtype_that_rounds() -> None:
    class Positions(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(0, 1, 0.25, dtype=torch.float64).to(x) + torch.arange(4).to(x)

    model, x = Positions(), torch.randn(2, 4)
    gm = captured(model, (x,), "export")
    report = create_on_device(gm, context((x,))).report
    assert [r.node for r in report.rewrites] == ["arange_1"]  # integer arange(4): exact in float32
    assert "may round differently" in report.skips[0].reason
    assert_same_outputs(model, gm, (x,), tolerance=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_created_tensor_also_used_before_the_move(frontend: str) -> None:
    class Both(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ones = torch.ones_like(x, dtype=torch.float64)
            return ones.sum() + ones.to(x)

    model, x = Both(), torch.randn(2, 4)
    gm = captured(model, (x,), frontend)
    report = create_on_device(gm, context((x,))).report
    assert report.rewrites == [] and "also used before the move" in report.skips[0].reason
    assert_same_outputs(model, gm, (x,))


def test_guard_move_that_changes_the_memory_format() -> None:
    class Layout(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x).to(x.device, memory_format=torch.channels_last) + x

    x = torch.randn(2, 3, 4, 4)
    gm = captured(Layout(), (x,), "fx")
    report = create_on_device(gm, context((x,))).report
    assert report.rewrites == [] and "memory format" in report.skips[0].reason


def test_guard_model_buffer_moved_in_forward() -> None:
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.table.to(x)

    model, x = Table(), torch.randn(2, 4)
    gm = captured(model, (x,), "fx")
    report = create_on_device(gm, context((x,))).report
    assert report.rewrites == [] and "parameter or buffer" in report.skips[0].reason
    assert gm.table.dtype == torch.float64


def test_guard_constant_read_elsewhere() -> None:
    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            table = torch.tensor([1.0, 2.0], dtype=torch.float64)
            return x + table.to(x) * table.to(x.device, torch.float32)

    model, x = Twice(), torch.randn(2, 2)
    gm = captured(model, (x,), "fx")
    report = create_on_device(gm, context((x,))).report
    assert report.rewrites == [] and "also" in report.skips[0].reason
    assert_same_outputs(model, gm, (x,))


def test_nothing_to_do_leaves_the_graph_alone() -> None:
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4)
    gm = captured(model, (x,), "fx")
    code = gm.code
    result = create_on_device(gm, context((x,)))
    assert not result.modified and result.report.skips == [] and gm.code == code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_factories_are_created_on_the_gpu() -> None:
    model, x = Filled().cuda(), torch.randn(2, 4, device="cuda")
    gm = captured(model, (x,), "export")
    # export on CUDA bakes the CPU factory then the move to cuda into the graph
    create_on_device(gm, context((x,)))
    assert factories(gm)["zeros"]["device"].type == "cuda"
    assert_same_outputs(model, gm, (x,), tolerance=0)

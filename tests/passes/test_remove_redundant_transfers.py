"""remove_redundant_transfers: no-op moves and round trips go, host-to-device copies become non_blocking.

Without a GPU, round trips and no-op moves are checked with CPU moves and casts (exact
numerics), and host-to-device copies with torch.export graphs captured on 'meta'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from graphopt.ops import transfer_view
from graphopt.passes.remove_redundant_transfers import remove_redundant_transfers
from tests.conftest import FRONTENDS, assert_same_outputs, captured, context


def moves(gm) -> list:
    return [transfer_view(gm, node) for node in gm.graph.nodes if transfer_view(gm, node) is not None]


def run_pass(model: nn.Module, x: torch.Tensor, frontend: str):
    """Run the pass on ``model`` captured by ``frontend``; the outputs must stay exactly the model's."""
    gm = captured(model, (x,), frontend)
    report = remove_redundant_transfers(gm, context((x,))).report
    assert_same_outputs(model, gm, (x,), tolerance=0)  # only moves and casts that change no value are dropped
    return gm, report


class NoOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.cpu()).to(x.device).float()
        return y.to(x) + x.to(torch.float32)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_no_op_moves_and_casts_are_removed(frontend: str) -> None:
    gm, report = run_pass(NoOps(), torch.randn(2, 4), frontend)
    assert moves(gm) == []
    assert len(report.rewrites) == 5 and all("no-op move/cast" in r.detail for r in report.rewrites)


class RoundTrips(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cpu().to(x.device) * 2 + x.double().float() * 3


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_round_trips_are_replaced_by_their_start(frontend: str) -> None:
    gm, report = run_pass(RoundTrips(), torch.randn(2, 4), frontend)
    assert moves(gm) == []
    assert any("round trip" in r.detail for r in report.rewrites)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_lossy_round_trip_is_kept(frontend: str) -> None:
    class Rounding(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.half().float()  # rounds to fp16: not a no-op

    gm, report = run_pass(Rounding(), torch.randn(2, 4), frontend)
    assert [m.dtype for m in moves(gm)] == [torch.float16, torch.float32]
    assert report.rewrites == []


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_copy_requested(frontend: str) -> None:
    class Copy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.float32, copy=True) * 2

    gm, report = run_pass(Copy(), torch.randn(2, 4), frontend)
    assert len(moves(gm)) == 1 and "copy=True" in report.skips[0].reason


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_round_trip_copy_written_in_place(frontend: str) -> None:
    class Scratch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.double().float()
            y.mul_(2)  # without the copy this would change x
            return x + y

    gm, report = run_pass(Scratch(), torch.randn(2, 4), frontend)
    assert "written in place" in report.skips[0].reason


def test_guard_round_trip_result_returned() -> None:
    class Copied(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.double().float()

    x = torch.randn(2, 4)
    gm = captured(Copied(), (x,), "fx")
    report = remove_redundant_transfers(gm, context((x,))).report
    assert "returned by the model" in report.skips[0].reason
    first, second = gm(x)
    assert second.data_ptr() != first.data_ptr()


def test_guard_move_memory_format() -> None:
    class Layout(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(x.device, memory_format=torch.channels_last) + 1

    gm, report = run_pass(Layout(), torch.randn(2, 3, 4, 4), "fx")
    assert len(moves(gm)) == 1 and "memory format" in report.skips[0].reason


def test_guard_fixed_device_constant_moved_to_run_time_device() -> None:
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.arange(4.0)  # a plain attribute: torch.export keeps it on the CPU

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.table.to(x.device)

    model, x = Table(), torch.randn(2, 4)
    gm = captured(model, (x,), "fx")
    # symbolic_trace stores the constant as a buffer, which follows module.to(): the no-op move can go
    assert remove_redundant_transfers(gm, context((x,))).report.rewrites
    exported = torch.export.export(model, (x,), strict=False).module()
    exported.graph.eliminate_dead_code()
    # export writes the move's device as a constant: make it read x.device at run time, as fx code does
    move = next(m for m in moves(exported))
    with exported.graph.inserting_before(move.node):
        device = exported.graph.call_function(getattr, (exported.graph.find_nodes(op="placeholder")[0], "device"))
    move.node.kwargs = {**move.node.kwargs, "device": device}
    exported.recompile()
    report = remove_redundant_transfers(exported, context((x,))).report
    assert report.rewrites == [] and "device is fixed in the graph" in report.skips[0].reason


class HostWork(nn.Module):
    """A table computed on the host in forward, then copied to the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.arange(4.0)  # plain attribute: torch.export keeps it where it is (the CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.table * 2).to(x.device) + x.to(x.device)


def test_host_to_device_copy_of_a_forward_value_is_non_blocking() -> None:
    x = torch.randn(2, 4, device="meta")
    gm = torch.export.export(HostWork().to("meta"), (x,), strict=False).module()
    gm.table = torch.arange(4.0)  # .to("meta") moved it; the model keeps it on the host
    report = remove_redundant_transfers(gm, context((x,))).report
    (copy,) = moves(gm)
    assert copy.non_blocking and copy.device == torch.device("meta")
    assert any("(cpu -> meta) made non_blocking" in r.detail for r in report.rewrites)
    assert gm(x).device.type == "meta"


def test_guard_non_blocking_copy_of_a_graph_input() -> None:
    class Upload(nn.Module):
        def forward(self, x: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
            return x + host.to(x.device)

    x, host = torch.randn(2, 4, device="meta"), torch.randn(2, 4)
    gm = torch.export.export(Upload(), (x, host), strict=False).module()
    report = remove_redundant_transfers(gm, context((x, host))).report
    assert not moves(gm)[0].non_blocking and "may overwrite while the copy runs" in report.skips[0].reason


def test_guard_non_blocking_copy_of_a_value_written_afterwards() -> None:
    class Reused(nn.Module):
        def forward(self, x: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
            scratch = host * 2
            y = scratch.to(x.device)
            scratch.add_(1)
            return x + y

    x, host = torch.randn(2, 4, device="meta"), torch.randn(2, 4)
    gm = torch.export.export(Reused(), (x, host), strict=False).module()
    report = remove_redundant_transfers(gm, context((x, host))).report
    assert not [m for m in moves(gm) if m.non_blocking]
    assert any("written in place" in s.reason for s in report.skips)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_round_trip_and_non_blocking_copy() -> None:
    class Gpu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.arange(4.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.cpu().cuda() + (self.table * 2).to(x.device)

    gm, report = run_pass(Gpu(), torch.randn(2, 4, device="cuda"), "export")
    assert any("round trip" in r.detail for r in report.rewrites)
    assert any(m.non_blocking for m in moves(gm))

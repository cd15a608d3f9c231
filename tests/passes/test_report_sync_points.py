"""report_sync_points: every host synchronisation in forward is listed with its source line; nothing changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from graphopt.passes.report_sync_points import report_sync_points
from tests.conftest import FRONTENDS, captured, context


class Syncs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scale = x.sum().item()
        nonzero = x.nonzero()
        host = x.cpu()
        return x * scale, nonzero, x[x > 0], host


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_lists_each_sync_point_with_its_line(frontend: str) -> None:
    x = torch.randn(2, 4)
    gm = captured(Syncs(), (x,), frontend)
    code = gm.code
    result = report_sync_points(gm, context((x,)))
    notes = result.report.notes
    assert not result.modified and gm.code == code
    # torch.export writes x.cpu() of a CPU tensor like x.to(x.device): on a CPU only the fx form tells them apart
    found = 4 if frontend == "fx" else 3
    assert len(notes) == found + 1 and f"{found} sync point(s)" in notes[-1]
    assert "reads a value on the host (.item())" in notes[0] and "test_report_sync_points.py:" in notes[0]
    assert "scale = x.sum().item()" in notes[0]
    assert "nonzero" in notes[1] and "m = x.nonzero()" not in notes[1] and "nonzero = x.nonzero()" in notes[1]
    if frontend == "fx":
        assert "copies to the host" in notes[2] and "host = x.cpu()" in notes[2]
    mask = notes[found - 1]
    assert ("boolean-mask indexing" in mask or "aten.index.Tensor" in mask) and "x[x > 0]" in mask


def test_tolist_and_numpy_are_sync_points() -> None:
    class Host(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[object, object]:
            return x.tolist(), x.numpy()

    x = torch.randn(2, 4)
    gm = torch.fx.symbolic_trace(Host())  # fx records the calls (torch.export cannot trace .numpy())
    notes = report_sync_points(gm, context((x,))).report.notes
    assert any(".tolist()" in n for n in notes) and any(".numpy()" in n for n in notes)


def test_no_sync_points_no_notes() -> None:
    x = torch.randn(2, 4)
    gm = captured(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (x,), "fx")
    assert report_sync_points(gm, context((x,))).report.notes == []

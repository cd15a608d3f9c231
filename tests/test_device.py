"""optimize(device=...): the device the model is optimized for, its checks, and cudnn.benchmark."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.device import enable_cudnn_benchmark, resolve_device
from tests.conftest import captured, model_state


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + torch.zeros(1, 4, 1, 1).to(x.device)


def test_default_device_is_where_the_parameters_are() -> None:
    x = torch.randn(2, 3, 8, 8)
    assert resolve_device(None, ConvNet(), (x,)) == torch.device("cpu")
    assert resolve_device(None, nn.ReLU(), (x.to("meta"),)) == torch.device("meta")  # no parameters: the inputs'


def test_device_option_reaches_the_passes_and_the_report() -> None:
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
    before = model_state(model)
    fast = graphopt.optimize(model, (x,), device="cpu", memory_format="preserve")
    assert model_state(model) == before
    torch.testing.assert_close(fast(x), model(x))
    # the constant's .to(x.device) is a no-op on the device optimized for: removed
    assert len(fast.graphopt_report["remove_redundant_transfers"].rewrites) == 1
    assert not [node for node in fast.graph.nodes if node.target == "to"]


def test_inputs_on_another_device_than_the_option_are_refused() -> None:
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
    with pytest.raises(graphopt.InvalidInputsError, match="are on meta"):
        graphopt.optimize(model, (x.to("meta"),), device="cpu")


def test_bad_device_option_is_refused_with_advice() -> None:
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
    with pytest.raises(graphopt.InvalidOptionError, match="not a torch device"):
        graphopt.optimize(model, (x,), device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(graphopt.InvalidOptionError, match="CUDA is not available"):
            graphopt.optimize(model, (x,), device="cuda")


def test_cudnn_benchmark_is_never_changed_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    fast = graphopt.optimize(ConvNet().eval(), (torch.randn(2, 3, 8, 8),), memory_format="preserve")
    assert torch.backends.cudnn.benchmark is False
    assert not any("cudnn" in note for note in fast.graphopt_report.notes)


def test_cudnn_benchmark_decision_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    x = torch.randn(2, 3, 8, 8)
    cuda = torch.device("cuda", 0)  # the decision reads the graph only: no GPU needed
    assert enable_cudnn_benchmark(captured(nn.Sequential(nn.Linear(8, 8)), (x,), "fx"), cuda) is None  # no conv
    dynamic = enable_cudnn_benchmark(captured(ConvNet(), (x,), "export"), cuda)
    assert dynamic is not None and "dynamic" in dynamic and torch.backends.cudnn.benchmark is False
    static = enable_cudnn_benchmark(captured(ConvNet(), (x,), "fx"), cuda)
    assert static is not None and "enabled" in static and torch.backends.cudnn.benchmark is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_optimize_on_cuda_enables_cudnn_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8, device="cuda")
    fast = graphopt.optimize(model, (x,), device="cuda", memory_format="preserve")
    assert torch.backends.cudnn.benchmark is True
    assert any("cudnn.benchmark enabled" in note for note in fast.graphopt_report.notes)
    torch.testing.assert_close(fast(x), model.cuda()(x))

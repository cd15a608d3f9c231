"""graphopt.data.DevicePrefetcher: the same batches, on the target device; a side-stream copy on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import graphopt
from graphopt.data import DevicePrefetcher


def loader() -> DataLoader:
    data = TensorDataset(torch.arange(20.0).reshape(10, 2), torch.arange(10))
    return DataLoader(data, batch_size=4)


def test_cpu_iteration_yields_the_loader_batches() -> None:
    prefetcher = DevicePrefetcher(loader(), "cpu")
    batches = list(prefetcher)
    expected = list(loader())
    assert len(prefetcher) == 3 and len(batches) == 3
    for (x, y), (ex, ey) in zip(batches, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert len(list(prefetcher)) == 3  # iterable again, like the loader


def test_nested_batches_move_to_another_device_and_other_leaves_pass_through() -> None:
    batches = [{"image": torch.ones(2, 3), "meta": ("id", torch.zeros(2))}]
    (moved,) = DevicePrefetcher(batches, "meta")
    assert moved["image"].device.type == "meta" and moved["meta"][1].device.type == "meta"
    assert moved["meta"][0] == "id"


def test_bad_device_is_refused_with_advice() -> None:
    with pytest.raises(graphopt.InvalidOptionError, match="not a torch device"):
        DevicePrefetcher(loader(), "gpu")
    if not torch.cuda.is_available():
        with pytest.raises(graphopt.InvalidOptionError, match="CUDA is not available"):
            DevicePrefetcher(loader(), "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prefetch_copies_on_a_side_stream() -> None:
    data = TensorDataset(torch.randn(64, 3, 32, 32), torch.arange(64))
    pinned = DataLoader(data, batch_size=8, pin_memory=True)
    batches = list(DevicePrefetcher(pinned, "cuda"))
    assert len(batches) == 8
    for (x, y), (ex, ey) in zip(batches, pinned, strict=True):
        assert x.is_cuda and y.is_cuda
        assert torch.equal(x.cpu(), ex) and torch.equal(y.cpu(), ey)

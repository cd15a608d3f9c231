"""DevicePrefetcher: copy the next batch to the device while the current one is being used.

    from graphopt.data import DevicePrefetcher

    loader = DataLoader(dataset, batch_size=64, num_workers=4, pin_memory=True)
    for inputs, labels in DevicePrefetcher(loader, "cuda"):   # already on the GPU
        loss = criterion(model(inputs), labels)

On CUDA, every tensor of the next batch is copied with ``non_blocking=True`` on a side
stream as soon as the current batch has been handed out, so the copy runs while the
model computes; the main stream waits for the copy only when the batch is used. The copy
overlaps only from pinned memory (``DataLoader(pin_memory=True)``). On other devices
it moves each batch with a plain ``.to(device)`` (a no-op on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from graphopt.errors import InvalidOptionError

__all__ = ["DevicePrefetcher"]

_END = object()


class DevicePrefetcher:
    """Iterate over ``loader``'s batches moved to ``device``, copying the next one while the current one runs.

    Args:
        loader: any iterable of batches (tensors, or tuples/lists/dicts of them; other
            leaves pass through unchanged), typically a ``DataLoader``.
        device: the target device; default ``"cuda"`` when available, else ``"cpu"``.
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise InvalidOptionError(f"device={device!r} is not a torch device: use e.g. 'cuda', 'cuda:1' or 'cpu'") from error
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidOptionError(f"device={device!r} but CUDA is not available: use device='cpu' or leave it None")
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self._move(batch, non_blocking=False)
            return
        yield from self._prefetch_cuda()

    def _move(self, batch: Any, non_blocking: bool) -> Any:
        return pytree.tree_map(lambda leaf: leaf.to(self.device, non_blocking=non_blocking) if isinstance(leaf, torch.Tensor) else leaf, batch)

    def _prefetch_cuda(self) -> Iterator[Any]:
        side = torch.cuda.Stream(self.device)
        batches = iter(self.loader)

        def copy_next() -> Any:
            try:
                batch = next(batches)
            except StopIteration:
                return _END
            with torch.cuda.stream(side):
                return self._move(batch, non_blocking=True)

        upcoming = copy_next()
        while upcoming is not _END:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(side)  # the batch is used only once its copy is done
            for leaf in pytree.tree_leaves(upcoming):
                if isinstance(leaf, torch.Tensor):
                    leaf.record_stream(current)  # its memory is not reused while the main stream still reads it
            batch, upcoming = upcoming, copy_next()
            yield batch

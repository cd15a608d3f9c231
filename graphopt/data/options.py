"""Argument checks that `tune_loader` and `max_batch_size` share: positive integers and the device.

The device is read by `graphopt.device.resolve_device`, as ``optimize(device=...)`` reads
it; only the way out offered when CUDA is asked for and missing is each tool's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from graphopt.device import resolve_device
from graphopt.errors import InvalidOptionError


def positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(f"{name} must be an integer >= 1, got {value!r}; {hint}")
    return value


def checked_device(
    device: str | torch.device | None, model: nn.Module, example_inputs: Any, *, without_cuda: str
) -> torch.device:
    """`resolve_device`, with ``without_cuda`` as the advice when ``device`` asks for CUDA and there is none."""
    try:
        wants_cuda = device is not None and torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        wants_cuda = False  # not a device: resolve_device says so
    if wants_cuda and not torch.cuda.is_available():
        # resolve_device suggests optimize's ways out; each tool has its own (tune_loader can measure loading alone)
        raise InvalidOptionError(f"device={device!r} but CUDA is not available: {without_cuda}")
    return resolve_device(device, model, example_inputs)

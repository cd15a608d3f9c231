"""The device a model is optimized for, and the device-wide settings `optimize` chooses for it.

- `resolve_device`: ``optimize(device=...)``, or where the model's parameters are (the
  example inputs' device for a model without parameters);
- `device_types`: the kinds of device the model's tensors are on (``{"cpu"}`` without any);
- `enable_cudnn_benchmark`: on CUDA, for a graph with convolutions and static input
  shapes, ``torch.backends.cudnn.benchmark = True`` (cuDNN then times its convolution
  algorithms once per input shape and keeps the fastest; with shapes that keep changing
  it would time them again and again). Never changed on other devices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from graphopt.errors import InvalidOptionError
from graphopt.ops import weighted_op_view


def resolve_device(device: str | torch.device | None, model: nn.Module, example_inputs: Any) -> torch.device:
    """The device to optimize for: ``device``, else the model's device (the first input's when it has no parameters or several devices)."""
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise InvalidOptionError(f"device={device!r} is not a torch device: use e.g. 'cpu', 'cuda' or 'cuda:1'") from error
        if target.type == "cuda" and not torch.cuda.is_available():
            raise InvalidOptionError(f"device={device!r} but CUDA is not available here: use device='cpu' or leave device=None")
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        return target
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if len(devices) != 1:  # no parameters, or spread over devices: the device the inputs come on
        inputs = [leaf.device for leaf in pytree.tree_leaves(example_inputs) if isinstance(leaf, torch.Tensor)]
        devices = set(inputs[:1])
    return next(iter(devices), torch.device("cpu"))


def device_types(model: nn.Module) -> set[str]:
    """The device types (``"cpu"``, ``"cuda"``, ...) of the model's parameters and buffers; ``{"cpu"}`` when it has none."""
    return {t.device.type for t in [*model.parameters(), *model.buffers()]} or {"cpu"}


def enable_cudnn_benchmark(gm: fx.GraphModule, device: torch.device) -> str | None:
    """Turn on cudnn.benchmark when it pays (CUDA, convolutions, static input shapes); say what was decided."""
    if device.type != "cuda":
        return None
    if not any((view := weighted_op_view(gm, node)) is not None and view.spatial_dims for node in gm.graph.nodes):
        return None
    dynamic = [
        node.name for node in gm.graph.find_nodes(op="placeholder")
        if isinstance(node.meta.get("val"), torch.Tensor) and not all(map(is_concrete_int, node.meta["val"].shape))
    ]
    if dynamic:
        return (
            f"cudnn.benchmark left {'on' if torch.backends.cudnn.benchmark else 'off'}: the input shapes of "
            f"{', '.join(dynamic)} are dynamic (dynamic_shapes=None makes them static)"
        )
    torch.backends.cudnn.benchmark = True
    return "cudnn.benchmark enabled: the graph has convolutions and static input shapes (cuDNN picks the fastest algorithm per shape)"

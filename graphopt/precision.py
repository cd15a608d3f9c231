"""The precision policy: which low dtypes a device runs, and which op families run in them.

``optimize(precision=..., low_precision_ops=..., fp32_ops=...)`` is checked here before
anything costly runs: `check_precision` turns ``"bf16"``/``"fp16"`` into a dtype the
model's devices have kernels for (or an error naming what they do have), and
`precision_policy` resolves the op families run in that dtype and those kept in fp32
(defaults: `graphopt.passes.use_low_precision`). `runs_on` is what tune asks before
making a low-precision candidate. ``precision="int8"`` is not a dtype the graph computes
in: `check_int8` checks the options it needs (CPU inference, channels_last, no fusion) and
resolves its accuracy budget, `calibration_batches` the batches it calibrates on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.device import device_types
from graphopt.dynamic import Dims
from graphopt.errors import InvalidInputsError, InvalidOptionError
from graphopt.inputs import describe_inputs
from graphopt.ops import PRECISION_FAMILY_NAMES
from graphopt.passes.use_low_precision import DEFAULT_FP32_OPS, DEFAULT_LOW_PRECISION_OPS

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INT8 = "int8"  # not a dtype the graph computes in: `check_int8`, the quantize_int8 pass
DEFAULT_INT8_ACCURACY = 5e-2  # the output error budget of precision="int8" when accuracy= is not given


def check_precision(precision: str, model: nn.Module) -> torch.dtype | None:
    """The low dtype for ``precision`` on the model's device, or an error naming what this device supports."""
    if precision not in PRECISIONS:
        raise InvalidOptionError(f"unknown precision {precision!r}: use one of {', '.join(map(repr, [*PRECISIONS, INT8]))}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return None
    for device in device_types(model):
        if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise InvalidOptionError("precision='bf16' needs a GPU with bfloat16 support (Ampere or newer): use precision='fp16'")
        if device not in ("cpu", "cuda"):
            raise InvalidOptionError(f"precision={precision!r} is supported on cpu and cuda, not {device}: use precision='fp32'")
        if device == "cpu" and not cpu_runs(dtype):
            raise InvalidOptionError(f"this CPU has no {precision} convolution/matmul kernels: use precision='bf16' or 'fp32'")
    return dtype


def cpu_runs(dtype: torch.dtype) -> bool:
    """Whether a small conv and matmul run in ``dtype`` on this CPU."""
    try:
        x = torch.ones(1, 2, 4, 4, dtype=dtype)
        torch.nn.functional.conv2d(x, torch.ones(2, 2, 1, 1, dtype=dtype))
        torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
    except RuntimeError:
        return False
    return True


def precision_policy(low_precision_ops: Iterable[str] | None, fp32_ops: Iterable[str] | None) -> tuple[frozenset[str], frozenset[str]]:
    """The op families run in the low dtype and those kept in fp32 (None: the defaults); unknown or doubled names raise."""
    low = DEFAULT_LOW_PRECISION_OPS if low_precision_ops is None else frozenset(low_precision_ops)
    kept = DEFAULT_FP32_OPS if fp32_ops is None else frozenset(fp32_ops)
    unknown = sorted((low | kept) - set(PRECISION_FAMILY_NAMES))
    if unknown:
        raise InvalidOptionError(f"unknown op families {unknown} in low_precision_ops/fp32_ops: use names from {', '.join(PRECISION_FAMILY_NAMES)}")
    if low & kept:
        raise InvalidOptionError(f"op families {sorted(low & kept)} are in both low_precision_ops and fp32_ops: choose one")
    return low, kept


def emulated_on_cpu(precision: str, model: nn.Module) -> str | None:
    """Why ``precision`` is emulated (far slower than fp32) on this CPU for ``model``, or None.

    bf16 runs natively on CPUs with AVX-512 BF16 or AMX, which oneDNN reports as bf16
    support; elsewhere (AVX2 CPUs such as AMD Zen 2) it is emulated: a 2048x2048 bf16
    matrix product measured 47x slower than fp32's on a 2-core Zen 2 (`make bench`).
    """
    if precision != "bf16" or device_types(model) != {"cpu"}:
        return None
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return "this CPU has no native bf16 (no AVX-512 BF16 or AMX): bf16 is emulated, far slower than fp32"


def runs_on(precision: str, model: nn.Module) -> bool:
    """Whether ``precision`` runs on the model's device (bf16 on CPUs with bf16 kernels, fp16 on CUDA)."""
    if precision == "fp16" and device_types(model) == {"cpu"}:
        return False  # CPU fp16 kernels, where they exist, are slower than bf16: not worth a candidate
    try:
        check_precision(precision, model)
    except InvalidOptionError:
        return False
    return True


def check_int8(model: nn.Module, mode: str, memory_format: str, fuse: str | None, accuracy: Any, device: Any = None) -> float:
    """The accuracy budget of ``precision="int8"``, or an error saying which option rules int8 out."""
    if mode != "inference":
        raise InvalidOptionError("precision='int8' is for inference: put the model in eval mode or pass mode='inference'")
    devices = {torch.device(device).type} if device is not None else device_types(model)
    if devices - {"cpu"}:
        raise InvalidOptionError(f"precision='int8' runs on oneDNN's CPU kernels, not on {', '.join(sorted(devices - {'cpu'}))}: run the model on the CPU")
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        raise InvalidOptionError("precision='int8' runs on oneDNN's CPU kernels, which this torch build has disabled or lacks")
    if memory_format == "preserve":
        raise InvalidOptionError("precision='int8' runs oneDNN's int8 convolutions in channels_last: use memory_format='auto' or 'channels_last'")
    if fuse is not None:
        raise InvalidOptionError(f"precision='int8' runs oneDNN's int8 kernels, which fuse={fuse!r} would not compile: leave fuse out")
    if accuracy is None:
        return DEFAULT_INT8_ACCURACY
    if not (isinstance(accuracy, (int, float)) and not isinstance(accuracy, bool) and accuracy > 0):
        raise InvalidOptionError(f"accuracy={accuracy!r}: give the largest output error allowed relative to the output's scale, e.g. 5e-2")
    return float(accuracy)


def calibration_batches(calibration: Any, check: Callable[[Any], tuple[Any, ...]], example: tuple[Any, ...], varying: Dims) -> tuple[tuple[Any, ...], ...]:
    """forward()'s arguments for each batch of ``calibration``, each checked by ``check`` and against the example's structure.

    A batch is a tensor, a tuple/list of forward()'s positional arguments or a dict of its
    keyword arguments; a tuple/list longer than the example's (a DataLoader's ``(inputs,
    labels)``) gives its first items. Its tensors must have the example's dtypes, numbers of
    dimensions and sizes, except the batch size (a DataLoader's last batch may be smaller) and
    the dimensions in ``varying`` (per leaf of the example: those ``dynamic_shapes`` asks to vary):
    the optimized module would refuse another size of a fixed dimension, and an engine's quantizer
    would fail on it.
    """
    if calibration is None:
        raise InvalidOptionError(
            "precision='int8' needs calibration=: an iterable of example batches shaped like example_inputs "
            "(a DataLoader works), from which each layer's input range is measured"
        )
    if isinstance(calibration, (torch.Tensor, Mapping, str)) or not isinstance(calibration, Iterable):
        raise InvalidOptionError(
            f"calibration= takes an iterable of batches (a list of tensors or tuples, or a DataLoader), not a {type(calibration).__name__}"
        )
    expected = [(leaf.dtype, leaf.dim()) if isinstance(leaf, torch.Tensor) else None for leaf in pytree.tree_leaves(example)]
    batches = []
    for index, batch in enumerate(calibration):
        if isinstance(batch, (tuple, list)) and len(batch) > len(example):
            batch = tuple(batch[: len(example)])
        args = check(batch)
        found = [(leaf.dtype, leaf.dim()) if isinstance(leaf, torch.Tensor) else None for leaf in pytree.tree_leaves(args)]
        if pytree.tree_structure(args) != pytree.tree_structure(example) or found != expected:
            raise InvalidInputsError(
                f"calibration batch {index} holds {describe_inputs(args)}, the example inputs {describe_inputs(example)}: give batches "
                "with the example's structure, dtypes and numbers of dimensions"
            )
        fixed = [
            f"input {position} is {tuple(leaf.shape)}, the example's {tuple(mine.shape)}: dimension {dim} differs"
            for position, (leaf, mine, dims) in enumerate(zip(pytree.tree_leaves(args), pytree.tree_leaves(example), varying, strict=True))
            if isinstance(leaf, torch.Tensor)
            for dim in range(1, leaf.dim())
            if dim not in dims and leaf.shape[dim] != mine.shape[dim]
        ]
        if fixed:
            raise InvalidInputsError(
                f"calibration batch {index}: {fixed[0]}, and its size is fixed (only the batch size and the dimensions dynamic_shapes= "
                "makes vary may differ): give batches of the inputs the optimized model will be called with"
            )
        batches.append(args)
    if not batches:
        raise InvalidOptionError("calibration= holds no batch: give at least one batch shaped like example_inputs")
    return tuple(batches)

"""The precision policy: which low dtypes a device runs, and which op families run in them.

``optimize(precision=..., low_precision_ops=..., fp32_ops=...)`` is checked here before
anything costly runs: `check_precision` turns ``"bf16"``/``"fp16"`` into a dtype the
model's devices have kernels for (or an error naming what they do have), and
`precision_policy` resolves the op families run in that dtype and those kept in fp32
(defaults: `graphopt.passes.use_low_precision`). `runs_on` is what tune asks before
making a low-precision candidate.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from graphopt.device import device_types
from graphopt.errors import InvalidOptionError
from graphopt.ops import PRECISION_FAMILY_NAMES
from graphopt.passes.use_low_precision import DEFAULT_FP32_OPS, DEFAULT_LOW_PRECISION_OPS

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, model: nn.Module) -> torch.dtype | None:
    """The low dtype for ``precision`` on the model's device, or an error naming what this device supports."""
    if precision not in PRECISIONS:
        raise InvalidOptionError(f"unknown precision {precision!r}: use one of {', '.join(map(repr, PRECISIONS))}")
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

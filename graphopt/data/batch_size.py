"""`max_batch_size`: the largest batch size, a multiple of ``multiple``, that fits in memory.

It owns the search (doubling, then bisection) that runs the model on CUDA, the estimate
from tensor sizes used elsewhere, and the working copy of the model both probe, so the
caller's model, gradients, modes and random number generators are left as they were.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.data.memory import MB, default_budget
from graphopt.data.options import checked_device, positive_int
from graphopt.errors import InvalidInputsError, InvalidModelError, InvalidOptionError


def max_batch_size(
    model: nn.Module,
    example_input: torch.Tensor,
    *,
    mode: str = "inference",
    device: str | torch.device | None = None,
    limit: int = 4096,
    multiple: int = 8,
    memory_budget_bytes: int | None = None,
) -> int:
    """The largest batch size, a multiple of ``multiple`` and at most ``limit``, that fits in memory.

    One step is a forward under ``torch.inference_mode`` in eval mode (``mode="inference"``)
    or a forward and a backward of the sum of the outputs in train mode (``"training"``).
    Batches are ``example_input`` (one batch, of any size) repeated along dim 0. ``device``
    defaults to the model's (else the input's) device.

    On CUDA the steps really run: batch sizes grow by doubling until one runs out of memory
    (``torch.cuda.OutOfMemoryError``; the cache is emptied after each try), then a binary
    search between the last multiple that fit and the first that did not finds the largest.
    With ``memory_budget_bytes`` a step also fails when the peak of allocated memory rises
    by more than that. Memory is as it is now: other tensors the process holds count.

    On CPU nothing signals out-of-memory before the machine swaps or the process is killed,
    so the peak is *estimated*, not measured: one forward at ``multiple`` and one at
    ``2 * multiple`` samples, with forward hooks on every leaf module (module without
    children), sum the bytes of the input batch, every leaf module's outputs and the
    model's outputs (tensors sharing storage, as in-place ops and views do, count once).
    The growth between the two is the cost per ``multiple`` samples; what the first has
    beyond it is a fixed cost. In training mode the gradients of the trainable parameters
    are added as a fixed cost. The result is the largest multiple whose estimate stays
    within ``memory_budget_bytes`` (default: half the memory available now, from psutil,
    ``/proc/meminfo`` MemAvailable, or ``sysconf`` free pages). Read it as a guide: summing
    every activation over-counts inference (the runtime frees them as it goes), while
    tensors made outside leaf modules (functional calls in ``forward``), backward's
    temporaries, the allocator's overhead and optimizer state are not counted. Other
    devices use the same estimate and need an explicit ``memory_budget_bytes``.

    The model is left as it was: inference toggles eval mode and restores every module's
    mode, training runs on a deep copy (on CUDA the original's parameters stay resident, so
    the answer is conservative by one copy of them), and the random number generators are
    restored.
    """
    if not isinstance(model, nn.Module):
        raise InvalidModelError(
            f"max_batch_size needs a torch.nn.Module, got {type(model).__name__}; wrap a plain function in an "
            "nn.Module whose forward() calls it"
        )
    if not isinstance(example_input, torch.Tensor):
        raise InvalidInputsError(
            f"example_input must be one batch as a tensor, got {type(example_input).__name__}; "
            "e.g. max_batch_size(model, torch.randn(1, 3, 224, 224))"
        )
    if example_input.dim() == 0 or example_input.shape[0] == 0:
        raise InvalidInputsError(
            f"example_input has shape {list(example_input.shape)}: it needs a batch dimension first with at "
            "least one sample, e.g. torch.randn(1, 3, 224, 224)"
        )
    if mode not in ("inference", "training"):
        raise InvalidOptionError(f"mode must be 'inference' or 'training', got {mode!r}")
    multiple = positive_int(multiple, "multiple", "e.g. multiple=8 (tensor cores like multiples of 8)")
    limit = positive_int(limit, "limit", "e.g. limit=4096")
    if limit < multiple:
        raise InvalidOptionError(
            f"limit={limit} is below multiple={multiple}: no batch size qualifies; raise limit or lower multiple"
        )
    if memory_budget_bytes is not None and (
        isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, int) or memory_budget_bytes < 1
    ):
        raise InvalidOptionError(
            f"memory_budget_bytes must be a positive integer number of bytes, got {memory_budget_bytes!r}; "
            "e.g. memory_budget_bytes=8 * 1024**3"
        )
    target = checked_device(device, model, example_input, without_cuda="use device='cpu'")
    if target.type not in ("cpu", "cuda") and memory_budget_bytes is None:
        raise InvalidOptionError(
            f"on {target.type} max_batch_size estimates memory and needs memory_budget_bytes: pass the bytes "
            "the device can spend on a batch"
        )
    max_k = limit // multiple
    rng_devices = [target.index if target.index is not None else torch.cuda.current_device()] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), _working_model(model, mode, target) as work:
        sample = example_input.detach().to(target)
        if target.type == "cuda":
            return multiple * _largest_fitting(
                lambda k: _fits_cuda(work, sample, k * multiple, mode, target, memory_budget_bytes),
                max_k,
                on_none=lambda: _too_big(f"a batch of {multiple} runs out of memory on {target}", multiple),
            )
        budget = memory_budget_bytes if memory_budget_bytes is not None else default_budget()
        first = _estimated_bytes(work, sample, multiple, mode)
        second = _estimated_bytes(work, sample, 2 * multiple, mode)
    per_step = max(second - first, 0)  # bytes per `multiple` samples
    fixed = max(first - per_step, 0)
    if mode == "training":
        fixed += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if fixed + per_step > budget:
        _too_big(
            f"a batch of {multiple} is estimated at {(fixed + per_step) / MB:,.2f} MB "
            f"({fixed / MB:,.2f} MB fixed + {per_step / MB:,.2f} MB per {multiple} samples), over the budget of "
            f"{budget / MB:,.2f} MB",
            multiple,
        )
    k = max_k if per_step == 0 else min(max_k, (budget - fixed) // per_step)
    return int(k) * multiple


def _too_big(what: str, multiple: int) -> NoReturn:
    raise InvalidInputsError(
        f"{what}: no batch size fits; lower multiple (now {multiple}), raise memory_budget_bytes, "
        "or use a smaller model or input"
    )


def _largest_fitting(fits: Callable[[int], bool], max_k: int, on_none: Callable[[], Any]) -> int:
    """Largest k in 1..max_k with fits(k), assuming fits is monotone: doubling, then bisection."""
    if not fits(1):
        on_none()
        return 0
    good, bad = 1, max_k + 1
    while good < max_k:
        trial = min(good * 2, max_k)
        if fits(trial):
            good = trial
        else:
            bad = trial
            break
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


@contextmanager
def _working_model(model: nn.Module, mode: str, target: torch.device) -> Iterator[nn.Module]:
    """The module to probe: a deep copy for training or another device, else ``model`` in eval mode."""
    on_target = all(t.device == target for t in [*model.parameters(), *model.buffers()])
    if mode == "training" or not on_target:
        try:
            work = copy.deepcopy(model)
        except Exception as error:
            raise InvalidModelError(
                f"max_batch_size works on a deep copy of the model here, and copy.deepcopy(model) failed with "
                f"{type(error).__name__}: {error}; make the model deep-copyable"
            ) from error
        work.to(target)
        work.train(mode == "training")
        work.zero_grad(set_to_none=True)
        try:
            yield work
        finally:
            del work
            gc.collect()
        return
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def _batch_of(sample: torch.Tensor, n: int) -> torch.Tensor:
    index = torch.arange(n, device=sample.device) % sample.shape[0]
    return sample.index_select(0, index)


def _forward(model: nn.Module, batch: torch.Tensor, mode: str) -> Any:
    try:
        if mode == "inference":
            with torch.inference_mode():
                return model(batch)
        return model(batch)
    except Exception as error:
        if _is_oom(error):
            raise
        raise InvalidInputsError(
            f"model(example_input repeated to a batch of {batch.shape[0]}) failed with {type(error).__name__}: "
            f"{error}; check that the model accepts example_input and batches of other sizes"
        ) from error


def _loss(outputs: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise InvalidInputsError(
            "in mode='training' no output of the model requires grad, so there is nothing to backpropagate: "
            "check that the model has trainable parameters, or use mode='inference'"
        )
    return sum(leaf.float().sum() for leaf in leaves)  # type: ignore[return-value]


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


def _fits_cuda(work: nn.Module, sample: torch.Tensor, n: int, mode: str, device: torch.device, budget: int | None) -> bool:
    """Run one step at batch size n; False when it runs out of memory (or over ``budget``)."""
    out_of_memory = False
    peak = 0
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        batch = _batch_of(sample, n)
        outputs = _forward(work, batch, mode)
        if mode == "training":
            _loss(outputs).backward()
        del outputs, batch
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    except Exception as error:
        if not _is_oom(error):
            raise
        out_of_memory = True
    finally:
        if mode == "training":
            work.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    return not out_of_memory and (budget is None or peak <= budget)


def _estimated_bytes(work: nn.Module, sample: torch.Tensor, n: int, mode: str) -> int:
    """Bytes of the input batch, every leaf module's outputs and the model's outputs, storages counted once."""
    kept: list[Any] = []
    leaves = [module for module in work.modules() if not any(True for _ in module.children())]
    handles = [leaf.register_forward_hook(lambda _m, _i, out: kept.append(out)) for leaf in leaves]
    try:
        batch = _batch_of(sample, n)
        outputs = _forward(work, batch, mode)
        if mode == "training":
            _loss(outputs)  # only checks that a backward would be possible
        storages: dict[Any, int] = {}
        for tensor in [batch, *pytree.tree_leaves(kept), *pytree.tree_leaves(outputs)]:
            if isinstance(tensor, torch.Tensor):
                key, size = _storage(tensor)
                storages[key] = size
        return sum(storages.values())
    finally:
        for handle in handles:
            handle.remove()
        kept.clear()


def _storage(tensor: torch.Tensor) -> tuple[Any, int]:
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ...: no single storage
        return id(tensor), tensor.numel() * tensor.element_size()

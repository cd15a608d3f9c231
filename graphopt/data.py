"""Input-pipeline helpers: tune a DataLoader's settings, find the largest batch that fits.

    from graphopt.data import tune_loader, max_batch_size

    tuning = tune_loader(dataset, batch_size=64, device="cuda")
    print(tuning)                                   # table, fastest first
    loader = DataLoader(dataset, **tuning.best)     # the fastest settings measured

    batch = max_batch_size(model, torch.randn(1, 3, 224, 224), mode="training")

    for inputs, labels in DevicePrefetcher(loader, "cuda"):  # next batch copied while this one runs
        ...

`tune_loader` measures; it does not predict. Its numbers hold for this machine, this
dataset and this moment: other load on the machine shifts them, so rerun it where the
training runs. `max_batch_size` searches by running the model on CUDA (out-of-memory is
a reliable signal there) and estimates from tensor sizes elsewhere (see its docstring
for exactly how).
"""

from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, IterableDataset

from graphopt.errors import InvalidInputsError, InvalidModelError, InvalidOptionError
from graphopt.prefetch import DevicePrefetcher

try:  # optional: more exact memory numbers, and it works where /proc does not exist
    import psutil  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None

try:  # not on Windows
    import resource
except ImportError:  # pragma: no cover - depends on the platform
    resource = None  # type: ignore[assignment]

__all__ = ["Candidate", "DevicePrefetcher", "LoaderTuning", "max_batch_size", "tune_loader"]

_MB = 1024 * 1024
_GB = 1024 * _MB
# DataLoader arguments tune_loader chooses itself; everything else may go in loader_kwargs.
_TUNED_KEYS = ("batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


# --------------------------------------------------------------------------- tune_loader


@dataclass
class Candidate:
    """One DataLoader configuration and what it measured.

    ``samples_per_s`` is the number of samples in the timed batches over ``seconds``, the
    time to fetch them (and copy them to the device, when one was given) after one warm-up
    batch. ``first_batch_s`` is the time to the warm-up batch, worker start-up included:
    what ``persistent_workers=False`` pays again at every epoch. ``rss_growth_mb`` is how
    far the memory of this process plus the private memory of its worker processes rose
    above what it was before the loader was built (sampled after the warm-up and after the
    timed batches; ``None`` where it cannot be read).
    """

    kwargs: dict[str, Any]
    samples_per_s: float
    seconds: float
    rss_growth_mb: float | None
    batches: int = 0
    samples: int = 0
    first_batch_s: float = 0.0


@dataclass
class LoaderTuning:
    """What `tune_loader` found: ``DataLoader(dataset, **tuning.best)`` uses the fastest settings."""

    best: dict[str, Any]
    table: list[Candidate]
    warnings: list[str] = field(default_factory=list)
    batches: int = 0

    def ranked(self) -> list[Candidate]:
        """The candidates, fastest first (ties keep the order they were measured in)."""
        return sorted(self.table, key=lambda row: -row.samples_per_s)

    def __str__(self) -> str:
        headers = (
            "num_workers", "pin_memory", "prefetch_factor", "persistent_workers",
            "samples/s", "seconds", "first batch s", "RSS growth",
        )
        rows = []
        for row in self.ranked():
            kw = row.kwargs
            growth = "n/a" if row.rss_growth_mb is None else f"{row.rss_growth_mb:+.1f} MB"
            rows.append(
                (
                    str(kw.get("num_workers", 0)),
                    str(kw.get("pin_memory", False)),
                    str(kw.get("prefetch_factor", "-")),
                    str(kw.get("persistent_workers", "-")),
                    f"{row.samples_per_s:,.0f}",
                    f"{row.seconds:.4f}",
                    f"{row.first_batch_s:.4f}",
                    growth,
                )
            )
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        batch_size = self.best.get("batch_size")
        lines = [f"DataLoader throughput, batch_size={batch_size}, {self.batches} timed batches per candidate, fastest first:"]
        lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        lines.extend("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.best.items())
        lines.append(f"best: DataLoader(dataset, {arguments})")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        here = f"4 x {gpus} = {4 * gpus} here" if gpus else "no CUDA GPU is visible here"
        lines.append(
            f"rule of thumb: num_workers = 4 x the number of GPUs is a starting point ({here}); "
            "the table is what this machine and dataset actually do, and other load on the machine shifts it."
        )
        if self.warnings:
            lines.append("warnings:")
            lines.extend(f"  - {warning}" for warning in self.warnings)
        return "\n".join(lines)


def tune_loader(
    dataset: Any,
    batch_size: int,
    *,
    num_workers: int | Iterable[int] | None = None,
    pin_memory: bool | Iterable[bool] | None = None,
    prefetch_factor: int | Iterable[int] = (2, 4),
    persistent_workers: bool | Iterable[bool] = (True,),
    batches: int = 20,
    device: str | torch.device | None = None,
    progress: bool = True,
    loader_kwargs: Mapping[str, Any] | None = None,
) -> LoaderTuning:
    """Measure ``DataLoader(dataset, batch_size=batch_size, ...)`` throughput over candidate settings.

    Candidates are every combination of ``num_workers`` (default 0, 1, 2, 4, 8, ... up to
    ``os.cpu_count()``, which is included) and ``pin_memory`` (default ``(False, True)``
    when CUDA is available, else ``(False,)``); ``prefetch_factor`` and
    ``persistent_workers`` only vary when ``num_workers > 0`` (the DataLoader rejects them
    otherwise). Each option takes one value or an iterable of values to try.

    For each candidate the loader is built, one warm-up batch is fetched (worker start-up
    lands there), then ``batches`` batches are timed with ``time.perf_counter``. With
    ``device`` (e.g. ``"cuda"``) each batch is also copied there with
    ``non_blocking=pin_memory``, which is where pinning pays off; without it pinning only
    costs. A single pass is timed, so ``persistent_workers`` shows up in
    ``first_batch_s`` (paid every epoch without it), not in ``samples_per_s``.

    ``loader_kwargs`` (e.g. ``{"collate_fn": ..., "drop_last": True}``) go to every
    candidate unchanged and into ``best``. Progress is one line per candidate on stderr.
    """
    _check_dataset(dataset)
    batch_size = _positive_int(batch_size, "batch_size", "e.g. tune_loader(dataset, batch_size=64)")
    batches = _positive_int(batches, "batches", "e.g. batches=20; more batches give steadier numbers")
    extra = dict(loader_kwargs or {})
    clash = sorted(set(extra) & set(_TUNED_KEYS))
    if clash:
        raise InvalidOptionError(
            f"loader_kwargs sets {', '.join(clash)}, which tune_loader chooses itself: pass them as "
            "tune_loader's own arguments (batch_size=..., num_workers=(0, 2), ...) instead"
        )
    target = _loader_device(device)
    warnings: list[str] = []

    workers = _int_choices(num_workers, "num_workers", _default_workers(), minimum=0)
    pins = _bool_choices(pin_memory, "pin_memory", (False, True) if torch.cuda.is_available() else (False,))
    if True in pins and not _has_accelerator():
        pins = tuple(dict.fromkeys(False if pin else pin for pin in pins))
        warnings.append("pin_memory=True was not tried: no CUDA (or other accelerator) is available to pin memory for")
    prefetches = _int_choices(prefetch_factor, "prefetch_factor", (2,), minimum=1)
    persists = _bool_choices(persistent_workers, "persistent_workers", (True,))
    if isinstance(dataset, IterableDataset) and any(workers):
        warnings.append(
            "an IterableDataset is copied into every worker: unless its __iter__ splits the work with "
            "torch.utils.data.get_worker_info(), each worker yields the whole dataset, and the samples/s "
            "of num_workers > 0 count those duplicates"
        )

    grid = _candidate_kwargs(batch_size, workers, pins, prefetches, persists, extra)
    table: list[Candidate] = []
    short: tuple[int, int] | None = None
    for index, kwargs in enumerate(grid, start=1):
        row, total = _measure(dataset, kwargs, batches, target)
        table.append(row)
        if row.batches < batches:
            short = (total, row.batches)
        if row.rss_growth_mb is not None and row.rss_growth_mb > 1024 and row.kwargs["num_workers"] > 0:
            per_worker = row.rss_growth_mb / row.kwargs["num_workers"]
            warnings.append(
                f"num_workers={row.kwargs['num_workers']} grew memory by {row.rss_growth_mb / 1024:.1f} GB "
                f"(~{per_worker:,.0f} MB per worker): each worker holds its own copy of whatever the dataset "
                "touches (Python lists and dicts are copied on read); keep samples in numpy arrays or tensors, "
                "or use fewer workers"
            )
        if progress:
            print(f"[tune_loader {index}/{len(grid)}] {_describe(kwargs)}: {_progress(row)}", file=sys.stderr, flush=True)
    if short is not None:
        total, timed = short
        size = f" of {len(dataset)} samples" if _has_len(dataset) else ""
        if timed:
            measured = f"measured the {timed} batch(es) after the warm-up batch instead of batches={batches}"
        else:
            measured = "measured that single batch, worker start-up included, as there is nothing to warm up with"
        warnings.append(
            f"the dataset{size} yields only {total} batch(es) of batch_size={batch_size}: {measured}; numbers "
            "from so few batches are noisy, use a larger dataset (or a smaller batch_size) for steadier ones"
        )
    best = dict(max(table, key=lambda row: row.samples_per_s).kwargs)
    return LoaderTuning(best=best, table=table, warnings=list(dict.fromkeys(warnings)), batches=batches)


def _measure(dataset: Any, kwargs: dict[str, Any], batches: int, device: torch.device | None) -> tuple[Candidate, int]:
    """Time one configuration; returns the row and how many batches the loader yielded in all."""
    pin = bool(kwargs["pin_memory"])
    memory_before = _memory_sample()
    peak_before = _max_rss()
    try:
        loader = DataLoader(dataset, **kwargs)
    except (ValueError, TypeError) as error:
        raise InvalidOptionError(
            f"DataLoader rejects these settings ({_describe(kwargs)} and loader_kwargs "
            f"{sorted(set(kwargs) - set(_TUNED_KEYS))}): {error}; drop or fix the loader_kwargs it names"
        ) from error
    iterator: Iterator[Any] | None = None
    try:
        started = time.perf_counter()
        iterator = iter(loader)
        try:
            batch = _fetch(iterator, device, pin, kwargs)
        except StopIteration:
            raise InvalidInputsError(
                f"DataLoader(dataset, {_describe(kwargs)}) yields no batch at all: the dataset is empty "
                "(or drop_last dropped its only, incomplete batch); tune the loader on a dataset with data"
            ) from None
        first_batch_s = time.perf_counter() - started
        warm_samples = _samples_in(batch, kwargs["batch_size"])
        del batch
        memory_peak = _memory_sample()
        timed = samples = 0
        started = time.perf_counter()
        for _ in range(batches):
            try:
                batch = _fetch(iterator, device, pin, kwargs)
            except StopIteration:
                break
            timed += 1
            samples += _samples_in(batch, kwargs["batch_size"])
            del batch
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        memory_peak = _max_or_none(memory_peak, _memory_sample())
        total = timed + 1
        if not timed:  # a single batch exists: report it, start-up included, rather than nothing
            seconds, samples = first_batch_s, warm_samples
    finally:
        # Stop the workers before the next candidate, so neither its memory nor its CPUs are shared.
        del iterator, loader
        gc.collect()
    growth = _growth_mb(memory_before, memory_peak, peak_before, _max_rss())
    row = Candidate(
        kwargs=dict(kwargs),
        samples_per_s=samples / max(seconds, 1e-9),
        seconds=seconds,
        rss_growth_mb=growth,
        batches=timed,
        samples=samples,
        first_batch_s=first_batch_s,
    )
    return row, total


def _fetch(iterator: Iterator[Any], device: torch.device | None, pin: bool, kwargs: dict[str, Any]) -> Any:
    try:
        batch = next(iterator)
    except StopIteration:
        raise
    except Exception as error:  # the dataset failed: say under which settings
        raise InvalidInputsError(
            f"loading a batch with DataLoader(dataset, {_describe(kwargs)}) failed with "
            f"{type(error).__name__}: {error}; check that the dataset loads under these settings "
            "(e.g. with num_workers > 0 it must be picklable)"
        ) from error
    if device is not None and device.type != "cpu":
        batch = pytree.tree_map(
            lambda leaf: leaf.to(device, non_blocking=pin) if isinstance(leaf, torch.Tensor) else leaf, batch
        )
    return batch


def _samples_in(batch: Any, batch_size: int) -> int:
    """The batch dimension of the first tensor in ``batch``; ``batch_size`` when it has none."""
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return batch_size


def _candidate_kwargs(
    batch_size: int,
    workers: tuple[int, ...],
    pins: tuple[bool, ...],
    prefetches: tuple[int, ...],
    persists: tuple[bool, ...],
    extra: dict[str, Any],
) -> list[dict[str, Any]]:
    grid = []
    for count in workers:
        for pin in pins:
            if count == 0:
                grid.append({"batch_size": batch_size, "num_workers": 0, "pin_memory": pin, **extra})
                continue
            for prefetch in prefetches:
                for persist in persists:
                    grid.append(
                        {
                            "batch_size": batch_size,
                            "num_workers": count,
                            "pin_memory": pin,
                            "prefetch_factor": prefetch,
                            "persistent_workers": persist,
                            **extra,
                        }
                    )
    return grid


def _describe(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k in _TUNED_KEYS)


def _progress(row: Candidate) -> str:
    growth = "" if row.rss_growth_mb is None else f", {row.rss_growth_mb:+.1f} MB"
    return (
        f"{row.samples_per_s:,.0f} samples/s ({row.batches} batches in {row.seconds:.4f} s, "
        f"first batch {row.first_batch_s:.4f} s{growth})"
    )


def _default_workers() -> tuple[int, ...]:
    cpus = os.cpu_count() or 1
    counts = [0, 1]
    while counts[-1] * 2 <= cpus:
        counts.append(counts[-1] * 2)
    if counts[-1] != cpus:
        counts.append(cpus)
    return tuple(counts)


def _has_accelerator() -> bool:
    if torch.cuda.is_available():
        return True
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


def _has_len(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def _check_dataset(dataset: Any) -> None:
    if isinstance(dataset, IterableDataset):
        return
    if not (hasattr(dataset, "__getitem__") and _has_len(dataset)):
        raise InvalidInputsError(
            f"dataset must be map-style (define __len__ and __getitem__) or a torch.utils.data.IterableDataset, "
            f"got {type(dataset).__name__}; wrap a plain iterator in an IterableDataset subclass whose __iter__ "
            "yields the samples"
        )
    if len(dataset) == 0:
        raise InvalidInputsError("the dataset is empty (len(dataset) == 0): tune the loader on a dataset with data")


def _loader_device(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidOptionError(f"device={device!r} is not a torch device: use e.g. 'cuda', 'cuda:1' or 'cpu'") from error
    if target.type == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError(
            f"device={device!r} but CUDA is not available: leave device=None to measure loading alone"
        )
    return target


def _positive_int(value: Any, name: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(f"{name} must be an integer >= 1, got {value!r}; {hint}")
    return value


def _int_choices(value: Any, name: str, default: tuple[int, ...], minimum: int) -> tuple[int, ...]:
    values = default if value is None else (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        values = tuple(values)
    except TypeError:
        values = (value,)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < minimum]
    if not values or bad:
        raise InvalidOptionError(
            f"{name} must be an integer >= {minimum} or a non-empty sequence of them, got {value!r}; "
            f"e.g. {name}=({minimum}, {minimum + 2})"
        )
    return tuple(dict.fromkeys(values))


def _bool_choices(value: Any, name: str, default: tuple[bool, ...]) -> tuple[bool, ...]:
    values = default if value is None else (value,) if isinstance(value, bool) else value
    try:
        values = tuple(values)
    except TypeError:
        values = (value,)
    if not values or any(not isinstance(v, bool) for v in values):
        raise InvalidOptionError(
            f"{name} must be True, False or a non-empty sequence of them, got {value!r}; e.g. {name}=(False, True)"
        )
    return tuple(dict.fromkeys(values))


# -- memory of this process and its DataLoader workers


def _memory_sample() -> int | None:
    """Resident bytes of this process plus private bytes of its live multiprocessing children."""
    own = _own_rss()
    if own is None:
        return None
    for child in multiprocessing.active_children():
        private = _private_bytes(child.pid) if child.pid is not None else None
        own += private or 0
    return own


def _own_rss() -> int | None:
    if psutil is not None:
        with suppress(psutil.Error, OSError):  # psutil can fail in sandboxes: fall back to /proc
            return int(psutil.Process().memory_info().rss)
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _private_bytes(pid: int) -> int | None:
    """Memory only ``pid`` holds (USS): forked workers share the rest with this process."""
    if psutil is not None:
        try:
            return int(psutil.Process(pid).memory_full_info().uss)
        except (psutil.Error, OSError):  # gone already, or not allowed
            return None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as smaps:
            total = 0
            for line in smaps:
                if line.startswith(("Private_Clean:", "Private_Dirty:", "Private_Hugetlb:")):
                    total += int(line.split()[1]) * 1024
            return total
    except (OSError, ValueError, IndexError):
        return None


def _max_rss() -> int | None:
    """Peak resident bytes of this process so far (monotonic)."""
    if resource is None:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _max_or_none(a: int | None, b: int | None) -> int | None:
    present = [v for v in (a, b) if v is not None]
    return max(present) if present else None


def _growth_mb(before: int | None, peak: int | None, max_before: int | None, max_after: int | None) -> float | None:
    """The larger of the sampled growth and the rise of the process's lifetime peak (both under-estimate)."""
    growths = []
    if before is not None and peak is not None:
        growths.append(peak - before)
    if max_before is not None and max_after is not None:
        growths.append(max_after - max_before)
    return max(0, *growths) / _MB if growths else None


# --------------------------------------------------------------------------- max_batch_size


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
    multiple = _positive_int(multiple, "multiple", "e.g. multiple=8 (tensor cores like multiples of 8)")
    limit = _positive_int(limit, "limit", "e.g. limit=4096")
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
    target = _model_device(model, example_input, device)
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
        budget = memory_budget_bytes if memory_budget_bytes is not None else _default_budget()
        first = _estimated_bytes(work, sample, multiple, mode)
        second = _estimated_bytes(work, sample, 2 * multiple, mode)
    per_step = max(second - first, 0)  # bytes per `multiple` samples
    fixed = max(first - per_step, 0)
    if mode == "training":
        fixed += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if fixed + per_step > budget:
        _too_big(
            f"a batch of {multiple} is estimated at {(fixed + per_step) / _MB:,.2f} MB "
            f"({fixed / _MB:,.2f} MB fixed + {per_step / _MB:,.2f} MB per {multiple} samples), over the budget of "
            f"{budget / _MB:,.2f} MB",
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


def _model_device(model: nn.Module, example_input: torch.Tensor, device: str | torch.device | None) -> torch.device:
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise InvalidOptionError(f"device={device!r} is not a torch device: use e.g. 'cuda' or 'cpu'") from error
    else:
        devices = {t.device for t in [*model.parameters(), *model.buffers()]}
        target = next(iter(devices)) if len(devices) == 1 else example_input.device
    if target.type == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError(f"device={str(target)!r} but CUDA is not available: use device='cpu'")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return target


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


def _default_budget() -> int:
    """Half the memory available now."""
    available: int | None = None
    if psutil is not None:
        try:
            available = int(psutil.virtual_memory().available)
        except (psutil.Error, OSError):  # pragma: no cover
            available = None
    if available is None:
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            available = None
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - no sysconf
            raise InvalidOptionError(
                "cannot read how much memory is available on this system: pass memory_budget_bytes"
            ) from None
    return max(1, available // 2)


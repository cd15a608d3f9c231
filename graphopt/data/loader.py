"""DataLoader tuning: `tune_loader` times a DataLoader over candidate settings on this machine.

It owns the candidates (every combination of the settings to try), the measurement of
each one, the table it reports (`LoaderTuning`, one `LoaderCandidate` per row) and the
checks of its options. Memory numbers come from `graphopt.data.memory`.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, IterableDataset

from graphopt.data.memory import growth_mb, max_or_none, max_rss, memory_sample
from graphopt.data.options import checked_device, positive_int
from graphopt.errors import InvalidInputsError, InvalidOptionError

# DataLoader arguments tune_loader chooses itself; everything else may go in loader_kwargs.
_TUNED_KEYS = ("batch_size", "num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


@dataclass
class LoaderCandidate:
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
    table: list[LoaderCandidate]
    warnings: list[str] = field(default_factory=list)
    batches: int = 0

    def ranked(self) -> list[LoaderCandidate]:
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
    batch_size = positive_int(batch_size, "batch_size", "e.g. tune_loader(dataset, batch_size=64)")
    batches = positive_int(batches, "batches", "e.g. batches=20; more batches give steadier numbers")
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
    table: list[LoaderCandidate] = []
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


def _measure(dataset: Any, kwargs: dict[str, Any], batches: int, device: torch.device | None) -> tuple[LoaderCandidate, int]:
    """Time one configuration; returns the row and how many batches the loader yielded in all."""
    pin = bool(kwargs["pin_memory"])
    memory_before = memory_sample()
    peak_before = max_rss()
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
        memory_peak = memory_sample()
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
        memory_peak = max_or_none(memory_peak, memory_sample())
        total = timed + 1
        if not timed:  # a single batch exists: report it, start-up included, rather than nothing
            seconds, samples = first_batch_s, warm_samples
    finally:
        # Stop the workers before the next candidate, so neither its memory nor its CPUs are shared.
        del iterator, loader
        gc.collect()
    growth = growth_mb(memory_before, memory_peak, peak_before, max_rss())
    row = LoaderCandidate(
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


def _progress(row: LoaderCandidate) -> str:
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
    """Where each batch is copied; None measures loading alone."""
    if device is None:
        return None
    # An explicit device: resolve_device looks at neither the model nor the inputs.
    return checked_device(device, nn.Module(), (), without_cuda="leave device=None to measure loading alone")


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

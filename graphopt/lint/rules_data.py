"""Lint rules on data loading (GO1xx)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from graphopt.lint.core import Facts, Match, add_keyword, dataloader_calls, is_constant, keyword, loader_setting, replace_node, rule, unpacks

# Where DataLoader takes these settings positionally:
# DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn, pin_memory, ...)
@rule(
    "GO101",
    "dataloader-workers",
    "DataLoader loads batches in the training process (num_workers=0)",
    "With num_workers=0 the training process itself reads, decodes, augments and collates every batch "
    "between steps, and the GPU sits idle while it does; worker processes prepare the next batches "
    "in parallel with the training step.",
    "Pass num_workers=N: start at 4 per GPU (capped by the CPU cores, os.cpu_count()), then measure; "
    "graphopt.data.tune_loader(loader) times candidate settings on this machine. Not fixed "
    "automatically: the right number depends on the machine and the dataset.",
)
def dataloader_workers(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    for call in dataloader_calls(tree):
        if unpacks(call):
            continue
        workers = loader_setting(call, "num_workers")
        if workers is None:
            yield Match(call, "DataLoader without num_workers loads batches in the training process")
        elif is_constant(workers, 0):
            yield Match(workers, "DataLoader(num_workers=0) loads batches in the training process")


@rule(
    "GO102",
    "dataloader-pin-memory",
    "DataLoader without pin_memory=True in a script that uses CUDA",
    "A batch in pageable host memory is first staged by the driver into a pinned buffer, and the "
    "host-to-device copy is synchronous and slower; with pin_memory=True the loader puts batches in "
    "page-locked memory, so copies run at full bandwidth and, with non_blocking=True, overlap with compute.",
    "DataLoader(..., pin_memory=True), and copy batches with .to(device, non_blocking=True) (GO204).",
)
def dataloader_pin_memory(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    if not facts.uses_cuda:
        return
    for call in dataloader_calls(tree):
        if unpacks(call):
            continue
        pin = loader_setting(call, "pin_memory")
        if pin is None:
            yield Match(call, edit=add_keyword(call, "pin_memory=True", facts.source))
        elif isinstance(pin, ast.Constant) and not pin.value:  # False (or 0 / None)
            yield Match(pin, f"DataLoader(pin_memory={pin.value!r}) in a script that uses CUDA", replace_node(pin, "True"))


@rule(
    "GO103",
    "dataloader-persistent-workers",
    "DataLoader with workers but without persistent_workers=True",
    "Without persistent_workers the loader shuts its worker processes down at the end of every epoch "
    "and starts new ones at the next: each start re-imports, re-creates the dataset in every worker "
    "and refills the prefetch queue, so the first batches of every epoch wait.",
    "DataLoader(..., num_workers=N, persistent_workers=True); for a configurable count write "
    "persistent_workers=num_workers > 0 (True with num_workers=0 raises ValueError). Not fixed "
    "automatically: persistent workers keep the dataset object they started with (changes the main "
    "process makes to it between epochs, e.g. dataset.set_epoch(), no longer reach them) and draw "
    "their seeds once, so a seeded run shuffles and samples differently after the first epoch.",
)
def dataloader_persistent_workers(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    for call in dataloader_calls(tree):
        if unpacks(call):
            continue
        workers = loader_setting(call, "num_workers")
        if workers is None:
            continue
        if isinstance(workers, ast.Constant) and not (type(workers.value) is int and workers.value > 0):
            continue
        persistent = keyword(call, "persistent_workers")
        if persistent is None:
            yield Match(call)
        elif isinstance(persistent, ast.Constant) and not persistent.value:
            yield Match(persistent, f"DataLoader(persistent_workers={persistent.value!r}) restarts its workers every epoch")

"""Lint rules on devices, copies and parallelism (GO2xx)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from graphopt.lint.core import Facts, Match, call_name, calls, rule


@rule(
    "GO201",
    "data-parallel",
    "nn.DataParallel: use DistributedDataParallel",
    "DataParallel runs one process that scatters inputs and gathers outputs through GPU 0 every step; "
    "DistributedDataParallel (one process per GPU) is faster even on one machine (playbook rule 18).",
    "torchrun --nproc_per_node=N train.py, with torch.distributed.init_process_group and "
    "model = DistributedDataParallel(model, device_ids=[local_rank])",
)
def data_parallel(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    for call in calls(tree):
        if call_name(call).split(".")[-1] == "DataParallel":
            yield Match(call)

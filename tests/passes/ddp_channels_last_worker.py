"""One rank of the DDP check in test_to_channels_last (run as a module, not collected by pytest).

    python -m tests.passes.ddp_channels_last_worker RANK PORT ORDER

ORDER ``optimize-then-ddp`` wraps graphopt's channels_last training module in
DistributedDataParallel, as users should; ``convert-after-ddp`` converts the
parameters after wrapping, which makes DDP warn that grad strides do not match its
bucket views (the control that shows the check can fail). Two training steps on the
gloo backend over loopback; warnings reach stderr.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import graphopt
from graphopt.models import REFERENCE_MODELS


def main(rank: int, port: int, order: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = REFERENCE_MODELS["resnet"].build(seed=0).train()
    inputs = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(rank))
    if order == "optimize-then-ddp":
        module = DistributedDataParallel(graphopt.optimize(model, (inputs,), frontend="fx", memory_format="channels_last"))
    else:
        module = DistributedDataParallel(model)
        model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    labels = torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(module(inputs.contiguous(memory_format=torch.channels_last)), labels).backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    # gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception"); the work is done and checked, so leave without it
    sys.stderr.flush()
    os._exit(0)

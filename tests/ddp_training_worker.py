"""One rank of the DDP gradient check in test_training (run as a module, not collected by pytest).

    python -m tests.ddp_training_worker RANK PORT OUTPUT

Each of the two gloo ranks optimizes the same model for training (channels_last, so
DDP's bucket strides are exercised), wraps it in DistributedDataParallel and trains
for `STEPS` SGD steps on its half of `full_batch`; rank 0 saves the averaged gradients
of every step to OUTPUT. DDP warnings reach stderr.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import graphopt
from graphopt.models import REFERENCE_MODELS

MODELS = ("convnext", "resnet")
STEPS = 2
WORLD_SIZE = 2
LEARNING_RATE = 0.05


def full_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's contiguous half of the full batch (what DistributedSampler gives without shuffling)."""
    images, labels = full_batch()
    size = len(images) // WORLD_SIZE
    return images[rank * size : (rank + 1) * size], labels[rank * size : (rank + 1) * size]


def dropout_seed(step: int, rank: int) -> int:
    return 100 * step + rank


def main(rank: int, port: int, output: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    images, labels = shard(rank)
    gradients: dict[str, list[dict[str, torch.Tensor]]] = {}
    for name in MODELS:
        model = REFERENCE_MODELS[name].build(seed=0).train()
        optimized = graphopt.optimize(model, (images,), frontend="fx", memory_format="channels_last")
        module = DistributedDataParallel(optimized)
        optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
        gradients[name] = []
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(dropout_seed(step, rank))
            F.cross_entropy(module(images), labels).backward()
            gradients[name].append({key: p.grad.clone() for key, p in optimized.named_parameters()})
            optimizer.step()
    if rank == 0:
        torch.save(gradients, output)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    # gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception"); the work is done and checked, so leave without it
    sys.stderr.flush()
    os._exit(0)

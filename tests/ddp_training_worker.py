"""One rank of the DDP gradient check in test_training (run as a module, not collected by pytest).

    python -m tests.ddp_training_worker RANK PORT OUTPUT

Each of the two gloo ranks optimizes the same model for training (channels_last, so
DDP's bucket strides are exercised), wraps it in DistributedDataParallel and trains
for `STEPS` SGD steps on its half of `full_batch`. Rank 0 then trains the same
optimized module alone (`one_process_gradients`: same kernels, layouts and thread
count as the ranks) and saves both runs' gradients of every step to OUTPUT, as
``{"ddp": ..., "one_process": ...}``. DDP warnings reach stderr.

Why the reference is the optimized module, not the original model: the two compute in
different layouts (channels_last vs NCHW), whose float32 results differ by rounding
(up to ~6e-6 on BatchNorm outputs of order 1; where, depends on the CPU's kernels).
A ReLU decides by the sign of its input whether a gradient passes, so a pre-activation
closer to 0 than that rounding can flip and change whole channels' gradients by
percents after BatchNorm's backward: ResNet, step 1, rank 0's half, one ``layer2.bn1`` output is +9.0e-7 in
float64, +1.1e-6 in NCHW and -2.1e-7 in channels_last float32 on an AVX2 EPYC,
giving ``layer2.conv1.weight`` gradients 6.5% apart. That is the layout's rounding,
not DDP's; test_fp32_sgd_steps_match_the_original compares the optimized module
with the original on losses and weights.
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
from graphopt.pipeline import preset_with

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


def optimized_model(name: str, example: torch.Tensor) -> graphopt.OptimizedModule:
    """The configuration every run here uses: the training preset (conv weights stored in channels_last) with the
    opt-in drop_conv_bias, exact under the plain SGD used here."""
    model = REFERENCE_MODELS[name].build(seed=0).train()
    passes = preset_with("training", ["drop_conv_bias"], low_precision=False, channels_last=True)
    return graphopt.optimize(model, (example,), frontend="fx", memory_format="channels_last", passes=passes)


def one_process_gradients(name: str) -> list[dict[str, torch.Tensor]]:
    """The optimized module trained in one process: the gradients DDP must reproduce.

    ConvNeXt has no batch statistics, so one pass over the full batch is exactly what two
    ranks averaging their halves compute. BatchNorm (the ResNet) normalises each rank's
    half with that half's statistics (SyncBatchNorm needs a GPU), so the one-process
    equivalent runs the two halves of the full batch and averages their gradients.
    """
    module = optimized_model(name, shard(0)[0])
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    gradients = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        if name == "convnext":
            images, labels = full_batch()
            F.cross_entropy(module(images), labels).backward()
        else:
            for rank in range(WORLD_SIZE):
                torch.manual_seed(dropout_seed(step, rank))
                images, labels = shard(rank)
                (F.cross_entropy(module(images), labels) / WORLD_SIZE).backward()
        gradients.append({key: p.grad.clone() for key, p in module.named_parameters()})
        optimizer.step()
    return gradients


def main(rank: int, port: int, output: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    images, labels = shard(rank)
    gradients: dict[str, list[dict[str, torch.Tensor]]] = {}
    for name in MODELS:
        optimized = optimized_model(name, images)
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
        torch.save({"ddp": gradients, "one_process": {name: one_process_gradients(name) for name in MODELS}}, output)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    # gloo's threads can abort the interpreter's teardown ("terminate called without an
    # active exception"); the work is done and checked, so leave without it
    sys.stderr.flush()
    os._exit(0)

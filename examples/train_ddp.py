"""Train a graphopt-optimized model with DistributedDataParallel, one process per device.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --steps 20
    torchrun --standalone --nproc_per_node=NUM_GPUS examples/train_ddp.py --precision bf16

Uses the gloo backend on CPU and nccl on CUDA (chosen from --device). Every playbook
rule that lives in a training script is here: DistributedDataParallel rather than
DataParallel, a DistributedSampler (with set_epoch, so each epoch shuffles differently),
a DataLoader with worker processes and pinned memory (on CUDA), non-blocking copies,
``zero_grad(set_to_none=True)``, gradient accumulation that skips the gradient
all-reduce on all but the last micro-batch (``no_sync()``), and mixed precision.

graphopt's ``precision="bf16"``/``"fp16"`` writes the casts into the graph (autocast's
policy), so there is no ``torch.autocast`` block here; fp16 adds a ``GradScaler`` against
gradient underflow. The data is synthetic (nothing is downloaded): each class adds its
own pattern to noise, so the loss falls within a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import graphopt
from graphopt.models import resnet_small

NUM_CLASSES = 10


class SyntheticImages(Dataset):
    """``size`` images of one of `NUM_CLASSES` patterns plus noise, the same in every process and worker."""

    def __init__(self, size: int, image_size: int) -> None:
        self.size = size
        self.patterns = torch.randn(NUM_CLASSES, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % NUM_CLASSES
        noise = torch.randn(self.patterns.shape[1:], generator=torch.Generator().manual_seed(index))
        return self.patterns[label] + noise, label


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch size per process")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per training process")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1024, help="size of the synthetic dataset")
    parser.add_argument("--lr", type=float, default=0.05)
    # "auto" would time channels_last in each process, and the processes could decide
    # differently; DDP needs the same parameter layout everywhere, so choose one here
    parser.add_argument("--memory-format", choices=("channels_last", "preserve"), default="channels_last")
    parser.add_argument("--checkpoint", help="save the trained weights here, with the original model's keys")
    return parser.parse_args()


def setup(device_choice: str) -> tuple[torch.device, int, int]:
    """Join the process group (nccl on CUDA, gloo on CPU); returns the device, rank and world size."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    # without torchrun: a group of one, so that the script also runs as plain `python`
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return device, dist.get_rank(), dist.get_world_size()


def main() -> None:
    args = parse_args()
    device, rank, world_size = setup(args.device)
    torch.manual_seed(0)  # the same initial weights in every process (DDP also broadcasts rank 0's)

    dataset = SyntheticImages(args.samples, args.image_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.workers > 0,
        drop_last=True,
    )

    model = resnet_small(num_classes=NUM_CLASSES).to(device).train()
    example = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    optimized = graphopt.optimize(model, (example,), mode="training", precision=args.precision, memory_format=args.memory_format)
    if rank == 0:
        print(optimized.graphopt_report, flush=True)
    ddp_model = DistributedDataParallel(optimized, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    # fp16 gradients can underflow: scale the loss (a no-op for fp32/bf16)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")

    step, epoch = 0, 0
    micro_batches = iter(())
    while step < args.steps:
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)
        for micro_step in range(args.accumulation):
            batch = next(micro_batches, None)
            if batch is None:  # a new epoch: a different shuffle, agreed by all processes
                sampler.set_epoch(epoch)
                epoch += 1
                micro_batches = iter(loader)
                batch = next(micro_batches)
            images, labels = (tensor.to(device, non_blocking=True) for tensor in batch)
            last = micro_step == args.accumulation - 1
            # all-reduce gradients once per optimizer step, on the last micro-batch
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss = F.cross_entropy(ddp_model(images), labels) / args.accumulation
                scaler.scale(loss).backward()
            step_loss += loss.detach()
        scaler.step(optimizer)
        scaler.update()
        step += 1
        dist.all_reduce(step_loss)  # for printing only: the mean loss over all processes
        if rank == 0:
            print(f"step {step:4d}  epoch {epoch - 1}  loss {step_loss.item() / world_size:.4f}", flush=True)

    if args.checkpoint and rank == 0:
        torch.save(optimized.original_state_dict(), args.checkpoint)  # loads into resnet_small()
        print(f"saved {args.checkpoint}", flush=True)
    del micro_batches, loader  # stop the worker processes before leaving the group
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Training benchmark: one training step of the anchors and a BERT-base fine-tuning step, graphopt against eager
autocast and torch.compile, every variant interleaved in one process.

A step is forward, cross-entropy, backward, an SGD step with momentum and ``zero_grad(set_to_none=True)``; the
image models take batch 8 at 224x224 (`graphopt.models.anchors`), BERT-base (random weights, from its config)
batch 8, sequence 128 with an attention mask, called by keyword. Each variant trains its own copy of the model from
the same weights. The table gives each variant's speed-up over eager fp32 (median of the interleaved rounds) and,
for graphopt in bf16, whether its low-precision pass was kept. Eager autocast runs twice, as two variants: the
difference between the two identical steps is the run's noise floor, against which the other ratios are read. Run
``make bench-train`` on a quiet machine.
"""

from __future__ import annotations

import copy
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import graphopt
from graphopt.bench.scripts import chosen_variants, print_table_head, print_table_row, script_options
from graphopt.errors import error_summary
from graphopt.passes import REGISTRY
from graphopt.quiet import TORCHAO_IMPORT_MESSAGES, log_messages_dropped
from graphopt.timing import interleaved_samples

MODELS = ("resnet50", "mobilenet_v2", "vit_b_16", "bert-base")
Batch = tuple[tuple[Any, ...], dict[str, torch.Tensor], torch.Tensor]  # positional inputs, keyword inputs, labels


def build(name: str, batch: int, small: bool = False) -> tuple[nn.Module, Batch]:
    """The model in train mode and one batch; with ``small``, tiny stand-ins (a smoke run that measures nothing)."""
    torch.manual_seed(0)
    labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))
    if name == "bert-base":
        import transformers

        sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64) if small else {}
        with log_messages_dropped(TORCHAO_IMPORT_MESSAGES):  # the model's module imports torchao, where it is installed
            model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=10, **sizes))
        length = 16 if small else 128
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[1:, length - length // 4 :] = 0  # padded rows, as in a batch of sentences of different lengths
        ids = torch.randint(0, 1000, (batch, length), generator=torch.Generator().manual_seed(0))
        return model.train(), ((), {"input_ids": ids, "attention_mask": mask}, labels)
    from graphopt.models import REFERENCE_MODELS, anchors

    if small:
        reference = REFERENCE_MODELS["resnet"]
        return reference.build().train(), (reference.example_inputs(batch), {}, labels)
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}: use {', '.join(MODELS)}")
    image = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    return getattr(anchors, name)().train(), ((image,), {}, labels)


def logits(output: Any) -> torch.Tensor:
    """The classification logits of a model's output (a tensor, or a transformers output's ``logits``)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def step(model: nn.Module, forward: Callable[..., Any], batch: Batch) -> Callable[[], float]:
    """One training step of ``model`` through ``forward``; returns the loss."""
    args, kwargs, labels = batch
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def run() -> float:
        loss = F.cross_entropy(logits(forward(*args, **kwargs)).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return run


def _channels_last(batch: Batch) -> Batch:
    args, kwargs, labels = batch
    return tuple(a.to(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args), kwargs, labels


def _autocast(model: nn.Module) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*args, **kwargs)

    return forward


def variants(model: nn.Module, batch: Batch, only: set[str] | None) -> tuple[dict[str, Callable[[], float]], dict[str, str]]:
    """Each variant's step on its own copy of ``model``, and notes (graphopt bf16: whether its pass was kept)."""
    convs = any(isinstance(m, nn.Conv2d) for m in model.modules())
    layout = " + CL" if convs else ""

    def copied(channels_last: bool = False) -> nn.Module:
        copy_ = copy.deepcopy(model)
        return copy_.to(memory_format=torch.channels_last) if channels_last and convs else copy_

    def eager_amp() -> Callable[[], float]:
        m = copied(channels_last=True)
        return step(m, _autocast(m), _channels_last(batch))

    def compiled(autocast: bool) -> Callable[[], float]:
        m = copied(channels_last=autocast)
        forward = torch.compile(m)
        return step(m, _autocast(forward) if autocast else forward, _channels_last(batch) if autocast else batch)

    notes: dict[str, str] = {}

    def optimized(**options: Any) -> Callable[[], float]:
        args, kwargs, _ = batch
        fast = graphopt.optimize(copied(), args, example_kwargs=kwargs or None, mode="training", progress=False, **options)
        if options.get("precision"):
            kept = any(REGISTRY[p.name].lowers_precision and not p.rolled_back for p in fast.graphopt_report.passes)
            notes[f'graphopt precision="{options["precision"]}"'] = "bf16 pass kept" if kept else "bf16 pass rolled back"
        return step(fast, fast, batch)

    makers: dict[str, Callable[[], Callable[[], float]]] = {
        "eager fp32": lambda: (lambda m: step(m, m, batch))(copied()),
        f"eager bf16 autocast{layout}": eager_amp,
        # the same variant again: how far two identical steps' medians differ in this run (the ratios' noise floor)
        f"eager bf16 autocast{layout} (again)": eager_amp,
        "torch.compile fp32": lambda: compiled(autocast=False),
        f"torch.compile + bf16 autocast{layout}": lambda: compiled(autocast=True),
        "graphopt default": lambda: optimized(),
        'graphopt precision="bf16"': lambda: optimized(precision="bf16"),
    }
    built = {}
    for name, make in makers.items():
        if only and name not in only and name != "eager fp32":
            continue
        try:
            run = make()
            run()  # compiles where the variant compiles
            built[name] = run
        except Exception as error:  # noqa: BLE001 - a failing variant is reported, not fatal
            print(f"  {name}: failed ({error_summary(error)[:200]})", flush=True)
    return built, notes


def measure(name: str, batch: int, rounds: int, only: set[str] | None, small: bool = False) -> list[tuple[str, float, str]]:
    """(variant, speed-up over eager fp32, note) for one model."""
    model, data = build(name, batch, small)
    runs, notes = variants(model, data, only)
    samples = interleaved_samples(runs, rounds=rounds, warmup=1)
    eager = statistics.median(samples["eager fp32"])
    return [(key, eager / statistics.median(times), notes.get(key, "")) for key, times in samples.items()]


def main(argv: list[str] | None = None) -> int:
    parser = script_options(__doc__.splitlines()[0], MODELS, rounds=5, baseline="eager fp32")
    parser.add_argument("--small", action="store_true", help="tiny stand-in models: checks the benchmark runs, measures nothing")
    args = parser.parse_args(argv)
    only = chosen_variants(args.variants)
    heading = (
        f"one training step (forward, cross-entropy, backward, SGD, zero_grad), batch {args.batch}; "
        f"speed-up = eager fp32 / variant, median of {args.rounds} interleaved rounds"
    )
    print_table_head(heading, ["model", "variant", "speed-up vs eager fp32", "note"])
    for name in args.models.split(","):
        for key, speedup, note in measure(name, args.batch, args.rounds, only, args.small):
            print_table_row([name, key, f"{speedup:.2f}x", note])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())

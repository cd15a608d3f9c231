"""Eager PyTorch, graphopt and onnxruntime on the reference models: ``python -m graphopt.bench.compare``.

``make bench-compare`` runs it.

Variants of one model run in the same process, interleaved (A B C A B C ...), after a
warm-up; the table gives the median latency of each as a ratio to eager fp32 NCHW
(higher is faster), and graphopt's own decision on the layout. Run it on a quiet
machine: another CPU job at the same time distorts every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import onnxruntime
import torch
import torch.nn as nn

import graphopt
from graphopt.models import REFERENCE_MODELS
from graphopt.timing import median_latencies


def _eager(model: nn.Module, inputs: tuple[torch.Tensor, ...], context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Callable[[], Any]:
    def run() -> Any:
        with torch.no_grad(), context():
            return model(*inputs)

    return run


def _onnxruntime(path: Path, inputs: tuple[torch.Tensor, ...]) -> Callable[[], Any]:
    options = onnxruntime.SessionOptions()
    # onnxruntime's threads otherwise spin after each run and steal the cores from the next variant
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {spec.name: tensor.numpy() for spec, tensor in zip(session.get_inputs(), inputs, strict=True)}
    return lambda: session.run(None, feeds)


def _plain_onnx(model: nn.Module, inputs: tuple[torch.Tensor, ...], path: Path) -> Path:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, inputs, dynamo=True, verbose=False)
    assert program is not None
    program.save(path)
    return path


def variants(name: str, batch: int, folder: Path | None = None) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """The variants of one reference model, and graphopt's layout decisions as its reports give them."""
    reference = REFERENCE_MODELS[name]
    model = reference.build().eval()
    inputs = reference.example_inputs(batch_size=batch)
    channels_last = reference.build().eval().to(memory_format=torch.channels_last)
    channels_last_inputs = tuple(t.contiguous(memory_format=torch.channels_last) for t in inputs)
    fp32 = graphopt.optimize(model, inputs)
    bf16 = graphopt.optimize(model, inputs, precision="bf16")
    decisions = {label: optimized.graphopt_report["to_channels_last"].notes[-1] for label, optimized in (("fp32", fp32), ("bf16", bf16))}

    def autocast() -> AbstractContextManager[Any]:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    table = {
        "eager fp32": _eager(model, inputs),
        "eager fp32 channels_last": _eager(channels_last, channels_last_inputs),
        "eager bf16 autocast channels_last": _eager(channels_last, channels_last_inputs, autocast),
        "graphopt fp32": lambda: fp32(*inputs),
        "graphopt bf16": lambda: bf16(*inputs),
    }
    if folder is not None:
        graphopt.export_onnx(model, inputs, folder / f"{name}.onnx", compare_plain=False)
        table["onnxruntime plain export"] = _onnxruntime(_plain_onnx(model, inputs, folder / f"{name}.plain.onnx"), inputs)
        table["onnxruntime graphopt export"] = _onnxruntime(folder / f"{name}.onnx", inputs)
    return table, decisions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="*", default=sorted(REFERENCE_MODELS), choices=sorted(REFERENCE_MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-onnx", action="store_true", help="leave out the onnxruntime variants")
    args = parser.parse_args(argv)
    print(f"batch {args.batch}, {torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds; ratio = eager fp32 / variant")
    header_printed = False
    for name in args.models:
        with tempfile.TemporaryDirectory() as folder:
            table, decisions = variants(name, args.batch, None if args.no_onnx else Path(folder))
            latencies = median_latencies(table, rounds=args.rounds, warmup=3)
        if not header_printed:
            print("| model | " + " | ".join(latencies) + " |\n|" + "---|" * (len(latencies) + 1))
            header_printed = True
        base = latencies["eager fp32"]
        print(f"| {name} | " + " | ".join(f"{base / seconds:.2f}x" for seconds in latencies.values()) + " |")
        for label, decision in decisions.items():
            print(f"|   graphopt {label} layout: {decision} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

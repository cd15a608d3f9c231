"""Transformer benchmark: BERT-base- and GPT-2-small-sized models (built from configs, random weights), batch 8,
sequence 128, with an attention mask, called by keyword; graphopt against eager, torch.compile and onnxruntime.

Run ``make bench-transformers`` (or ``python -m graphopt.bench.transformers``) on a quiet machine: every
variant is timed interleaved in one process, and the table gives speedups over eager (median of the rounds)
and each variant's largest error relative to eager's output scale, with the CPU model and thread count.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphopt
from graphopt.bench.scripts import chosen_variants, print_table_head, print_table_row, script_options
from graphopt.errors import error_summary
from graphopt.quiet import FOREIGN_LOG_MESSAGES, TORCHAO_IMPORT_MESSAGES, log_messages_dropped
from graphopt.timing import interleaved_samples


MODELS = ("bert-base", "gpt2-small")


def build(name: str, small: bool = False) -> nn.Module:
    """The model with its real sizes (the configs' defaults), or 2 layers 32 wide with ``small`` (a smoke run)."""
    import transformers

    torch.manual_seed(0)
    with log_messages_dropped(TORCHAO_IMPORT_MESSAGES):  # the model's module imports torchao, where it is installed
        if name == "bert-base":
            sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64) if small else {}
            return transformers.BertModel(transformers.BertConfig(**sizes)).eval()
        if name == "gpt2-small":
            sizes = dict(n_embd=32, n_layer=2, n_head=2) if small else {}
            return transformers.GPT2Model(transformers.GPT2Config(use_cache=False, **sizes)).eval()
    raise SystemExit(f"unknown model {name!r}: use {', '.join(MODELS)}")


def example(batch: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, length - length // 4 :] = 0  # padded rows, as in a batch of sentences of different lengths
    return {"input_ids": torch.randint(0, 1000, (batch, length), generator=generator), "attention_mask": mask}


def first_tensor(output: Any) -> torch.Tensor:
    return output[0] if not isinstance(output, torch.Tensor) else output


def onnxruntime_runner(model: nn.Module, inputs: dict[str, torch.Tensor], workdir: Path) -> Callable[[], Any]:
    import onnxruntime

    path = workdir / "model.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), log_messages_dropped(FOREIGN_LOG_MESSAGES):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)
    assert program is not None
    program.save(str(path))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")  # between the ops of a run ...
    options.add_session_config_entry("session.force_spinning_stop", "1")  # ... not after it (the next variant's cores)
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [spec.name for spec in session.get_inputs()]
    feeds = {name: inputs[name].numpy() for name in names}
    return lambda: torch.from_numpy(session.run(None, feeds)[0])


def variants(model: nn.Module, inputs: dict[str, torch.Tensor], workdir: Path, only: set[str] | None) -> dict[str, Callable[[], Any]]:
    """Each variant as a zero-argument call returning the model's first output (last hidden state)."""
    makers: dict[str, Callable[[], Callable[[], Any]]] = {
        "eager": lambda: lambda: model(**inputs),
        "graphopt default": lambda: (lambda fast: lambda: fast(**inputs))(graphopt.optimize(model, inputs, progress=False)),
        "graphopt tune=True (exact)": lambda: (lambda fast: lambda: fast(**inputs))(graphopt.optimize(model, inputs, tune=True, progress=False)),
        "torch.compile": lambda: (lambda compiled: lambda: compiled(**inputs))(torch.compile(model)),
        "onnxruntime fp32": lambda: onnxruntime_runner(model, inputs, workdir),
    }
    built = {}
    for name, make in makers.items():
        if only and name not in only and name != "eager":
            continue
        try:
            run = make()
            with torch.inference_mode():
                run()  # compiles where the variant compiles
            built[name] = run
        except Exception as error:  # noqa: BLE001 - a failing peer is reported, not fatal
            print(f"  {name}: failed ({error_summary(error)[:200]})")
    return built


def measure(name: str, batch: int, length: int, rounds: int, only: set[str] | None, small: bool = False) -> list[tuple[str, float, float]]:
    """(variant, speedup over eager, max error relative to eager's scale) for one model."""
    model, inputs = build(name, small), example(batch, length)
    with tempfile.TemporaryDirectory() as workdir:
        runs = variants(model, inputs, Path(workdir), only)
        with torch.inference_mode():
            reference = first_tensor(runs["eager"]())
            errors = {key: float((first_tensor(run()) - reference).abs().max() / reference.abs().max()) for key, run in runs.items()}
            samples = interleaved_samples(runs, rounds=rounds, warmup=2)
    eager = statistics.median(samples["eager"])
    return [(key, eager / statistics.median(times), errors[key]) for key, times in samples.items()]


def main(argv: list[str] | None = None) -> int:
    parser = script_options(__doc__.splitlines()[0], MODELS, rounds=10)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--small", action="store_true", help="2-layer, 32-wide models: checks the benchmark runs, measures nothing")
    args = parser.parse_args(argv)
    only = chosen_variants(args.variants)
    heading = f"batch {args.batch}, sequence {args.length}, attention mask; speedup = eager / variant, median of {args.rounds} interleaved rounds"
    print_table_head(heading, ["model", "variant", "speedup vs eager", "max error"])
    for name in args.models.split(","):
        for key, speedup, error in measure(name, args.batch, args.length, args.rounds, only, args.small):
            print_table_row([name, key, f"{speedup:.2f}x", f"{error:.1e}"])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())

"""The ``graphopt`` command line: its parser, `main`, and errors in the command's words.

    graphopt optimize MODULE:FACTORY --input 8x3x224x224 [--mode inference] [--report report.json] [--onnx out.onnx]
    graphopt optimize path/to/net.py:build --input 8x3x224x224   (MODULE may also be a module of the current folder)
    graphopt optimize MODULE:FACTORY --input 8x3x224x224 --save model.pt2 [--package model-aoti.pt2]
    graphopt optimize MODULE:FACTORY --input 8x3x224x224 --tune [--accuracy 3e-2] [--tune-target throughput --tune-batch-size 32]
    graphopt optimize MODULE:FACTORY --input 8x3x224x224 --precision int8 --calibration batches/ [--accuracy 5e-2]
                      (--calibration: a folder of .pt files, a .pt file of a list of batches, or MODULE:FUNCTION)
    graphopt run model.pt2 [--input 4x3x224x224] [--rounds 20] [--allow-import]   (a graphopt.save file or an AOTInductor package)
    graphopt run lm.pt2 --generate [--prompt 15496,11,995|ids.pt] [--max-new-tokens 16] [--do-sample --seed 0] [--output tokens.pt]
    graphopt export MODULE:FACTORY OUT.onnx --input 8x3x224x224 [--precision fp16]
    graphopt diff MODULE:FACTORY --input 8x3x224x224 [--pass fold_conv_bn] [--html diff.html] [--drawing diff.png]
    graphopt lint train.py [--fix] [--format json]
    graphopt demo [--model resnet]
    graphopt bench [--models reference|anchors|NAME,...|MODULE:FACTORY] [--quick] [--output-dir DIR]
    graphopt bench --generate [--models gpt2,llama,qwen2] [--quick] [--output-dir DIR]
    graphopt passes
    graphopt --version

Errors name the command's options (``--overwrite``), not the library's (``overwrite=True``).
Each command's code is in a sibling module: cli_optimize (optimize, export, diff), cli_run, cli_bench (bench, demo),
cli_lint, cli_listings (passes, engines); cli_arguments reads the arguments they share (--input, MODULE:FACTORY, --calibration).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

import torch

from graphopt import __version__
from graphopt.options import MEMORY_FORMATS, TUNE_TARGETS
from graphopt.backends import DEFAULT_ENGINE, ENGINES
from graphopt.backends.fuse_compile import FUSE_BACKENDS
from graphopt.bench.suite import QUICK_VARIANTS
from graphopt.capture import FRONTENDS
from graphopt.cli_arguments import (  # the argument readers, importable from graphopt.cli as before they moved
    CALIBRATION_SOURCES,
    DYNAMIC_CHOICES,
    DYNAMIC_HELP,
    UsageError,
    load_calibration,
    load_factory,
    parse_input_spec,
)
from graphopt.cli_bench import bench_command, demo_command
from graphopt.cli_lint import lint_command
from graphopt.cli_listings import engines_command, passes_command
from graphopt.cli_optimize import diff_command, export_command, optimize_command
from graphopt.cli_run import DEFAULT_NEW_TOKENS, DEFAULT_ROUNDS, _run_inputs, run_command  # _run_inputs: importable from graphopt.cli as before it moved
from graphopt.drawing import FOLDS
from graphopt.dynamic import DEFAULT
from graphopt.errors import GraphoptError
from graphopt.models import REFERENCE_MODELS
from graphopt.precision import INT8, PRECISIONS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphopt", description="Make PyTorch models faster by rewriting their graphs.")
    parser.add_argument("--version", action="version", version=f"graphopt {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("optimize", help="optimize a model built by MODULE:FACTORY and print the report")
    run.add_argument("target", metavar="MODULE:FACTORY", help="e.g. graphopt.models:resnet_small")
    run.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]", help="one per forward() argument, e.g. 8x3x224x224")
    run.add_argument("--mode", choices=("inference", "training"), default="inference", help="default: inference (the model is put in eval mode)")
    run.add_argument("--frontend", choices=FRONTENDS, default="auto")
    run.add_argument("--dynamic-shapes", choices=DYNAMIC_CHOICES, default=DEFAULT, help=DYNAMIC_HELP)
    run.add_argument("--passes", metavar="A,B", help="run exactly these passes, in order")
    run.add_argument("--disable", metavar="A,B", help="leave these passes out")
    checks = run.add_mutually_exclusive_group()
    checks.add_argument("--no-verify", action="store_true", help="skip the checks against the original model")
    checks.add_argument("--strict-verify", action="store_true", help="fail on any mismatch instead of rolling the pass back (for CI)")
    run.add_argument(
        "--memory-format",
        choices=MEMORY_FORMATS,
        default="auto",
        help="channels_last for convs: auto (if it measures faster), channels_last, preserve",
    )
    run.add_argument("--keep-channels-last-outputs", action="store_true", help="leave 4-D outputs in channels_last")
    run.add_argument(
        "--precision",
        choices=(*PRECISIONS, INT8),
        default="fp32",
        help="bf16/fp16: conv, linear, matmul in low precision (opt-in); int8 (CPU inference, with --calibration): "
        "convs and linears on oneDNN's int8 kernels, each layer over --accuracy kept in float32",
    )
    run.add_argument("--calibration", metavar="SOURCE", help=f"with --precision int8 (or --tune): the batches each layer's input range is measured on: {CALIBRATION_SOURCES}")
    run.add_argument(
        "--fuse",
        choices=(*FUSE_BACKENDS, "off"),
        default=None,
        help="compile pointwise regions (inductor, torchscript) or the whole graph; off: compile nothing (fuse=False: a language model's decode step is left as ops too)",
    )
    run.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default=DEFAULT_ENGINE,
        help="the runtime the optimized graph runs on (inference; see graphopt engines); default: graphopt's own PyTorch runtime",
    )
    run.add_argument("--tune", action="store_true", help="time candidate configurations (every installed engine too) and keep the fastest within --accuracy")
    run.add_argument(
        "--tune-target",
        choices=TUNE_TARGETS,
        default="latency",
        help="with --tune: rank by latency on the example inputs (default) or by throughput at --tune-batch-size",
    )
    run.add_argument("--tune-batch-size", type=int, metavar="N", help="with --tune-target throughput: the batch size to time the candidates at")
    run.add_argument(
        "--accuracy",
        type=float,
        default=None,
        help="largest error allowed, relative to the output scale: with --tune (default 1e-4; 3e-2 admits bf16) "
        "or --precision int8 (default 5e-2)",
    )
    run.add_argument("--report", metavar="PATH", help="also write the report as JSON")
    run.add_argument("--seed", type=int, default=0, help="seed of the random example inputs")
    run.add_argument("--onnx", metavar="PATH", help="also export the optimized model to ONNX (inference mode, checked)")
    run.add_argument("--save", metavar="PATH.pt2", help="also save the optimized module (graphopt.save; graphopt run loads and times it)")
    run.add_argument("--package", metavar="PATH.pt2", help="also compile it ahead of time into an AOTInductor package (inference; slow to build)")
    run.add_argument("--overwrite", action="store_true", help="with --onnx, --save or --package: replace an existing file")
    run.add_argument("--no-progress", action="store_true", help="no status line on stderr (shown on a terminal only anyway)")
    run.set_defaults(handler=optimize_command)

    run_file = commands.add_parser("run", help="load a file graphopt optimize --save (or --package) wrote and time it on random inputs")
    run_file.add_argument("file", metavar="FILE.pt2", help="a graphopt.save file or an AOTInductor package")
    run_file.add_argument(
        "--input",
        action="append",
        metavar="SHAPE[:DTYPE]",
        help="one per input (default for graphopt files: the example's sizes); DTYPE defaults to the file's, integers are 0 or 1",
    )
    run_file.add_argument(
        "--allow-import",
        action="store_true",
        help="import the modules of the file's input and output classes (e.g. transformers.modeling_outputs); this runs "
        "their code: only for files you trust",
    )
    run_file.add_argument("--rounds", type=_positive_int, help=f"timed calls (default {DEFAULT_ROUNDS})")
    run_file.add_argument("--seed", type=int, default=0, help="seed of the random inputs (with --generate --do-sample: of the sampling)")
    run_file.add_argument("--generate", action="store_true", help="a saved language model: generate token ids from --prompt (printed one sequence a line)")
    run_file.add_argument(
        "--prompt",
        metavar="IDS|FILE.pt",
        help="with --generate: token ids joined by commas (one prompt, e.g. 15496,11,995), or a .pt file of an integer tensor (batch, length) "
        "or of a dict of input_ids and attention_mask (left-padded); default: the example's sizes, token 0",
    )
    run_file.add_argument("--max-new-tokens", type=_positive_int, help=f"with --generate: tokens generated per sequence (default {DEFAULT_NEW_TOKENS})")
    run_file.add_argument("--do-sample", action="store_true", help="with --generate: sample (from --seed) instead of greedy")
    run_file.add_argument("--output", metavar="PATH.pt", help="with --generate: also write the token ids (prompt included) with torch.save")
    run_file.set_defaults(handler=run_command)

    show = commands.add_parser("diff", help="optimize and show what changed in the graph (whole pipeline or one pass)")
    show.add_argument("target", metavar="MODULE:FACTORY", help="e.g. graphopt.models:resnet_small")
    show.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]", help="one per forward() argument")
    show.add_argument("--pass", dest="pass_name", metavar="NAME", help="the diff of this pass only")
    show.add_argument("--mode", choices=("inference", "training"), default="inference")
    show.add_argument("--memory-format", choices=MEMORY_FORMATS, default="auto")
    show.add_argument("--precision", choices=PRECISIONS, default="fp32")
    show.add_argument("--html", metavar="PATH", help="also write a self-contained HTML diff: the drawn graph, op counts, side by side")
    show.add_argument("--drawing", metavar="PATH", help="also write the drawn graph alone: .svg, .html, or .png (needs Chromium)")
    show.add_argument("--fold", choices=FOLDS, default="auto", help="what the drawing (--html, --drawing) folds: unchanged modules and, "
                      "on large graphs, modules at the deepest level that fits (auto), unchanged modules only, or nothing")
    show.add_argument("--expand", action="append", metavar="MODULE", help="keep this module open in the drawing (repeatable)")
    show.add_argument("--seed", type=int, default=0, help="seed of the random example inputs")
    show.add_argument("--no-progress", action="store_true", help="no status line on stderr (shown on a terminal only anyway)")
    show.set_defaults(handler=diff_command)

    lint = commands.add_parser("lint", help="check training scripts against the performance playbook")
    lint.add_argument("paths", nargs="+", metavar="PATH", help="Python files or folders")
    lint.add_argument("--fix", action="store_true", help="apply the safe fixes in place")
    lint.add_argument("--format", choices=("text", "json"), default="text")
    lint.add_argument("--select", metavar="CODES", help="only these rule codes, e.g. GO101,GO301")
    lint.set_defaults(handler=lint_command)

    export = commands.add_parser("export", help="optimize for inference, export to ONNX and check it with onnxruntime")
    export.add_argument("target", metavar="MODULE:FACTORY", help="e.g. graphopt.models:resnet_small")
    export.add_argument("output", metavar="OUT.onnx")
    export.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]", help="one per forward() argument")
    export.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    export.add_argument("--dynamic-shapes", choices=DYNAMIC_CHOICES, default=DEFAULT, help=DYNAMIC_HELP)
    export.add_argument("--precision", choices=("fp32", "fp16"), default="fp32", help="fp16: fp16 weights, fp32 inputs and outputs")
    export.add_argument("--no-optimize", action="store_true", help="export the model as it is")
    export.add_argument("--overwrite", action="store_true", help="replace an existing file")
    export.add_argument("--seed", type=int, default=0, help="seed of the random example inputs")
    export.add_argument("--no-progress", action="store_true", help="no status line on stderr (shown on a terminal only anyway)")
    export.set_defaults(handler=export_command)

    demo = commands.add_parser("demo", help="optimize a built-in model and compare its latency with eager")
    demo.add_argument("--model", choices=sorted(REFERENCE_MODELS), default="resnet")
    demo.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the model's example batch)")
    demo.set_defaults(handler=demo_command)

    bench = commands.add_parser("bench", help="time eager PyTorch, graphopt and its peers side by side; write JSON, markdown and a plot")
    bench.add_argument(
        "--models", metavar="SELECTION", help="reference (default), anchors, model names or MODULE:FACTORY, comma-separated"
    )
    bench.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]", help="inputs of MODULE:FACTORY models (default BATCHx3x224x224)")
    bench.add_argument("--batch", type=_positive_int, help="batch size of the named models (default 8; --quick: 2)")
    bench.add_argument("--device", help="auto (default: cuda when available), cpu, cuda or cuda:N")
    bench.add_argument("--variants", metavar="PATTERNS", help="only these variant keys, shell-style, e.g. 'eager*,graphopt*' (see --list-variants)")
    bench.add_argument("--exclude", metavar="PATTERNS", help="leave out these variant keys, e.g. 'compile*'")
    bench.add_argument("--list-variants", action="store_true", help="list the variants and exit")
    bench.add_argument("--rounds", type=_positive_int, help="interleaved timing rounds (default 20; --quick: 2)")
    bench.add_argument("--warmup", type=int, help="warm-up calls per variant after the first (default 3; --quick: 1)")
    bench.add_argument("--low-precision", choices=("bf16", "fp16"), help="dtype of the autocast/low-precision variants (default: bf16 where supported)")
    bench.add_argument("--time-budget", type=float, metavar="MINUTES", help="start no variant after this many minutes (the rest is listed as skipped)")
    bench.add_argument("--output-dir", metavar="DIR", help="where bench.json, bench.md and bench.png go (default bench-results; --generate: bench-results/generate)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run for CI, well under a minute: the smallest model (unless --models), batch 2, 2 rounds, the variants "
        f"{','.join(QUICK_VARIANTS)} (unless --variants); figures mean nothing",
    )
    bench.add_argument(
        "--generate",
        action="store_true",
        help="time generate() of causal language models (GPT-2 124M, a small Llama, a Qwen2) against transformers and optimum-intel: time to "
        "first token and per new token (make bench-generate); reads --models (gpt2,llama,qwen2), --rounds (default 5), --variants, --exclude, "
        "--list-variants, --output-dir, and --quick (tiny 2-layer models, 1 round, 4 new tokens)",
    )
    bench.set_defaults(handler=bench_command)

    passes = commands.add_parser("passes", help="list the available passes: modes, where each runs by default or how to ask for it")
    passes.set_defaults(handler=passes_command)

    engines = commands.add_parser("engines", help="list the engines an optimized graph can run on (--engine), their precisions and whether each is installed")
    engines.set_defaults(handler=engines_command)
    return parser


# `name=value` in a library message: True/False/None, a quoted string, a list, a dict (one level of nesting: a
# torch.export spec), a number, or nothing (`passes=`)
_PYTHON_OPTION = re.compile(
    r"\b([a-z_]+)=(True|False|None|'[^']*'|\[[^\]]*\]|\{(?:[^{}]|\{[^{}]*\})*\}|[0-9][0-9.e+-]*|(?=[\s.,;:)]|$))"
)
_CALL = re.compile(r"(?:graphopt\.)?optimize\(\.\.\., ([^()]*)\)")  # "graphopt.optimize(..., mode='training')"


def cli_words(message: str, command: argparse.ArgumentParser) -> str:
    """``message`` with the library's option spellings (``overwrite=True``) in ``command``'s (``--overwrite``)."""
    flags = {action.dest: action.option_strings[-1] for action in command._actions if action.option_strings}
    choices = {action.dest: [str(choice) for choice in action.choices] for action in command._actions if action.option_strings and action.choices}
    special = {("verify", "'strict'"): "--strict-verify", ("verify", "False"): "--no-verify"}

    def flag(match: re.Match[str]) -> str:
        name, value = match.groups()
        if (name, value) in special and special[(name, value)] in flags.values():
            return special[(name, value)]
        if name not in flags:
            return match.group(0)
        if value in ("True", ""):
            return flags[name]
        if value.startswith("["):
            value = ",".join(re.findall(r"'([^']*)'", value))
        value = value.strip(chr(39))
        if name in choices:  # the command's own spelling of the value (None -> none), or every value it takes
            spelled = [choice for choice in choices[name] if choice.lower() == value.lower()]
            value = spelled[0] if spelled else "{" + ",".join(choices[name]) + "}"
        return f"{flags[name]} {value}"

    return _PYTHON_OPTION.sub(flag, _CALL.sub(lambda call: call.group(1), message))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except GraphoptError as error:
        commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        print(f"graphopt: error: {cli_words(str(error), commands.choices[args.command])}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

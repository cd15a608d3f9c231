"""``graphopt run``: load a file ``graphopt optimize --save`` (or ``--package``) wrote, run it on random inputs of the
file's signature (or the --input shapes) and time it; or, with ``--generate``, generate token ids with a saved language
model's ``generate()`` from the ``--prompt`` ids, printed one sequence a line (and written with ``--output``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphopt.cli_arguments import DTYPES, UsageError, parse_input_spec, saved_tensors
from graphopt.errors import ImportNotAllowedError
from graphopt.inputs import InputSignature, TensorSpec
from graphopt.runtime import OptimizedModule
from graphopt.saving import is_aoti_package, load
from graphopt.timing import median_latencies


def _run_inputs(specs: list[str], signature: InputSignature | None, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random tensors of the --input shapes for ``graphopt run``. A spec without a dtype takes the saved signature's
    (``2x128`` for token ids is int64); integers are 0 or 1, valid token ids, masks and token types whatever the vocabulary."""
    saved = [leaf.dtype for leaf in signature.leaves if isinstance(leaf, TensorSpec)] if signature else []
    dtype_names = {dtype: name for name, dtype in DTYPES.items()}
    specs = [
        f"{spec}:{dtype_names[saved[index]]}" if ":" not in spec and index < len(saved) and saved[index] in dtype_names else spec
        for index, spec in enumerate(specs)
    ]
    return tuple(parse_input_spec(spec, generator, integers_below=2) for spec in specs)


def run_command(args: argparse.Namespace) -> int:
    path = Path(args.file)
    _check_generation_options(args)
    prompt = _prompt(args.prompt) if args.prompt is not None else None  # read before the file: a bad one is refused at once
    started = time.perf_counter()
    if is_aoti_package(path):  # otherwise graphopt.load reads it, or says what is wrong with it
        if args.generate:
            raise UsageError(f"{path} is an AOTInductor package, which holds a model's forward only: --generate needs a file graphopt.save wrote of a language model")
        if not args.input:
            raise UsageError("an AOTInductor package does not record its inputs: give their shapes with --input, e.g. --input 8x3x224x224")
        runner: Callable[..., Any] = torch._inductor.aoti_load_package(str(path))
        signature, kind = None, "AOTInductor package"
    else:
        runner = _load(path, args.allow_import)
        if args.generate:
            return _generate(runner, path, args, prompt, time.perf_counter() - started)
        signature = runner.input_signature
        kind = f"graphopt module; accepts {signature.describe()}" if signature else "graphopt module"
    loaded_s = time.perf_counter() - started
    if args.input:
        inputs = _run_inputs(args.input, signature, torch.Generator().manual_seed(args.seed))
    else:
        inputs = runner.input_signature.example_inputs()  # the sizes it was optimized at (integers 0)
    with torch.no_grad():
        outputs = runner(*inputs)
    shapes = [list(leaf.shape) for leaf in torch.utils._pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]
    print(f"{path}: {kind}; loaded in {loaded_s:.2f}s")
    print(f"inputs {[list(leaf.shape) for leaf in torch.utils._pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]} -> outputs {shapes}")
    rounds = args.rounds or DEFAULT_ROUNDS
    latency = median_latencies({"run": lambda: runner(*inputs)}, rounds=rounds)["run"]
    print(f"median latency {latency * 1e3:.2f} ms over {rounds} rounds on {torch.get_num_threads()} threads")
    return 0


def _load(path: Path, allow_import: bool) -> OptimizedModule:
    """graphopt.load, its refusal to import in the command's words (--allow-import)."""
    try:
        return load(path, allow_import=allow_import)
    except ImportNotAllowedError as error:
        raise UsageError(
            f"{error.reason}: add --allow-import to let graphopt import {', '.join(error.modules)} (it runs that module's code: "
            "allow it for files you trust)"
        ) from error


DEFAULT_ROUNDS = 20
GENERATION_OPTIONS = {"prompt": "--prompt", "max_new_tokens": "--max-new-tokens", "do_sample": "--do-sample", "output": "--output"}
DEFAULT_NEW_TOKENS = 16


def _check_generation_options(args: argparse.Namespace) -> None:
    """Refuse options of one way of running with the other: --input and --rounds time calls, --prompt and the rest generate."""
    if args.generate and (args.input or args.rounds is not None):
        raise UsageError("--input and --rounds time the module's calls; with --generate, give the prompt's token ids with --prompt")
    given = [flag for name, flag in GENERATION_OPTIONS.items() if getattr(args, name) not in (None, False)]
    if given and not args.generate:
        raise UsageError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --generate: add --generate to generate token ids")


def _prompt(text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's token ids and attention mask from ``--prompt``: comma-separated ids (one prompt), or a .pt file of an
    integer tensor (batch, length) or of a dict of ``input_ids`` and ``attention_mask`` (a tokenizer's output)."""
    if text.endswith(".pt"):
        if not Path(text).is_file():
            raise UsageError(f"--prompt {text}: no such file; give token ids (e.g. --prompt 15496,11,995) or a .pt file of them")
        saved = saved_tensors(Path(text), "--prompt")
        ids, mask = (saved.get("input_ids"), saved.get("attention_mask")) if isinstance(saved, dict) else (saved, None)
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() and not ids.is_complex()):
            raise UsageError(
                f"--prompt {text} holds no token ids: save an integer tensor shaped (batch, length), or a dict of input_ids and "
                "attention_mask (a tokenizer's output, padded on the left)"
            )
        return ids, mask if mask is not None else torch.ones_like(ids)
    try:
        ids = torch.tensor([[int(token) for token in text.split(",")]])
    except ValueError:
        raise UsageError(f"--prompt {text!r} is not token ids: write them joined by commas, e.g. 15496,11,995, or give a .pt file of them") from None
    return ids, torch.ones_like(ids)


def _example_prompt(module: OptimizedModule) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt without ``--prompt``: the example's sizes, token 0 (a token of every vocabulary)."""
    signature = module.input_signature
    spec = next((leaf for leaf in signature.leaves if isinstance(leaf, TensorSpec) and leaf.name == "input_ids"), None) if signature else None
    if spec is None:
        raise UsageError("the file records no input_ids to take the prompt's sizes from: give the prompt's token ids with --prompt")
    ids = torch.zeros(spec.example, dtype=torch.long)
    return ids, torch.ones_like(ids)


def _generate(module: OptimizedModule, path: Path, args: argparse.Namespace, prompt: tuple[torch.Tensor, torch.Tensor] | None, loaded_s: float) -> int:
    """``--generate``: token ids from the saved language model's generate() on ``prompt`` (None: `_example_prompt`),
    prompt included, one sequence a line."""
    report = module.graphopt_report.generation
    if module.generator is None or report is None:
        raise UsageError(f"{path} holds no generate(): it is not a causal language model optimized with its key/value cache on. Run it without --generate")
    ids, mask = prompt or _example_prompt(module)
    new_tokens = args.max_new_tokens if args.max_new_tokens is not None else DEFAULT_NEW_TOKENS
    torch.manual_seed(args.seed)  # what sampling draws from, as for the original model's generate()
    started = time.perf_counter()
    tokens = module.generate(ids, mask, max_new_tokens=new_tokens, do_sample=args.do_sample)
    generated_s = time.perf_counter() - started
    print(f"{path}: graphopt language model; generate() on {report.engine} ({report.precision}), up to {report.max_length} positions; loaded in {loaded_s:.2f}s")
    how = f"sampled from seed {args.seed}" if args.do_sample else "greedy"
    print(f"prompt {list(ids.shape)} -> tokens {list(tokens.shape)} ({how}) in {generated_s:.2f}s")
    for sequence in tokens.tolist():
        print(",".join(map(str, sequence)))
    if args.output:
        torch.save(tokens, args.output)
        print(f"token ids written to {args.output}")
    return 0

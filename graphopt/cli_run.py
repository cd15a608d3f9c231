"""``graphopt run``: load a file ``graphopt optimize --save`` (or ``--package``) wrote, run it on random inputs of the
file's signature (or the --input shapes) and time it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphopt.cli_arguments import DTYPES, UsageError, parse_input_spec
from graphopt.errors import ImportNotAllowedError
from graphopt.inputs import InputSignature, TensorSpec
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
    started = time.perf_counter()
    if is_aoti_package(path):  # otherwise graphopt.load reads it, or says what is wrong with it
        if not args.input:
            raise UsageError("an AOTInductor package does not record its inputs: give their shapes with --input, e.g. --input 8x3x224x224")
        runner: Callable[..., Any] = torch._inductor.aoti_load_package(str(path))
        signature, kind = None, "AOTInductor package"
    else:
        try:
            runner = load(path, allow_import=args.allow_import)
        except ImportNotAllowedError as error:
            raise UsageError(
                f"{error.reason}: add --allow-import to let graphopt import {', '.join(error.modules)} (it runs that module's code: "
                "allow it for files you trust)"
            ) from error
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
    latency = median_latencies({"run": lambda: runner(*inputs)}, rounds=args.rounds)["run"]
    print(f"median latency {latency * 1e3:.2f} ms over {args.rounds} rounds on {torch.get_num_threads()} threads")
    return 0

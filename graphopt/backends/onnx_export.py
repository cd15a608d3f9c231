"""Export an optimized model to ONNX and check it with onnx.checker and onnxruntime.

``graphopt.export_onnx`` optimizes the model for inference (BatchNorm folded, dropout
removed; the layout is kept, since ONNX has no memory format), exports the optimized
graph with ``torch.onnx.export(..., dynamo=True)`` with a dynamic batch dimension, then:

1. ``onnx.checker.check_model(path, full_check=True)``;
2. runs onnxruntime on the example inputs and on a batch one larger, and compares with
   the original PyTorch model (tolerance of the lowest precision computed in);
3. exports the original model the same plain way, to compare node counts.

The files are written into a temporary folder beside the destination and moved into
place only when every check passed: a failure leaves nothing half-written, and an
existing file is replaced only with ``overwrite=True``. Models over 2 GB are saved with
external data (``<name>.data`` beside the ``.onnx`` file). precision="fp16" exports fp16
weights between fp32 inputs and outputs (the casts are in the graph); bf16 has no
onnxruntime CPU kernels and is refused with that reason.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnxruntime
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.verify import compare
from graphopt.api import OptimizedModule, optimize as optimize_model
from graphopt.capture import one_at_a_time
from graphopt.errors import ExportError, VerificationError
from graphopt.passes.use_onednn_kernels import prepacked_modules
from graphopt.report import Report
from graphopt.validate import check_inputs, check_model, reference_run


@dataclass
class ExportReport:
    """What `export_onnx` wrote and how it checked it."""

    path: str
    files: list[str]
    opset: int
    node_counts: dict[str, int]
    plain_node_counts: dict[str, int] | None  # a plain torch.onnx.export of the original model
    max_error: float
    batch_sizes: list[int]  # batch sizes run in onnxruntime
    seconds: float
    optimize_report: Report | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return sum(self.node_counts.values())

    def __str__(self) -> str:
        plain = self.plain_node_counts
        lines = [
            f"ONNX export: {self.path} (opset {self.opset}, {len(self.files)} file(s), {self.seconds:.1f}s)",
            f"checked: onnx.checker full check; onnxruntime at batch sizes {self.batch_sizes}, max error {self.max_error:.1e}",
            f"nodes: {self.nodes}" + (f" (plain export of the original: {sum(plain.values())})" if plain is not None else ""),
        ]
        for op in sorted(set(self.node_counts) | set(plain or {})):
            before = f"{plain.get(op, 0):>5}" if plain is not None else ""
            lines.append(f"  {op:<24}{before} -> {self.node_counts.get(op, 0)}")
        return "\n".join([*lines, *self.notes])


def _dynamic_shapes(args: tuple[Any, ...], dynamic_batch: bool) -> tuple[Any, ...] | None:
    if not dynamic_batch:
        return None
    return tuple(
        pytree.tree_map(lambda leaf: {0: torch.export.Dim.AUTO} if isinstance(leaf, torch.Tensor) and leaf.dim() else None, arg)
        for arg in args
    )


def _export(
    module: nn.Module, args: tuple[Any, ...], destination: Path, dynamic_batch: bool, opset: int | None, external_data: bool | None = None
) -> None:
    """torch.onnx.export (dynamo) of ``module`` to ``destination``; external data when asked or over 2 GB."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # the exporter's progress and deprecation chatter, not the user's concern
        program = torch.onnx.export(
            module, args, dynamo=True, dynamic_shapes=_dynamic_shapes(args, dynamic_batch), opset_version=opset, verbose=False
        )
    assert program is not None
    program.save(destination, external_data=external_data)


def _node_counts(path: Path) -> tuple[dict[str, int], int]:
    model = onnx.load(str(path), load_external_data=False)
    opset = next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))
    return dict(collections.Counter(node.op_type for node in model.graph.node)), opset


def _larger_batch(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The example inputs with one more sample (the first repeated)."""
    return pytree.tree_map(lambda t: torch.cat([t, t[:1]]) if isinstance(t, torch.Tensor) and t.dim() else t, args)


def _run_onnxruntime(path: Path, args: tuple[Any, ...]) -> list[torch.Tensor]:
    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        tensors = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        feeds = {spec.name: tensor.detach().cpu().numpy() for spec, tensor in zip(session.get_inputs(), tensors, strict=False)}
        return [torch.from_numpy(output) for output in session.run(None, feeds)]
    except Exception as error:
        raise ExportError(f"onnxruntime could not run the exported model ({type(error).__name__}: {error})") from error


@one_at_a_time
def export_onnx(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    optimize: bool = True,
    dynamic_batch: bool = True,
    opset: int | None = None,
    verify: bool = True,
    overwrite: bool = False,
    compare_plain: bool = True,
    external_data: bool | None = None,
    **optimize_options: Any,
) -> ExportReport:
    """Optimize ``model`` for inference, export it to ONNX at ``path``, and check the file.

    ``optimize_options`` go to `graphopt.optimize` (``memory_format`` defaults to
    ``"preserve"`` here, ``mode`` to ``"inference"``). An `OptimizedModule` with
    ``optimize=False`` is exported as it is. ``external_data``: weights in a
    ``<name>.data`` file (None: only for models over 2 GB). ``compare_plain``: also
    export the original model plainly, for the node counts in the report. Raises `ExportError` when the exporter,
    the checker or onnxruntime fails, `VerificationError` when onnxruntime's outputs
    differ from PyTorch's.
    """
    started = time.perf_counter()
    check_model(model)
    args = check_inputs(model, example_inputs)
    destination = Path(path)
    if destination.suffix != ".onnx":
        raise ExportError(f"{destination} does not end in .onnx: name the file you want written, e.g. model.onnx")
    existing = [p for p in (destination, destination.with_name(destination.name + ".data")) if p.exists()]
    if existing and not overwrite:
        raise ExportError(f"{existing[0]} exists: pass overwrite=True to replace it, or choose another path")
    if not destination.parent.is_dir():
        raise ExportError(f"folder {destination.parent} does not exist: create it first")
    stores_bf16 = isinstance(model, OptimizedModule) and any(p.dtype == torch.bfloat16 for p in model.parameters())
    if optimize_options.get("precision") == "bf16" or stores_bf16:
        raise ExportError("precision='bf16' cannot be checked: onnxruntime has no bf16 CPU kernels. Export with precision='fp16' or 'fp32'")
    if isinstance(model, OptimizedModule) and model.graphopt_report.mode != "inference":
        raise ExportError("this module was optimized for training: ONNX export is for inference, optimize it with mode='inference'")
    if prepacked_modules(model):
        raise ExportError(
            f"this module runs oneDNN kernels with prepacked weights ({', '.join(prepacked_modules(model)[:3])}, ...), which ONNX "
            "cannot express: export the original model, or one optimized with graphopt.optimize(..., disable=['use_onednn_kernels'])"
        )
    if optimize and "use_onednn_kernels" in (optimize_options.get("passes") or ()):
        raise ExportError("passes= asks for use_onednn_kernels, whose oneDNN kernels ONNX cannot express: leave it out")

    # what onnxruntime must reproduce: the model in eval mode (the user's own stays as it is)
    reference = model if isinstance(model, OptimizedModule) else copy.deepcopy(model).eval()
    if optimize:
        optimize_options.setdefault("memory_format", "preserve")
        optimize_options.setdefault("mode", "inference")
        # CPU-only kernels have no ONNX form; in-place writes save allocations in PyTorch only
        optimize_options["disable"] = [*optimize_options.get("disable", ()), "use_onednn_kernels", "compute_in_place"]
        optimized = optimize_model(model, args, dynamic_batch=dynamic_batch, verify=verify, **optimize_options)
        exported, report = optimized.graph_module, optimized.graphopt_report
    elif isinstance(model, OptimizedModule):
        exported, report = model.graph_module, model.graphopt_report
    else:
        exported, report = model, None

    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=f".{destination.name}.") as scratch:
        staged = Path(scratch) / destination.name
        try:
            _export(exported, args, staged, dynamic_batch, opset, external_data)
        except Exception as error:
            raise ExportError(
                f"torch.onnx.export could not export {type(model).__name__} ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}). Nothing was written."
            ) from error
        try:
            onnx.checker.check_model(str(staged), full_check=True)
        except Exception as error:
            raise ExportError(f"the exported model fails onnx.checker ({error}). Nothing was written.") from error
        node_counts, opset_used = _node_counts(staged)

        batch_sizes: list[int] = []
        max_error = 0.0
        if verify:
            compute_dtype = {"fp16": torch.float16}.get(optimize_options.get("precision", "fp32"))
            for batch_args in (args, _larger_batch(args)) if dynamic_batch else (args,):
                outputs = reference_run(reference, batch_args).outputs
                expected = [leaf for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]
                comparison = compare(expected, _run_onnxruntime(staged, batch_args), compute_dtype)
                if not comparison.ok:
                    raise VerificationError(
                        f"onnxruntime's {comparison.where} differs from PyTorch by {comparison.max_error:.3e} relative to the "
                        f"output's scale (tolerance {comparison.tolerance:.0e}). Nothing was written.",
                        max_error=comparison.max_error,
                    )
                max_error = max(max_error, comparison.max_error)
                batch_sizes.append(int(next(t for t in pytree.tree_leaves(batch_args) if isinstance(t, torch.Tensor)).shape[0]))

        plain_counts = None
        if compare_plain and not isinstance(model, OptimizedModule):
            plain = Path(scratch) / "plain" / destination.name
            plain.parent.mkdir()
            try:
                _export(reference, args, plain, dynamic_batch, opset)
                plain_counts = _node_counts(plain)[0]
            except Exception:  # the baseline is informative only: graphopt may export what plain export cannot
                plain_counts = None
        files = []
        for produced in sorted(Path(scratch).iterdir()):
            if produced.is_file():
                target = destination.with_name(produced.name)
                os.replace(produced, target)
                files.append(str(target))
    return ExportReport(
        path=str(destination),
        files=files,
        opset=opset_used,
        node_counts=node_counts,
        plain_node_counts=plain_counts,
        max_error=max_error,
        batch_sizes=batch_sizes,
        seconds=time.perf_counter() - started,
        optimize_report=report,
    )


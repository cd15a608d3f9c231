"""The ONNX backend: export a module with ``torch.onnx.export(..., dynamo=True)`` and check the file.

`graphopt.export_onnx` (`graphopt.export`) chooses what to export (the model optimized for
inference, BatchNorm folded, dropout removed, the layout kept since ONNX has no memory
format); `write_checked` exports it with the dimensions the optimized module takes other
sizes of dynamic (`graphopt.dynamic`: by default the batch and the sequence lengths), named
``batch`` and ``sequence`` in the file, its outputs named after the model's output structure
(`dimension_names`, `output_names`), then:

1. ``onnx.checker.check_model(path, full_check=True)``;
2. runs onnxruntime on the example inputs and on a second input with another size of
   each dynamic dimension (`graphopt.inputs.other_inputs`), and compares with the
   original PyTorch model (tolerance of the lowest precision computed in);
3. exports the original model the same plain way, to compare node counts.

The files are written into a temporary folder beside the destination and moved into
place only when every check passed: a failure leaves nothing half-written, and an
existing file is replaced only with ``overwrite=True``. Models over 2 GB are saved with
external data (``<name>.data`` beside the ``.onnx`` file). precision="fp16" exports fp16
weights between fp32 inputs and outputs (the casts are in the graph); bf16 has no
onnxruntime CPU kernels and is refused with that reason. onnx and onnxruntime are imported
where they are used, so that ``import graphopt`` does not load them.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.dynamic import Dims, auto_spec, batch_size, describe
from graphopt.errors import ExportError, VerificationError, error_summary
from graphopt.inputs import other_inputs
from graphopt.trees import leaves_with_paths
from graphopt.report import Report
from graphopt.validate import reference_run
from graphopt.verify import compare


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
    dynamic: str = ""  # the input dimensions the file takes other sizes of, e.g. "input_ids dims 0, 1"
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
            f"dynamic sizes: {self.dynamic or 'none'}",
            f"nodes: {self.nodes}" + (f" (plain export of the original: {sum(plain.values())})" if plain is not None else ""),
        ]
        for op in sorted(set(self.node_counts) | set(plain or {})):
            before = f"{plain.get(op, 0):>5}" if plain is not None else ""
            lines.append(f"  {op:<24}{before} -> {self.node_counts.get(op, 0)}")
        return "\n".join([*lines, *self.notes])


def dimension_names(args: tuple[Any, ...], dynamic: Dims) -> list[dict[int, str]]:
    """Per leaf of ``args``, a name for each dynamic dimension: ``batch`` for dim 0 at the example's batch size,
    ``sequence`` for the other dims (``sequence_2``, ... for further sizes). Dimensions of one size share a name,
    as they share a second size in verification (`graphopt.dynamic.second_sizes`): BERT's ids and mask get one
    ``batch`` and one ``sequence``."""
    batch = batch_size(args)
    by_size: dict[int, str] = {}
    names = []
    for leaf, dims in zip(pytree.tree_leaves(args), dynamic, strict=True):
        mine = {}
        for dim in sorted(dims):
            size = int(leaf.shape[dim])
            if dim == 0 and size == batch:
                mine[dim] = "batch"
            else:
                sequences = sum(name.startswith("sequence") for name in by_size.values())
                mine[dim] = by_size.setdefault(size, "sequence" if sequences == 0 else f"sequence_{sequences + 1}")
        names.append(mine)
    return names


def output_names(outputs: Any) -> list[str]:
    """A name per tensor of ``outputs`` after the model's output structure: a ModelOutput's or dict's field names
    (``last_hidden_state``), ``output_0``, ``output_1``, ... for a tuple, ``output`` for a single tensor."""
    if isinstance(outputs, torch.Tensor):
        return ["output"]
    leaves = leaves_with_paths(outputs)
    names = []
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        parts = [str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path]
        top_is_sequence = isinstance(path[0], pytree.SequenceKey) if path else False
        names.append("_".join(["output", *parts] if top_is_sequence or not parts else parts))
    return names


def _rename(program: Any, args: tuple[Any, ...], dynamic: Dims, outputs: list[str] | None) -> None:
    """Give ``program``'s dynamic dimensions the names of `dimension_names` (torch.export calls them ``s77``, one symbol
    per input) and its outputs ``outputs`` (torch calls them after the last op: ``linear``, ``tanh``)."""
    import onnx_ir as ir  # the exporter's own IR; imported with the exporter, not with graphopt

    graph = program.model.graph
    mapping: dict[str, str] = {}
    leaves = pytree.tree_leaves(args)
    tensor_names = [names for leaf, names in zip(leaves, dimension_names(args, dynamic)) if isinstance(leaf, torch.Tensor)]
    if len(tensor_names) != len(graph.inputs):  # the file's inputs are args' tensors, in order; else leave the names
        tensor_names = []
    for value, names in zip(graph.inputs, tensor_names):
        for dim, name in names.items():
            symbol = value.shape[dim] if value.shape is not None else None
            if isinstance(symbol, ir.SymbolicDim) and isinstance(symbol.value, str):
                mapping.setdefault(symbol.value, name)
    if mapping:
        symbols = re.compile(r"\b(" + "|".join(map(re.escape, mapping)) + r")\b")  # also inside "s77 + 1"
        values = [*graph.inputs, *graph.outputs, *(out for node in graph.all_nodes() for out in node.outputs)]
        def renamed(dim: Any) -> Any:
            symbolic = isinstance(dim, ir.SymbolicDim) and isinstance(dim.value, str)
            return symbols.sub(lambda match: mapping[match.group(0)], dim.value) if symbolic else dim

        for value in values:
            if value.shape is not None:
                value.shape = ir.Shape([renamed(dim) for dim in value.shape])
    if outputs is not None and len(outputs) == len(graph.outputs) and len(set(outputs)) == len(outputs):
        taken = {out.name for node in graph.all_nodes() for out in node.outputs} - {value.name for value in graph.outputs}
        taken |= {value.name for value in graph.inputs} | set(graph.initializers)
        if not taken & set(outputs):  # a name an inner value already has would make the file invalid
            for value, name in zip(graph.outputs, outputs):
                value.name = name


def onnx_program(
    module: nn.Module | torch.export.ExportedProgram,
    args: tuple[Any, ...],
    dynamic: Dims,
    opset: int | None = None,
    outputs: list[str] | None = None,
) -> torch.onnx.ONNXProgram:
    """torch.onnx.export (dynamo) of ``module``, or of a program torch.export already made from it on ``args``, with
    readable dimension and output names (`_rename`). Raises the exporter's own error."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")  # the exporter's progress and deprecation chatter, not the user's concern
        program = torch.onnx.export(
            module, args, dynamo=True, dynamic_shapes=auto_spec(args, dynamic), opset_version=opset, verbose=False
        )
    assert program is not None
    _rename(program, args, dynamic, outputs)
    return program


def _export(
    module: nn.Module,
    args: tuple[Any, ...],
    destination: Path,
    dynamic: Dims,
    opset: int | None,
    external_data: bool | None = None,
    outputs: list[str] | None = None,
) -> None:
    """`onnx_program` of ``module`` saved to ``destination``; external data when asked or over 2 GB."""
    onnx_program(module, args, dynamic, opset, outputs).save(destination, external_data=external_data)


def _node_counts(path: Path) -> tuple[dict[str, int], int]:
    import onnx  # imported where used: `import graphopt` stays light

    model = onnx.load(str(path), load_external_data=False)
    opset = next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))
    return dict(collections.Counter(node.op_type for node in model.graph.node)), opset


def _run_onnxruntime(path: Path, args: tuple[Any, ...]) -> list[torch.Tensor]:
    import onnxruntime  # imported where used: `import graphopt` stays light

    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        tensors = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
        feeds = {spec.name: tensor.detach().cpu().numpy() for spec, tensor in zip(session.get_inputs(), tensors, strict=False)}
        return [torch.from_numpy(output) for output in session.run(None, feeds)]
    except Exception as error:
        raise ExportError(f"onnxruntime could not run the exported model ({type(error).__name__}: {error})") from error


def _move_into_place(scratch: Path, destination: Path) -> list[str]:
    """Move the files written in ``scratch`` beside ``destination`` (the ``.onnx`` file and its data file); their paths."""
    files = []
    for produced in sorted(scratch.iterdir()):
        if produced.is_file():
            target = destination.with_name(produced.name)
            os.replace(produced, target)
            files.append(str(target))
    return files


def _checked(path: Path) -> tuple[dict[str, int], int]:
    """``onnx.checker``'s full check of the file at ``path``; its node counts and opset."""
    import onnx  # imported where used: `import graphopt` stays light

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as error:
        raise ExportError(f"the exported model fails onnx.checker ({error}). Nothing was written.") from error
    return _node_counts(path)


def write_copy_checked(source: Path, destination: Path) -> tuple[list[str], dict[str, int], int]:
    """Copy the ONNX file ``source`` (weights inside it) to ``destination`` once ``onnx.checker`` passed: an engine's
    file, verified in onnxruntime already (the onnxruntime engine's int8 QDQ file). The files written, node counts, opset."""
    if any(path.name.startswith(source.name) and path != source for path in source.parent.iterdir()):
        raise ExportError(f"{source.name} keeps its weights in a separate data file (over 2 GB), which this export does not copy. Nothing was written.")
    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=f".{destination.name}.") as scratch:
        staged = Path(scratch) / destination.name
        shutil.copyfile(source, staged)
        node_counts, opset = _checked(staged)
        return _move_into_place(Path(scratch), destination), node_counts, opset


def write_checked(
    exported: nn.Module,
    reference: nn.Module,
    args: tuple[Any, ...],
    destination: Path,
    *,
    dynamic: Dims,
    names: Sequence[str],
    opset: int | None,
    verify: bool,
    compute_dtype: torch.dtype | None,
    plain: nn.Module | None,
    external_data: bool | None,
    name: str,
) -> ExportReport:
    """Export ``exported`` to ``destination`` once every check passed; ``reference`` gives the outputs to match.

    ``dynamic``: per leaf of ``args``, the dimensions the file takes other sizes of (checked in onnxruntime at a
    second size of each); ``names``: a name per leaf. ``plain``: also export this module plainly, for the node
    counts in the report (None: not compared). ``name``: the model's class name, for error messages.
    Raises `ExportError` when the exporter, the checker or onnxruntime fails, `VerificationError`
    when onnxruntime's outputs differ from ``reference``'s; nothing is written then.
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=f".{destination.name}.") as scratch:
        staged = Path(scratch) / destination.name
        expected_outputs = reference_run(reference, args).outputs  # the example's outputs: their names, then the check
        try:
            _export(exported, args, staged, dynamic, opset, external_data, output_names(expected_outputs))
        except Exception as error:
            raise ExportError(
                f"torch.onnx.export could not export {name} ({error_summary(error)}). Nothing was written."
            ) from error
        node_counts, opset_used = _checked(staged)

        batch_sizes: list[int] = []
        max_error = 0.0
        if verify:
            for batch_args in (args, other_inputs(args, dynamic, strided=False).args) if any(dynamic) else (args,):
                outputs = expected_outputs if batch_args is args else reference_run(reference, batch_args).outputs
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
        if plain is not None:
            plain_path = Path(scratch) / "plain" / destination.name
            plain_path.parent.mkdir()
            try:
                _export(plain, args, plain_path, dynamic, opset)
                plain_counts = _node_counts(plain_path)[0]
            except Exception:  # the baseline is informative only: graphopt may export what plain export cannot
                plain_counts = None
        files = _move_into_place(Path(scratch), destination)
    return ExportReport(
        path=str(destination),
        files=files,
        opset=opset_used,
        node_counts=node_counts,
        plain_node_counts=plain_counts,
        max_error=max_error,
        batch_sizes=batch_sizes,
        dynamic=describe(dynamic, names),
        seconds=time.perf_counter() - started,
    )

"""``graphopt.export_onnx``: options -> optimize for inference -> the ONNX backend, which writes a checked file.

The model is optimized for inference with the passes whose result ONNX can express
(`graphopt.pipeline.onnx_left_out` names the others), then `graphopt.backends.onnx_export`
exports it, checks the file with onnx.checker and onnxruntime against the original model,
and moves it into place only when every check passed.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from graphopt import dynamic
from graphopt.api import optimize as optimize_model
from graphopt.backends.onnx_export import ExportReport, write_checked, write_copy_checked
from graphopt.capture import one_at_a_time
from graphopt.errors import ExportError
from graphopt.inputs import argument_names
from graphopt.pipeline import onnx_left_out, onnx_refused
from graphopt.runtime import OptimizedModule, int8_modules
from graphopt.runtime.portable import runs_onednn_kernels, to_aten
from graphopt.validate import check_inputs, check_model


@one_at_a_time
def export_onnx(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    optimize: bool = True,
    dynamic_shapes: Any = dynamic.DEFAULT,
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
    ``optimize=False`` is exported as it is. ``dynamic_shapes`` (and ``dynamic_batch``): the
    dimensions the file takes other sizes of, as in `graphopt.optimize` (an `OptimizedModule`
    keeps its own); each is checked in onnxruntime at a second size. ``external_data``: weights in a
    ``<name>.data`` file (None: only for models over 2 GB). ``compare_plain``: also
    export the original model plainly, for the node counts in the report. Raises `ExportError` when the exporter,
    the checker or onnxruntime fails, `VerificationError` when onnxruntime's outputs
    differ from PyTorch's.
    """
    started = time.perf_counter()
    check_model(model)
    args = check_inputs(model, example_inputs)
    dynamic_shapes = dynamic.resolve(dynamic_shapes, dynamic_batch)
    names = argument_names(model, len(args))
    request = dynamic.request(dynamic_shapes, args, names)  # checked before anything costly
    destination = Path(path)
    if destination.suffix != ".onnx":
        raise ExportError(f"{destination} does not end in .onnx: name the file you want written, e.g. model.onnx")
    existing = [p for p in (destination, destination.with_name(destination.name + ".data")) if p.exists()]
    if existing and not overwrite:
        raise ExportError(f"{existing[0]} exists: pass overwrite=True to replace it, or choose another path")
    if not destination.parent.is_dir():
        raise ExportError(f"folder {destination.parent} does not exist: create it first")
    stores_bf16 = isinstance(model, OptimizedModule) and any(p.dtype == torch.bfloat16 for p in model.parameters())
    if isinstance(model, OptimizedModule) and int8_modules(model.graph_module):
        raise ExportError(
            "this module runs oneDNN's int8 kernels, which have no ONNX form: export the original model with "
            "precision='int8' and calibration= (a QDQ file quantized by onnxruntime, within accuracy=)"
        )
    if optimize_options.get("precision") == "int8":
        if isinstance(model, OptimizedModule) or not optimize:
            raise ExportError("precision='int8' quantizes while exporting: export the original model with optimize=True")
        if opset is not None or external_data:
            raise ExportError("precision='int8' writes onnxruntime's quantized file at the exporter's opset, weights inside: leave opset= and external_data= out")
        return _export_int8(model, args, destination, dynamic_shapes, verify, optimize_options, started)
    if optimize_options.get("precision") == "bf16" or stores_bf16:
        raise ExportError("precision='bf16' cannot be checked: onnxruntime has no bf16 CPU kernels. Export with precision='fp16' or 'fp32'")
    if isinstance(model, OptimizedModule) and model.graphopt_report.mode != "inference":
        raise ExportError("this module was optimized for training: ONNX export is for inference, optimize it with mode='inference'")
    refused = [name for name in onnx_refused() if name in (optimize_options.get("passes") or ())]
    if optimize and refused:
        raise ExportError(f"passes= asks for {', '.join(refused)}, whose kernels ONNX cannot express: leave it out")

    # what onnxruntime must reproduce: the model in eval mode (the user's own stays as it is)
    reference = model if isinstance(model, OptimizedModule) else copy.deepcopy(model).eval()
    if optimize:
        optimize_options.setdefault("memory_format", "preserve")
        optimize_options.setdefault("mode", "inference")
        # CPU-only kernels have no ONNX form; in-place writes save allocations in PyTorch only
        optimize_options["disable"] = [*optimize_options.get("disable", ()), *onnx_left_out()]
        optimized = optimize_model(model, args, dynamic_shapes=dynamic_shapes, verify=verify, **optimize_options)
        exported, report, signature = optimized.graph_module, optimized.graphopt_report, optimized.input_signature
    elif isinstance(model, OptimizedModule):
        exported, report, signature = model.graph_module, model.graphopt_report, model.input_signature
        if runs_onednn_kernels(exported):
            exported = to_aten(exported)  # ONNX has no oneDNN kernels: export ATen's ops, which they compute
    else:
        exported, report, signature = model, None, None
    dims = signature.dims() if signature is not None else request.dims

    compute_dtype = {"fp16": torch.float16}.get(optimize_options.get("precision", "fp32"))
    plain = reference if compare_plain and not isinstance(model, OptimizedModule) else None
    written = write_checked(
        exported, reference, args, destination, dynamic=dims, names=request.names, opset=opset, verify=verify, compute_dtype=compute_dtype,
        plain=plain, external_data=external_data, name=type(model).__name__,
    )  # fmt: skip
    written.optimize_report = report
    written.seconds = time.perf_counter() - started
    return written


def _export_int8(
    model: nn.Module, args: tuple[Any, ...], destination: Path, dynamic_shapes: Any, verify: bool, options: dict[str, Any], started: float
) -> ExportReport:
    """``precision="int8"``: the onnxruntime engine's QDQ file (`graphopt.backends.onnxruntime_engine`), quantized
    within ``accuracy`` and verified in onnxruntime on the example and a second input, copied to ``destination``."""
    if not verify:
        raise ExportError("precision='int8' is held to accuracy= by verification: leave verify on")
    if options.pop("mode", "inference") != "inference":
        raise ExportError("precision='int8' is for inference: leave mode= out or pass mode='inference'")
    unsupported = sorted(set(options) - {"precision", "calibration", "accuracy", "disable", "frontend", "device", "remeasure", "progress"})
    if unsupported:
        raise ExportError(f"precision='int8' exports onnxruntime's quantized file: {', '.join(f'{name}=' for name in unsupported)} do not apply, leave them out")
    optimized = optimize_model(model, args, mode="inference", engine="onnxruntime", dynamic_shapes=dynamic_shapes, **options)
    report, engine = optimized.graphopt_report, optimized.graphopt_report.engine
    assert engine is not None and optimized.runner is not None
    files, node_counts, opset = write_copy_checked(optimized.runner.model_file, destination)
    errors = [error for error in (engine.max_error, engine.second_input_error) if error is not None]
    written = ExportReport(
        path=str(destination), files=files, opset=opset, node_counts=node_counts, plain_node_counts=None,
        max_error=max(errors, default=0.0), batch_sizes=[dynamic.batch_size(args)], seconds=time.perf_counter() - started, dynamic=report.dynamic, optimize_report=report,
        notes=[f"int8 (QDQ) by onnxruntime's quantizer, verified in onnxruntime on the example inputs and a second input ({report.second_input or 'none'})", *engine.notes],
    )  # fmt: skip
    return written

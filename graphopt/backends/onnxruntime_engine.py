"""The onnxruntime engine: graphopt's graph exported to ONNX, run by an onnxruntime session tuned for latency.

The graph is the one graphopt captured and verified, after the portable passes. It goes
through ``torch.export`` (the verified dynamic dimensions dynamic, every other size the
example's: `graphopt.backends.engine.export_program`) and graphopt's ONNX export
(`graphopt.backends.onnx_export.onnx_program`: ``torch.onnx.export(dynamo=True)``, the
dynamic dimensions named ``batch`` and ``sequence``, the outputs after the model's output
structure) to an ``onnxruntime.InferenceSession`` on the CPU with every graph optimization,
sequential execution on torch's thread count, and no spinning threads: onnxruntime's
threads otherwise spin after each run and take the cores from torch's threads in the same
process.

float32 only: onnxruntime's CPU fp16 kernels are not faster than its fp32 ones, and it has
no bf16 CPU kernels.

The ``.onnx`` file (its weights in ``model.onnx.data`` beside it over protobuf's 2 GB, as
`graphopt.export_onnx` writes them) lives in a temporary folder the runner owns, so that
the weights are not held in memory twice; ``save`` copies it. onnxruntime reads the file
without running code from it: no custom-op library is ever registered with a session.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from graphopt.backends.engine import EngineInfo, EngineInput, EngineRunner, export_program, output_structure, tensor_leaves
from graphopt.backends.onnx_export import onnx_program, output_names
from graphopt.errors import EngineError, error_summary

MODEL_FILE = "model.onnx"


def _session(path: Path) -> Any:
    """An onnxruntime session on the ONNX file at ``path``, tuned for the latency of one call at a time."""
    import onnxruntime  # imported where used: `import graphopt` stays light

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = torch.get_num_threads()  # the cores torch would use
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxRuntimeRunner(EngineRunner):
    """An onnxruntime session on the ONNX file in ``files`` (a folder the runner owns), called with torch tensors."""

    engine = "onnxruntime"

    def __init__(self, files: tempfile.TemporaryDirectory[str], outputs: pytree.TreeSpec) -> None:
        super().__init__()
        self.files = files  # removed when the runner is collected
        self.outputs = outputs
        try:
            self.session = _session(Path(files.name) / MODEL_FILE)
        except Exception as error:  # onnxruntime's own error, quoted
            raise EngineError(f"engine='onnxruntime' could not load the ONNX file of graphopt's graph ({error_summary(error)})") from error
        self.input_names = [spec.name for spec in self.session.get_inputs()]
        if len(self.session.get_outputs()) != outputs.num_leaves:
            # ONNX outputs are tensors only: a None or a number among the outputs would shift every later one
            raise EngineError(
                f"engine='onnxruntime': graphopt's graph returns {outputs.num_leaves} outputs, of which ONNX holds "
                f"{len(self.session.get_outputs())} (tensors only): return only tensors, or use another engine"
            )

    def forward(self, *args: Any) -> Any:
        feeds = {name: tensor.detach().numpy() for name, tensor in zip(self.input_names, tensor_leaves(args), strict=True)}
        # session.run returns new arrays on each call: wrapped without a copy
        return pytree.tree_unflatten([torch.from_numpy(output) for output in self.session.run(None, feeds)], self.outputs)

    def save(self, folder: Path) -> dict[str, Any]:
        _copy_files(Path(self.files.name), folder)
        return {}  # the file says everything: load needs no settings


def _copy_files(source: Path, destination: Path) -> None:
    """Copy the ONNX file and its external data file, if any, from ``source`` into ``destination``."""
    for path in source.iterdir():
        if path.name.startswith(MODEL_FILE):
            shutil.copyfile(path, destination / path.name)


def _innermost(error: BaseException) -> BaseException:
    """The error at the root of ``error``'s causes: the exporter's own first line is a banner with next steps
    ("Failed to convert the exported program..."), the root names the op, e.g. "No ONNX function found for aten.kthvalue"."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def build(request: EngineInput) -> OnnxRuntimeRunner:
    """Export graphopt's graph to ONNX through torch.export and open an onnxruntime session on it."""
    if any(tensor.device.type != "cpu" for tensor in tensor_leaves(request.example_inputs)):
        raise EngineError("engine='onnxruntime' runs on the CPU here: give example inputs on the CPU (device='cpu')")
    args = request.example_inputs
    program = export_program(request.graph_module, args, request.dims, "onnxruntime")
    with torch.no_grad():
        example_outputs = request.graph_module(*args)
    files = tempfile.TemporaryDirectory(prefix="graphopt-onnxruntime-")
    try:
        # the file's outputs named after the model's output structure, as graphopt.export_onnx names them
        onnx_program(program, args, request.dims, outputs=output_names(example_outputs)).save(Path(files.name) / MODEL_FILE)
    except Exception as error:  # the exporter's own error, quoted
        files.cleanup()
        raise EngineError(f"engine='onnxruntime': torch.onnx.export could not export graphopt's graph ({error_summary(_innermost(error))})") from error
    return OnnxRuntimeRunner(files, pytree.tree_structure(example_outputs))


def load(folder: Path, settings: Mapping[str, Any], graph_module: fx.GraphModule, example_inputs: tuple[Any, ...]) -> OnnxRuntimeRunner:
    """The runner `OnnxRuntimeRunner.save` wrote into ``folder`` (its files copied: ``folder`` may be removed after)."""
    files = tempfile.TemporaryDirectory(prefix="graphopt-onnxruntime-")
    _copy_files(folder, Path(files.name))
    return OnnxRuntimeRunner(files, output_structure(graph_module, example_inputs))


ENGINE = EngineInfo(
    "onnxruntime",
    "onnxruntime's CPU session on graphopt's graph exported to ONNX, tuned for latency (inference, CPU, fp32: its CPU "
    "fp16/bf16 kernels are not faster)",
    precisions=("fp32",),
    requires="onnxruntime",
    build=build,
    load=load,
    costs="seconds to export to ONNX; the .onnx file holds the fp32 weights; no autograd, CPU only",
)

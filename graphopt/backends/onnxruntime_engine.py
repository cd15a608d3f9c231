"""The onnxruntime engine: graphopt's graph exported to ONNX, run by an onnxruntime session tuned for latency.

The graph is the one graphopt captured and verified, after the portable passes. It goes
through ``torch.export`` (the verified dynamic dimensions dynamic, every other size the
example's: `graphopt.backends.engine.export_program`) and graphopt's ONNX export
(`graphopt.backends.onnx_export.onnx_program`: ``torch.onnx.export(dynamo=True)``, the
dynamic dimensions named ``batch`` and ``sequence``, the outputs after the model's output
structure) to ``onnxruntime.InferenceSession``s on the CPU (one for the example's shapes, one for
other sizes) with every graph optimization,
sequential execution on torch's thread count, and threads that spin between the ops of a run
but stop when it returns (``session.force_spinning_stop``): without spinning every op wakes
the threads again (MobileNetV2 and EfficientNet-B0 2-4% slower here), and threads left
spinning after a run would take the cores from torch's threads in the same process.

float32 or int8: onnxruntime's CPU fp16 kernels are not faster than its fp32 ones, and it has
no bf16 CPU kernels. ``precision="int8"``: onnxruntime's static quantizer
(``onnxruntime.quantization.quantize_static``) writes a QDQ file (uint8 activations calibrated
on the calibration batches' range, int8 weights per output channel), held to graphopt's
accuracy budget (`graphopt.backends.int8_budget`): the convs and linears whose int8 would take
the output over the budget are left out of quantization (found by the module path the
exporter records in each node's metadata). `graphopt.export_onnx` writes this file for
``precision="int8"``.

A language model's generation steps (`program_runner`, `graphopt.generation`: torch.export programs
whose shapes change with every call, the cache as inputs and outputs) are exported the same way with
their own dynamic dimensions (the batch, the prompt and cache lengths) and run by one session, for every size.

The ``.onnx`` file (its weights in ``model.onnx.data`` beside it over protobuf's 2 GB, as
`graphopt.export_onnx` writes them) lives in a temporary folder the runner owns, so that
the weights are not held in memory twice; ``save`` copies it. onnxruntime reads the file
without running code from it: no custom-op library is ever registered with a session.
"""

from __future__ import annotations

import ast
import contextlib
import io
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from graphopt.backends.engine import EngineInfo, EngineInput, EngineRunner, export_program, output_structure, tensor_leaves
from graphopt.backends.int8_budget import quantized_within_budget
from graphopt.backends.onnx_export import onnx_program, output_names
from graphopt.errors import EngineError, error_summary

MODEL_FILE = "model.onnx"


def _session(path: Path, sizes: Mapping[str, int] | None = None) -> Any:
    """An onnxruntime session on the ONNX file at ``path``, tuned for the latency of one call at a time;
    ``sizes``: the named dynamic dimensions fixed to these sizes (a session for those shapes only)."""
    import onnxruntime  # imported where used: `import graphopt` stays light

    options = onnxruntime.SessionOptions()
    for name, size in (sizes or {}).items():
        options.add_free_dimension_override_by_name(name, size)
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = torch.get_num_threads()  # the cores torch would use
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxRuntimeRunner(EngineRunner):
    """Two onnxruntime sessions on the ONNX file in ``files`` (a folder the runner owns), called with torch tensors.

    One has the file's dynamic dimensions fixed to the example's sizes: with static shapes
    onnxruntime plans its memory and fuses once (EfficientNet-B0, batch 8: 75 ms against 83 ms
    for the dynamic session); calls of the example's shapes run on it, other sizes on the other.
    ``example_shapes=None`` (a generation step, whose shapes change with every call): the dynamic session alone.
    """

    engine = "onnxruntime"

    def __init__(self, files: tempfile.TemporaryDirectory[str], outputs: pytree.TreeSpec, example_shapes: Sequence[Sequence[int]] | None) -> None:
        super().__init__()
        self.files = files  # removed when the runner is collected
        self.outputs = outputs
        self.example_shapes = None if example_shapes is None else tuple(tuple(shape) for shape in example_shapes)
        path = Path(files.name) / MODEL_FILE
        try:
            self.session = _session(path)
            specs = self.session.get_inputs()
            shapes = self.example_shapes or ()
            sizes = {dim: size for spec, shape in zip(specs, shapes) for dim, size in zip(spec.shape, shape, strict=True) if isinstance(dim, str)}
            self.example_session = _session(path, sizes) if sizes else self.session
        except Exception as error:  # onnxruntime's own error, quoted
            raise EngineError(f"engine='onnxruntime' could not load the ONNX file of graphopt's graph ({error_summary(error)})") from error
        self.input_names = [spec.name for spec in specs]
        if len(self.session.get_outputs()) != outputs.num_leaves:
            # ONNX outputs are tensors only: a None or a number among the outputs would shift every later one
            raise EngineError(
                f"engine='onnxruntime': graphopt's graph returns {outputs.num_leaves} outputs, of which ONNX holds "
                f"{len(self.session.get_outputs())} (tensors only): return only tensors, or use another engine"
            )

    def run(self, args: tuple[Any, ...]) -> Any:
        # onnxruntime's sessions take concurrent runs from several threads
        feeds = {name: tensor.detach().numpy() for name, tensor in zip(self.input_names, tensor_leaves(args), strict=True)}
        session = self.example_session if tuple(array.shape for array in feeds.values()) == self.example_shapes else self.session
        # session.run returns new arrays on each call: wrapped without a copy
        return pytree.tree_unflatten([torch.from_numpy(output) for output in session.run(None, feeds)], self.outputs)

    @property
    def model_file(self) -> Path:
        """The ONNX file the sessions run."""
        return Path(self.files.name) / MODEL_FILE

    def save(self, folder: Path) -> dict[str, Any]:
        _copy_files(Path(self.files.name), folder)
        return {"example_shapes": [list(shape) for shape in self.example_shapes]}


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
    program = request.reused("torch.export", lambda: export_program(request.graph_module, args, request.dims, "onnxruntime"))
    with torch.no_grad():
        example_outputs = request.graph_module(*args)
    files = tempfile.TemporaryDirectory(prefix="graphopt-onnxruntime-")
    try:
        # the file's outputs named after the model's output structure, as graphopt.export_onnx names them
        onnx_program(program, args, request.dims, outputs=output_names(example_outputs)).save(Path(files.name) / MODEL_FILE)
    except Exception as error:  # the exporter's own error, quoted
        files.cleanup()
        raise EngineError(f"engine='onnxruntime': torch.onnx.export could not export graphopt's graph ({error_summary(_innermost(error))})") from error
    outputs, shapes = pytree.tree_structure(example_outputs), [tuple(tensor.shape) for tensor in tensor_leaves(args)]
    if request.precision == "int8":
        return _int8(request, files, outputs, shapes)
    return OnnxRuntimeRunner(files, outputs, shapes)


def program_runner(program: torch.export.ExportedProgram, precision: str, outputs: pytree.TreeSpec) -> OnnxRuntimeRunner:
    """A torch.export program whose shapes change with every call (a language model's prefill or decode step, its cache
    as inputs and outputs), exported to ONNX with its dynamic dimensions (the batch, the prompt and cache lengths) and
    run by one session for every size (called through `EngineInfo.make_program_runner`)."""
    if precision != "fp32":
        raise EngineError(f"engine='onnxruntime' runs a generation step in fp32, not {precision!r}")
    files = tempfile.TemporaryDirectory(prefix="graphopt-onnxruntime-")
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # the exporter's progress and deprecation chatter
            exported = torch.onnx.export(program, dynamo=True, verbose=False)  # the program's own dynamic dimensions
        assert exported is not None
        exported.save(Path(files.name) / MODEL_FILE)
    except Exception as error:  # the exporter's own error, quoted
        files.cleanup()
        raise EngineError(f"engine='onnxruntime': torch.onnx.export could not export the generation step ({error_summary(_innermost(error))})") from error
    return OnnxRuntimeRunner(files, outputs, example_shapes=None)


def _int8(request: EngineInput, float_files: tempfile.TemporaryDirectory[str], outputs: pytree.TreeSpec, shapes: list[tuple[int, ...]]) -> OnnxRuntimeRunner:
    """The float32 file in ``float_files`` quantized to QDQ int8 on the calibration batches, the layers over the budget
    left in float; the float32 runner where no layer stays in int8."""
    import onnx
    from onnxruntime import quantization

    source = Path(float_files.name) / MODEL_FILE
    graph = onnx.load(str(source), load_external_data=False).graph
    nodes = _nodes_by_layer(graph)
    weights = {initializer.name for initializer in graph.initializer}
    names = [value.name for value in graph.input if value.name not in weights]  # the file's inputs: args' tensors, in order
    feeds = [{name: tensor.numpy() for name, tensor in zip(names, tensor_leaves(batch), strict=True)} for batch in request.calibration]

    def quantize(in_float: frozenset[str]) -> OnnxRuntimeRunner:
        files = tempfile.TemporaryDirectory(prefix="graphopt-onnxruntime-")
        try:
            quantization.quantize_static(
                str(source), str(Path(files.name) / MODEL_FILE), _Batches(feeds), quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                activation_type=quantization.QuantType.QUInt8, weight_type=quantization.QuantType.QInt8,
                nodes_to_exclude=[node for path in sorted(in_float) for node in nodes[path]],
            )  # fmt: skip
        except Exception as error:  # the quantizer's own error, quoted
            files.cleanup()
            raise EngineError(f"engine='onnxruntime', precision='int8': onnxruntime's quantizer failed on graphopt's graph ({error_summary(error)})") from error
        return OnnxRuntimeRunner(files, outputs, shapes)

    outcome, layers = quantized_within_budget(request, "onnxruntime", quantize, lambda runner: runner, lambda: nodes)
    runner = outcome.built or OnnxRuntimeRunner(float_files, outputs, shapes)
    runner.int8_fell_back = outcome.built is None
    runner.notes = tuple(outcome.notes(layers, request.accuracy or 0.0, "onnxruntime's quantizer"))
    return runner


class _Batches:
    """The calibration batches as onnxruntime's quantizer reads them (a ``CalibrationDataReader``)."""

    def __init__(self, feeds: list[dict[str, Any]]) -> None:
        self.batches = iter(feeds)

    def get_next(self) -> dict[str, Any] | None:
        return next(self.batches, None)


def _nodes_by_layer(graph: Any) -> dict[str, list[str]]:
    """The names of the Conv, Gemm and MatMul nodes of each module path (the exporter's ``name_scopes`` metadata)."""
    nodes: dict[str, list[str]] = {}
    for node in graph.node:
        if node.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        scopes = next((entry.value for entry in node.metadata_props if entry.key == "pkg.torch.onnx.name_scopes"), None)
        try:
            path = ast.literal_eval(scopes)[-2] if scopes else None
        except (ValueError, SyntaxError, IndexError):
            path = None
        if isinstance(path, str):
            nodes.setdefault(path, []).append(node.name)
    return nodes


def load(folder: Path, settings: Mapping[str, Any], graph_module: fx.GraphModule, example_inputs: tuple[Any, ...]) -> OnnxRuntimeRunner:
    """The runner `OnnxRuntimeRunner.save` wrote into ``folder`` (its files copied: ``folder`` may be removed after)."""
    files = tempfile.TemporaryDirectory(prefix="graphopt-onnxruntime-")
    _copy_files(folder, Path(files.name))
    return OnnxRuntimeRunner(files, output_structure(graph_module, example_inputs), settings["example_shapes"])


ENGINE = EngineInfo(
    "onnxruntime",
    "onnxruntime's CPU session on graphopt's graph exported to ONNX, tuned for latency (inference, CPU, fp32 or int8 QDQ "
    "within accuracy=: its CPU fp16/bf16 kernels are not faster)",
    precisions=("fp32", "int8"),
    requires="onnxruntime",
    build=build,
    load=load,
    run_program=program_runner,
    costs="seconds to export to ONNX (int8: its quantizer calibrates, once per try within the budget); two sessions (the example's shapes, other sizes) hold the fp32 weights twice in memory; no autograd, CPU only",
)

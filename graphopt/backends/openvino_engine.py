"""The OpenVINO engine: graphopt's graph through torch.export to ``openvino.convert_model``, compiled for the CPU.

The graph is the one graphopt captured and verified, after the portable passes. It goes
through ``torch.export`` (the verified dynamic dimensions dynamic, every other size the
example's) to ``openvino.convert_model``, and is compiled by OpenVINO's CPU plugin with the
latency hint on torch's thread count, twice: for the example's shapes (which calls of those
shapes run on, unless timed clearly slower there than the dynamic model: `OpenVINORunner`) and
for the dynamic ones. ``precision`` maps to the plugin's inference precision hint (``fp32`` -> ``f32``, ``bf16`` -> ``bf16``, offered where the CPU reports
native bf16; OpenVINO's own default on such CPUs is bf16, graphopt's is what was asked).

``precision="int8"``: NNCF's post-training ``nncf.quantize`` (its defaults, on the calibration
batches), held to graphopt's accuracy budget (`graphopt.backends.int8_budget`): the convs and
linears whose int8 would take the output over the budget go to NNCF's ignored scope (each
found in OpenVINO's model by its weights). The float ops around the int8 ones run in
OpenVINO's default precision, as with NNCF alone (bf16 on CPUs with native bf16): the
budget is measured on the compiled result.

Converting from torch.export rather than OpenVINO's default TorchScript tracing is what
lets models that tracing fails on (ViT-B/16's ``nn.MultiheadAttention``) through.

Saved as OpenVINO's IR (``model.xml`` and ``model.bin``, weights uncompressed), which
``openvino.Core.read_model`` reads without running code from the file: a graph's (`load`), and
each generation step's (`load_program`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from graphopt.backends.engine import EngineInfo, EngineInput, EngineRunner, export_program, output_structure, tensor_leaves
from graphopt.backends.int8_budget import Int8Layer, graph_layers, quantized_within_budget
from graphopt.errors import EngineError, error_summary
from graphopt.timing import compare_latency

HINTS = {"fp32": "f32", "bf16": "bf16", "int8": None}  # int8: the float ops in OpenVINO's default precision
SHAPES_BUDGET_S = 1.0  # timing the model compiled for the example's shapes against the dynamic one (`OpenVINORunner`)
MODEL_FILE = "model.xml"


def _openvino() -> Any:
    import openvino

    return openvino


@functools.cache
def core() -> Any:
    """The process's one ``openvino.Core``, shared by graphopt's builds and loads (and the benchmark's peers).

    Each Core loads its own CPU plugin, which installs an alternate signal stack on the calling
    thread and, when destroyed, restores the one it found there. Cores destroyed in another order
    than they were made leave the thread with an unmapped signal stack, and the next signal a
    Python handler takes on it (SIGCHLD from a finished subprocess, with DataLoader's handler
    installed) kills the process. One Core kept for the process's life avoids that, and loads the
    plugin once.
    """
    return _openvino().Core()


def _config(precision: str) -> dict[str, Any]:
    hint = {"INFERENCE_PRECISION_HINT": HINTS[precision]} if HINTS[precision] else {}
    return {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads(), **hint}


def _check_precision(precision: str) -> None:
    if precision == "bf16" and "BF16" not in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        raise EngineError("engine='openvino', precision='bf16': this CPU has no native bf16 (OpenVINO would compute in f32): use precision='fp32'")


class OpenVINORunner(EngineRunner):
    """An OpenVINO model compiled for the CPU, called with torch tensors.

    Compiled for the example's exact shapes (static shapes let the plugin plan its memory and
    choose its kernels once, as OpenVINO recommends where sizes do not change; 1.07-1.14x the
    dynamic model's speed on MobileNetV2, AMD EPYC Zen 2) and for the dynamic dimensions graphopt
    verified (other sizes). Each call takes the one its inputs' shapes match. The static model is
    timed against the dynamic one on the example's shapes when built (`SHAPES_BUDGET_S`), and the
    dynamic one serves them too where the static one is clearly slower (the choice and the figures
    are in the report's engine notes): OpenVINO used directly on the model compiles it dynamic, so
    through graphopt the same engine is never slower on that account.

    An infer request runs one call at a time (a second thread's call on a busy one fails, or
    overwrites its buffers), so each thread gets its own requests, made from the compiled models
    at its first call (compiled models are safe to share between threads, and so between copies).
    """

    engine = "openvino"

    def __init__(self, model: Any, precision: str, outputs: pytree.TreeSpec, example_shapes: Sequence[Sequence[int]] | None) -> None:
        super().__init__()
        self.model = model  # the openvino.Model with its dynamic dimensions, kept for save and other sizes
        self.precision = precision
        self.outputs = outputs
        self.other_sizes_compiled = core().compile_model(model, "CPU", _config(precision))
        # None: shapes change with every call (a generation step): the dynamic model only, the weights once in memory
        self.example_shapes = None if example_shapes is None else tuple(tuple(shape) for shape in example_shapes)
        self.example_compiled = self.other_sizes_compiled
        self.requests = threading.local()  # per thread: compiled model -> its infer request
        if self.example_shapes is not None:
            static = model.clone()
            static.reshape({static.input(index): list(shape) for index, shape in enumerate(self.example_shapes)})
            self.example_compiled = core().compile_model(static, "CPU", _config(precision))
            self.notes = (self._static_or_dynamic(),)
        self.infer_request(self.example_compiled)  # the building thread's, made now: the first call is as fast as the next

    def _static_or_dynamic(self) -> str:
        """Time the model compiled for the example's shapes against the dynamic one on the example's shapes (random
        values), and keep the dynamic one for them where the static one is clearly slower: the plugin chooses its
        kernels by the shapes it knows, and nothing guarantees the choice for fixed shapes is the faster one (the
        suspected cause of OpenVINO through graphopt timing slower than used directly on Zen 4's depthwise models).
        Returns the report's line."""
        feeds = [_random_array(port, shape) for port, shape in zip(self.example_compiled.inputs, self.example_shapes, strict=True)]
        static, dynamic = self.infer_request(self.example_compiled), self.infer_request(self.other_sizes_compiled)
        comparison = compare_latency(lambda: dynamic.infer(feeds), lambda: static.infer(feeds), budget_s=SHAPES_BUDGET_S, asks="slower")
        figures = f"{comparison.candidate_s * 1e3:.2f} ms compiled for the example's shapes, {comparison.baseline_s * 1e3:.2f} ms dynamic ({comparison.ratio:.2f}x)"
        if comparison.slower:
            self.example_compiled = self.other_sizes_compiled
            return f"the example's shapes run on the dynamic model: compiled for them it measured slower ({figures})"
        return f"the example's shapes run on a model compiled for them ({figures}; kept unless clearly slower)"

    def infer_request(self, compiled: Any) -> Any:
        """This thread's infer request on ``compiled``."""
        requests = self.requests.__dict__
        if id(compiled) not in requests:
            requests[id(compiled)] = compiled.create_infer_request()
        return requests[id(compiled)]

    def run(self, args: tuple[Any, ...]) -> Any:
        if self.example_shapes is None:
            # a generation step's inputs (the cache above all) are read in place, made contiguous where they are not (the
            # plugin reads a shared array by its own layout); the request keeps them until the next step sets its own
            request = self.infer_request(self.other_sizes_compiled)
            results = request.infer([tensor.detach().contiguous().numpy() for tensor in tensor_leaves(args)], share_inputs=True)
        else:
            arrays = [tensor.detach().numpy() for tensor in tensor_leaves(args)]
            request = self.infer_request(self.example_compiled if tuple(array.shape for array in arrays) == self.example_shapes else self.other_sizes_compiled)
            # the inputs are copied in (share_inputs=False): with shared inputs the plugin would keep pointers into torch's
            # memory beyond the call and read non-contiguous (channels_last) tensors by its own layout
            results = request.infer(arrays, share_inputs=False)
        # copies: the request's output buffers are overwritten by the next call
        return pytree.tree_unflatten([torch.from_numpy(results[index].copy()) for index in range(len(results))], self.outputs)

    def save(self, folder: Path) -> dict[str, Any]:
        _openvino().save_model(self.model, str(folder / MODEL_FILE), compress_to_fp16=False)
        shapes = None if self.example_shapes is None else [list(shape) for shape in self.example_shapes]  # None: a generation step's
        return {"precision": self.precision, "example_shapes": shapes, "files": [MODEL_FILE, "model.bin"]}


def _random_array(port: Any, shape: Sequence[int]) -> Any:
    """Values of ``shape`` in the input ``port``'s element type (standard normal, or small integers), to time calls on."""
    dtype = port.get_element_type().to_dtype()
    if dtype.kind == "f":
        return torch.randn(tuple(shape)).numpy().astype(dtype)
    return torch.randint(0, 2, tuple(shape)).numpy().astype(dtype)


def build(request: EngineInput) -> OpenVINORunner:
    """Convert graphopt's graph through torch.export and compile it for the CPU."""
    _check_precision(request.precision)
    if any(tensor.device.type != "cpu" for tensor in tensor_leaves(request.example_inputs)):
        raise EngineError("engine='openvino' runs on the CPU here: give example inputs on the CPU (device='cpu')")
    program = request.reused("torch.export", lambda: export_program(request.graph_module, request.example_inputs, request.dims, "openvino"))
    try:
        model = request.reused("openvino model", lambda: _convert(program))  # one conversion for every precision
        outputs, shapes = output_structure(request.graph_module, request.example_inputs), _shapes(request.example_inputs)
        if request.precision == "int8":
            return _int8(request, model, outputs, shapes)
        runner = OpenVINORunner(model, request.precision, outputs, shapes)
    except EngineError:
        raise
    except Exception as error:  # OpenVINO's own conversion or compilation error, quoted
        raise EngineError(f"engine='openvino' could not convert or compile graphopt's graph ({error_summary(error)})") from error
    return runner


def _int8(request: EngineInput, model: Any, outputs: pytree.TreeSpec, shapes: list[tuple[int, ...]]) -> OpenVINORunner:
    """NNCF's quantization of ``model`` on the calibration batches, the layers over the budget in its ignored scope;
    OpenVINO's float32 result where no layer stays in int8."""
    try:
        import nncf
    except ImportError as error:
        raise EngineError("engine='openvino', precision='int8' quantizes with NNCF, which is not installed: pip install 'graphopt[openvino]'") from error
    feeds = [[tensor.numpy() for tensor in tensor_leaves(batch)] for batch in request.calibration]

    def ops() -> dict[str, str]:
        return request.reused("openvino int8 ops", lambda: _ops_by_layer(model, graph_layers(request)))

    def quantize(in_float: frozenset[str]) -> OpenVINORunner:
        ignored = nncf.IgnoredScope(names=sorted(ops()[path] for path in in_float), validate=False)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _nncf_quiet():
            warnings.simplefilter("ignore")
            quantized = nncf.quantize(model, nncf.Dataset(feeds), subset_size=len(feeds), ignored_scope=ignored)
        return OpenVINORunner(quantized, "int8", outputs, shapes)

    outcome, layers = quantized_within_budget(request, "openvino", quantize, lambda runner: runner, ops)
    notes = outcome.notes(layers, request.accuracy or 0.0, "NNCF")
    if outcome.built is None:
        runner = OpenVINORunner(model, "fp32", outputs, shapes)
        runner.int8_fell_back = True
    else:
        runner = outcome.built
    runner.notes = (*notes, *runner.notes)
    return runner


@contextlib.contextmanager
def _nncf_quiet() -> Iterator[None]:
    """NNCF's log (its INFO lines and progress bars) kept out of graphopt's output while it quantizes."""
    logger = logging.getLogger("nncf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _ops_by_layer(model: Any, layers: list[Int8Layer]) -> dict[str, str]:
    """Each layer's op in OpenVINO's ``model`` (path -> the op's name), found by its weights: the conversion names
    ops after torch.export's nodes, not after modules, and a constant holds the same values whatever its shape."""
    by_size: dict[int, list[Int8Layer]] = {}
    for layer in layers:
        by_size.setdefault(layer.weight.numel(), []).append(layer)
    found = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() not in ("Convolution", "GroupConvolution", "MatMul"):
            continue
        source = op.input(1).get_source_output().get_node()
        while source.get_type_name() in ("Convert", "Reshape", "Transpose") and source.get_input_size():
            source = source.input(0).get_source_output().get_node()
        if source.get_type_name() != "Constant":
            continue
        values = torch.from_numpy(source.get_data().astype("float32").ravel())
        # a linear's weight may be stored transposed for its MatMul
        matches = [layer for layer in by_size.get(values.numel(), []) if any(torch.equal(weight.flatten(), values) for weight in _orientations(layer.weight))]
        if len(matches) == 1:
            found[matches[0].path] = op.get_friendly_name()
    return found


def _orientations(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (weight, weight.t().contiguous()) if weight.dim() == 2 else (weight,)


def program_runner(program: torch.export.ExportedProgram, precision: str, outputs: pytree.TreeSpec) -> OpenVINORunner:
    """A torch.export program whose shapes change with every call (a language model's prefill or decode step, its cache
    as inputs and outputs), converted and compiled for its dynamic shapes (called through `EngineInfo.make_program_runner`).
    ``precision="int8"``: its weights compressed to int8 by NNCF's ``compress_weights`` (data-free, as optimum-intel's
    8-bit models), its activations in OpenVINO's default precision."""
    _check_precision(precision)
    model = _convert(program)
    if precision == "int8":
        model = _int8_weights(model)
    return OpenVINORunner(model, precision, outputs, example_shapes=None)


def _int8_weights(model: Any) -> Any:
    """``model`` with the weights of its matrix multiplications and embeddings in int8 (asymmetric, per channel)."""
    try:
        import nncf
    except ImportError as error:
        raise EngineError("engine='openvino', precision='int8' compresses the weights with NNCF, which is not installed: pip install 'graphopt[openvino]'") from error
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _nncf_quiet():
        warnings.simplefilter("ignore")
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)


def _convert(program: torch.export.ExportedProgram) -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return _openvino().convert_model(program)


def load(folder: Path, settings: Mapping[str, Any], graph_module: fx.GraphModule, example_inputs: tuple[Any, ...]) -> OpenVINORunner:
    """The runner `OpenVINORunner.save` wrote into ``folder``, compiled for this CPU."""
    _check_precision(settings["precision"])
    model = core().read_model(str(folder / MODEL_FILE))
    return OpenVINORunner(model, settings["precision"], output_structure(graph_module, example_inputs), settings["example_shapes"])


def load_program(folder: Path, settings: Mapping[str, Any], program: torch.export.ExportedProgram, outputs: pytree.TreeSpec) -> OpenVINORunner:
    """The runner `program_runner` made, from the IR its `OpenVINORunner.save` wrote into ``folder``, compiled for this CPU
    (the IR is ``program`` converted: it is not converted again)."""
    _check_precision(settings["precision"])
    return OpenVINORunner(core().read_model(str(folder / MODEL_FILE)), settings["precision"], outputs, example_shapes=None)


def _shapes(example_inputs: tuple[Any, ...]) -> list[tuple[int, ...]]:
    return [tuple(tensor.shape) for tensor in tensor_leaves(example_inputs)]


ENGINE = EngineInfo(
    "openvino",
    "OpenVINO's CPU plugin, on graphopt's graph converted through torch.export (inference, CPU)",
    precisions=("fp32", "bf16", "int8"),
    requires="openvino",
    extra="openvino",
    build=build,
    load=load,
    run_program=program_runner,
    generation_precisions=("fp32", "bf16", "int8"),
    load_program=load_program,
    costs="a few seconds to convert and compile (int8: NNCF's quantization, seconds to a minute, once per try within the budget), twice (the example's shapes, other sizes: the weights twice in memory); the IR (.xml/.bin) holds the fp32 weights; no autograd, CPU only",
)

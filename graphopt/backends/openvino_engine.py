"""The OpenVINO engine: graphopt's graph through torch.export to ``openvino.convert_model``, compiled for the CPU.

The graph is the one graphopt captured and verified, after the portable passes. It goes
through ``torch.export`` (the verified dynamic dimensions dynamic, every other size the
example's) to ``openvino.convert_model``, and is compiled by OpenVINO's CPU plugin with the
latency hint on torch's thread count, twice: for the example's shapes and for the dynamic
ones. ``precision`` maps to the plugin's inference precision hint (``fp32`` -> ``f32``, ``bf16`` -> ``bf16``, offered where the CPU reports
native bf16; OpenVINO's own default on such CPUs is bf16, graphopt's is what was asked).

Converting from torch.export rather than OpenVINO's default TorchScript tracing is what
lets models that tracing fails on (ViT-B/16's ``nn.MultiheadAttention``) through.

Saved as OpenVINO's IR (``model.xml`` and ``model.bin``, weights uncompressed), which
``openvino.Core.read_model`` reads without running code from the file.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from graphopt.backends.engine import EngineInfo, EngineInput, EngineRunner, export_program, output_structure, tensor_leaves
from graphopt.errors import EngineError, error_summary

HINTS = {"fp32": "f32", "bf16": "bf16"}
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
    return {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": HINTS[precision]}


def _check_precision(precision: str) -> None:
    if precision == "bf16" and "BF16" not in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        raise EngineError("engine='openvino', precision='bf16': this CPU has no native bf16 (OpenVINO would compute in f32): use precision='fp32'")


class OpenVINORunner(EngineRunner):
    """An OpenVINO model compiled for the CPU, called with torch tensors.

    Compiled for the example's exact shapes (static shapes let the plugin plan its memory and
    choose its kernels once, as OpenVINO recommends where sizes do not change; a few percent
    faster than the dynamic model on the anchors) and for the dynamic dimensions graphopt
    verified (other sizes). Each call takes the one its inputs' shapes match.
    """

    engine = "openvino"

    def __init__(self, model: Any, precision: str, outputs: pytree.TreeSpec, example_shapes: Sequence[Sequence[int]]) -> None:
        super().__init__()
        self.model = model  # the openvino.Model with its dynamic dimensions, kept for save and other sizes
        self.precision = precision
        self.outputs = outputs
        self.example_shapes = tuple(tuple(shape) for shape in example_shapes)
        static = model.clone()
        static.reshape({static.input(index): list(shape) for index, shape in enumerate(self.example_shapes)})
        self.example_request = core().compile_model(static, "CPU", _config(precision)).create_infer_request()
        self.other_sizes_request = core().compile_model(model, "CPU", _config(precision)).create_infer_request()

    def forward(self, *args: Any) -> Any:
        arrays = [tensor.detach().numpy() for tensor in tensor_leaves(args)]
        request = self.example_request if tuple(array.shape for array in arrays) == self.example_shapes else self.other_sizes_request
        # the inputs are copied in (share_inputs=False): with shared inputs the plugin would keep pointers into torch's
        # memory beyond the call and read non-contiguous (channels_last) tensors by its own layout
        results = request.infer(arrays, share_inputs=False)
        # copies: the request's output buffers are overwritten by the next call
        return pytree.tree_unflatten([torch.from_numpy(results[index].copy()) for index in range(len(results))], self.outputs)

    def save(self, folder: Path) -> dict[str, Any]:
        _openvino().save_model(self.model, str(folder / MODEL_FILE), compress_to_fp16=False)
        return {"precision": self.precision, "example_shapes": [list(shape) for shape in self.example_shapes], "files": [MODEL_FILE, "model.bin"]}


def build(request: EngineInput) -> OpenVINORunner:
    """Convert graphopt's graph through torch.export and compile it for the CPU."""
    _check_precision(request.precision)
    if any(tensor.device.type != "cpu" for tensor in tensor_leaves(request.example_inputs)):
        raise EngineError("engine='openvino' runs on the CPU here: give example inputs on the CPU (device='cpu')")
    program = request.reused("torch.export", lambda: export_program(request.graph_module, request.example_inputs, request.dims, "openvino"))
    try:
        model = request.reused("openvino model", lambda: _convert(program))  # one conversion for every precision
        runner = OpenVINORunner(model, request.precision, output_structure(request.graph_module, request.example_inputs), _shapes(request.example_inputs))
    except EngineError:
        raise
    except Exception as error:  # OpenVINO's own conversion or compilation error, quoted
        raise EngineError(f"engine='openvino' could not convert or compile graphopt's graph ({error_summary(error)})") from error
    return runner


def _convert(program: torch.export.ExportedProgram) -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return _openvino().convert_model(program)


def load(folder: Path, settings: Mapping[str, Any], graph_module: fx.GraphModule, example_inputs: tuple[Any, ...]) -> OpenVINORunner:
    """The runner `OpenVINORunner.save` wrote into ``folder``, compiled for this CPU."""
    _check_precision(settings["precision"])
    model = core().read_model(str(folder / MODEL_FILE))
    return OpenVINORunner(model, settings["precision"], output_structure(graph_module, example_inputs), settings["example_shapes"])


def _shapes(example_inputs: tuple[Any, ...]) -> list[tuple[int, ...]]:
    return [tuple(tensor.shape) for tensor in tensor_leaves(example_inputs)]


ENGINE = EngineInfo(
    "openvino",
    "OpenVINO's CPU plugin, on graphopt's graph converted through torch.export (inference, CPU)",
    precisions=("fp32", "bf16"),
    requires="openvino",
    extra="openvino",
    build=build,
    load=load,
    costs="a few seconds to convert and compile, twice (the example's shapes, other sizes: the weights twice in memory); the IR (.xml/.bin) holds the fp32 weights; no autograd, CPU only",
)

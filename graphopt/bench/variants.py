"""The ways of running a model that the benchmark compares, one `Variant` per line of `variants()`.

A variant is a name, a role and a builder: ``build(setup)`` prepares everything it
needs (copies, compiled code, ONNX files, sessions) and returns a zero-argument runner
that makes one forward pass on the setup's inputs. The harness times the builder plus
the first call as the variant's setup time, then calls the runner in interleaved
rounds under ``torch.inference_mode()``.

Roles: ``baseline`` (eager fp32, what every ratio divides), ``graphopt`` (graphopt's
public API: ``graphopt.optimize`` presets and ``graphopt.export_onnx`` run by
onnxruntime), ``peer`` (everything graphopt has to beat) and ``noise`` (a second, identical
copy of a peer, onnxruntime on the plain export and OpenVINO f32, which cannot convert
ViT-B/16: how far apart two copies of one thing time in this run, the noise floor every ratio
is read against). A graphopt variant on an engine names in ``direct``
the peer that runs the same engine on the model directly: the results pair them (an engine
must never be slower through graphopt than used directly). ``class_default`` marks the
graphopt variant a user gets without choosing anything for a precision class: the
default call (``exact``), ``precision="bf16"``/``"fp16"`` (``low``) and ``precision="int8"``
(``int8``: its peers quantize with the same calibration batches, `Setup.calibration`); the results
compare these with the best peer of the class (`graphopt.bench.results`). A builder that cannot run
here raises `VariantSkipped` with the reason; any other exception marks the variant as
failed with its message. The shared ``setup.model`` must never be modified: builders
that change weights or layout work on a copy.

Adding a graphopt configuration is one line in `variants()`, e.g.
``_graphopt_variant("graphopt-tune", "graphopt tuned", tune=True)``: when
``graphopt.optimize`` does not accept an option yet, the variant is listed as skipped.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import inspect
import io
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import graphopt
from graphopt.backends.openvino_engine import core as openvino_core
from graphopt.pipeline import cpu_kernel_passes
from graphopt.quiet import FOREIGN_LOG_MESSAGES, TORCHAO_IMPORT_MESSAGES, log_messages_dropped

Runner = Callable[[], Any]

LOW_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
CALIBRATION_BATCHES = 4  # batches every int8 variant calibrates on


class VariantSkipped(Exception):
    """The variant cannot run on this machine or with this graphopt; the message says why."""


@dataclass(frozen=True)
class Setup:
    """What a variant is built from (shared by all variants of one model: do not modify)."""

    model: nn.Module  # eval mode, on ``device``
    inputs: tuple[torch.Tensor, ...]  # on ``device``
    device: torch.device
    low_precision: str  # "bf16" or "fp16"
    workdir: Path  # a private folder for files such as ONNX exports

    @property
    def low_dtype(self) -> torch.dtype:
        return LOW_PRECISIONS[self.low_precision]

    @functools.cached_property
    def calibration(self) -> list[tuple[torch.Tensor, ...]]:
        """The batches every int8 variant calibrates on: the inputs' shapes, fresh values of the same kind (seeded)."""
        generator = torch.Generator().manual_seed(1)

        def fresh(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.is_floating_point():
                return tensor
            return (torch.randn(tensor.shape, generator=generator) * tensor.std() + tensor.mean()).to(tensor.device, tensor.dtype)

        return [tuple(fresh(t) for t in self.inputs) for _ in range(CALIBRATION_BATCHES)]


@dataclass(frozen=True)
class Variant:
    """One way of running a model: ``key`` selects it on the command line, ``label`` names it in tables."""

    key: str
    label: str
    role: str  # "baseline", "graphopt", "peer" or "noise" (a peer's identical copy: the run's noise floor)
    build: Callable[[Setup], Runner]
    class_default: str | None = None  # "exact" or "low": graphopt's public default for that precision class
    precision: str = "fp32"  # "fp32", "low" (computes in the run's low precision), "int8" or "auto" (chooses by itself)
    # a graphopt variant on an engine: the peer running that engine directly on the model; a "noise" variant: its copy's
    direct: str | None = None


def _channels_last(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in inputs)


def _autocast(setup: Setup) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(setup.device.type, dtype=setup.low_dtype)


def _call(module: Callable[..., Any], inputs: tuple[torch.Tensor, ...], setup: Setup, autocast: bool) -> Runner:
    if not autocast:
        return lambda: module(*inputs)

    def run() -> Any:
        with _autocast(setup):
            return module(*inputs)

    return run


def _eager(*, channels_last: bool = False, autocast: bool = False) -> Callable[[Setup], Runner]:
    def build(setup: Setup) -> Runner:
        model, inputs = setup.model, setup.inputs
        if channels_last:
            model, inputs = copy.deepcopy(model).to(memory_format=torch.channels_last), _channels_last(inputs)
        return _call(model, inputs, setup, autocast)

    return build


def _torch_compile(*, channels_last: bool = False, autocast: bool = False, freezing: bool = False) -> Callable[[Setup], Runner]:
    """torch.compile (Inductor); ``freezing``: Inductor's recommended CPU inference setting (weights folded in as
    constants, conv-BN folded, oneDNN weights prepacked, post-ops fused).

    Freezing is set process-wide while the first call compiles, under ``torch.inference_mode`` as the harness
    runs it: Dynamo reads the setting when it traces (as a compile option, ``options={"freezing": True}``,
    only Inductor sees it, after the weights became graph inputs, and nothing is frozen). The model is a
    private copy, so no other variant's compiled code for the same model is reused."""

    def build(setup: Setup) -> Runner:
        model, inputs = setup.model, setup.inputs
        if channels_last or freezing:
            model = copy.deepcopy(model)
        if channels_last:
            model, inputs = model.to(memory_format=torch.channels_last), _channels_last(inputs)
        run = _call(torch.compile(model), inputs, setup, autocast)
        if freezing:
            with torch._inductor.config.patch(freezing=True), torch.inference_mode():
                run()  # compiles now, frozen
        return run

    return build


def _graphopt(**options: Any) -> Callable[[Setup], Runner]:
    """``graphopt.optimize(model, inputs, remeasure=True, **options)``; ``precision="low"`` means the run's low precision.
    The runner's note says what tune=True chose, and tune's own time of it."""

    def build(setup: Setup) -> Runner:
        accepted = inspect.signature(graphopt.optimize).parameters
        takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in accepted.values())
        missing = [] if takes_any else [name for name in options if name not in accepted]
        if missing:
            raise VariantSkipped(f"graphopt.optimize does not accept {', '.join(f'{name}=' for name in missing)} yet")
        resolved = {name: setup.low_precision if value == "low" else value for name, value in options.items()}
        if resolved.get("precision") == "int8" or resolved.get("calibration"):  # tune=True, calibration=True: int8 is a candidate
            resolved["calibration"] = setup.calibration
        # measured afresh (tune's choice, the measured passes): what this run times is what this run chose
        optimized = graphopt.optimize(setup.model, setup.inputs, remeasure=True, **resolved)
        return _Chosen(lambda: optimized(*setup.inputs), _tune_note(optimized.graphopt_report.tune))

    return build


@dataclass(frozen=True)
class _Chosen:
    """A runner with what the results print beside its time: for tune=True, its choice and tune's own timing of it."""

    run: Runner
    note: str | None

    def __call__(self) -> Any:
        return self.run()


def _tune_note(tune: Any) -> str | None:
    """``chose openvino fp32, timed at 33.41 ms by tune``: to set beside the benchmark's own time of the same call."""
    if tune is None:
        return None
    timed = next((candidate.seconds for candidate in tune.candidates if candidate.name == tune.winner and candidate.seconds is not None), None)
    return f"chose {tune.winner}" + ("" if timed is None else f", timed at {timed * 1e3:.2f} ms by tune") + (" (remembered)" if tune.cache == "hit" else "")


def _fx_optimize_for_inference(setup: Setup) -> Runner:
    if setup.device.type != "cpu":
        raise VariantSkipped("torch.fx.experimental.optimization.optimize_for_inference runs on CPU only (MKL-DNN)")
    from torch.fx.experimental.optimization import optimize_for_inference

    optimized = optimize_for_inference(setup.model)  # works on a copy (its conv-bn fusion copies the model)
    return lambda: optimized(*setup.inputs)


def _jit_freeze(setup: Setup) -> Runner:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer warnings
        traced = torch.jit.trace(setup.model, setup.inputs, check_trace=False)
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))
    return lambda: frozen(*setup.inputs)


def _plain_onnx_export(model: nn.Module, inputs: tuple[torch.Tensor, ...], path: Path) -> None:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), log_messages_dropped(FOREIGN_LOG_MESSAGES):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, inputs, dynamo=True, verbose=False)
    if program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    program.save(str(path))


def _onnxruntime(*, graphopt_export: bool) -> Callable[[Setup], Runner]:
    def build(setup: Setup) -> Runner:
        import onnxruntime

        providers = ["CPUExecutionProvider"]
        if setup.device.type == "cuda":
            if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
                raise VariantSkipped("this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
            providers = ["CUDAExecutionProvider"]
        # exported from a CPU copy: the exporters and graphopt's onnxruntime check run on the CPU
        model = copy.deepcopy(setup.model).cpu()
        inputs = tuple(t.cpu() for t in setup.inputs)
        path = setup.workdir / ("graphopt.onnx" if graphopt_export else "plain.onnx")
        if graphopt_export:
            graphopt.export_onnx(model, inputs, path, compare_plain=False, overwrite=True)
        else:
            _plain_onnx_export(model, inputs, path)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # the same cores as the torch variants
        # threads spin between the ops of a run (onnxruntime's default) but stop when it returns: left spinning they
        # would steal the cores from the next variant; never spinning, every op would wake them again
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        session = onnxruntime.InferenceSession(str(path), options, providers=providers)
        # on CUDA the inputs and outputs are copied between host and device on every call
        feeds = {spec.name: tensor.numpy() for spec, tensor in zip(session.get_inputs(), inputs, strict=True)}
        return lambda: session.run(None, feeds)

    return build


def _openvino(*, precision: str | None) -> Callable[[Setup], Runner]:
    """OpenVINO's CPU plugin on the model converted by ``openvino.convert_model``, with the latency hint on the
    torch variants' threads, compiled by graphopt's one OpenVINO Core (see `openvino_engine.core`). ``precision=None``: the plugin's default, bf16 on CPUs with native bf16 (AVX-512
    BF16, AMX), else f32; ``"f32"``: float32 throughout."""

    def build(setup: Setup) -> Runner:
        if setup.device.type != "cpu":
            raise VariantSkipped("the OpenVINO variants run on CPU only")
        try:
            import openvino
        except ImportError as error:
            raise VariantSkipped("openvino is not installed (pip install 'graphopt[bench]')") from error
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            converted = openvino.convert_model(copy.deepcopy(setup.model), example_input=setup.inputs)
        config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
        if precision is not None:
            config["INFERENCE_PRECISION_HINT"] = precision
        compiled = openvino_core().compile_model(converted, "CPU", config)
        request = compiled.create_infer_request()
        feeds = {index: tensor.numpy() for index, tensor in enumerate(setup.inputs)}
        return lambda: tuple(request.infer(feeds).values())

    return build


def _openvino_int8(setup: Setup) -> Runner:
    """OpenVINO's CPU plugin on the model quantized by NNCF's post-training ``nncf.quantize`` (the calibration batches)."""
    if setup.device.type != "cpu":
        raise VariantSkipped("the OpenVINO variants run on CPU only")
    try:
        import nncf
        import openvino
    except ImportError as error:
        raise VariantSkipped(f"{error.name} is not installed (pip install 'graphopt[bench]')") from error
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        converted = openvino.convert_model(copy.deepcopy(setup.model), example_input=setup.inputs)
        feeds = [{index: tensor.numpy() for index, tensor in enumerate(batch)} for batch in setup.calibration]
        quantized = nncf.quantize(converted, nncf.Dataset(feeds), subset_size=len(feeds))
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    request = openvino_core().compile_model(quantized, "CPU", config).create_infer_request()
    inputs = {index: tensor.numpy() for index, tensor in enumerate(setup.inputs)}
    return lambda: tuple(request.infer(inputs).values())


def _pt2e_int8(setup: Setup) -> Runner:
    """torchao's PT2E flow: ``X86InductorQuantizer`` observers and q/dq graph, calibrated, compiled by Inductor with freezing."""
    if setup.device.type != "cpu":
        raise VariantSkipped("the PT2E x86 int8 variant runs on CPU only")
    try:
        with log_messages_dropped(TORCHAO_IMPORT_MESSAGES):  # its CUDA-only extensions fail to load on a CPU build, noisily
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
            from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86
    except ImportError as error:
        raise VariantSkipped("torchao is not installed (pip install 'graphopt[bench]')") from error
    quantizer = x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # strict export records which call of a module each node comes from (source_fn_stack); without it the
        # quantizer groups the calls of a module used several times (ResNet's relu) and refuses the graph
        exported = torch.export.export(copy.deepcopy(setup.model), setup.inputs, strict=True).module()
        prepared = prepare_pt2e(exported, quantizer)
        for batch in setup.calibration:
            prepared(*batch)
        compiled = torch.compile(convert_pt2e(prepared))
        # freezing as torchao's recipe sets it, process-wide while compiling (as a compile option the int8 weight
        # prepacking runs on fake tensors and fails); the converted graph is this variant's own, so no other reuses it
        with torch._inductor.config.patch(freezing=True):
            compiled(*setup.inputs)
    return lambda: compiled(*setup.inputs)


def _graphopt_variant(key: str, label: str, class_default: str | None = None, direct: str | None = None, **options: Any) -> Variant:
    precision = "int8" if options.get("calibration") else "auto" if options.get("tune") else "low" if options.get("precision") == "low" else options.get("precision", "fp32")
    return Variant(key, label, "graphopt", _graphopt(**options), class_default, precision, direct)


def _low(key: str, label: str, build: Callable[[Setup], Runner]) -> Variant:
    """A peer that computes in the run's low precision."""
    return Variant(key, label, "peer", build, precision="low")


def variants(low_precision: str = "bf16") -> list[Variant]:
    """Every variant, in the order they run in each round; ``low_precision`` names the autocast/low dtype."""
    low = low_precision
    return [
        Variant("eager", "eager fp32", "baseline", _eager()),
        Variant("eager-cl", "eager fp32 + CL", "peer", _eager(channels_last=True)),
        _low("eager-amp", f"eager {low} autocast", _eager(autocast=True)),
        _low("eager-amp-cl", f"eager {low} autocast + CL", _eager(channels_last=True, autocast=True)),
        _graphopt_variant("graphopt-default", "graphopt default call", "exact"),
        _graphopt_variant("graphopt-low", f'graphopt precision="{low}"', "low", precision="low"),
        _graphopt_variant("graphopt", "graphopt fp32", memory_format="preserve"),
        _graphopt_variant("graphopt-cl", "graphopt fp32 + CL", memory_format="channels_last"),
        _graphopt_variant("graphopt-low-cl", f"graphopt {low} + CL", memory_format="channels_last", precision="low"),
        _graphopt_variant("graphopt-cl-onednn", "graphopt fp32 + CL + oneDNN", memory_format="channels_last", passes=cpu_kernel_passes("fp32", "channels_last")),
        _graphopt_variant(
            "graphopt-low-cl-onednn", f"graphopt {low} + CL + oneDNN", memory_format="channels_last", precision="low", passes=cpu_kernel_passes(low, "channels_last")
        ),
        _graphopt_variant("graphopt-cl-fuse", "graphopt fp32 + CL + fusion", memory_format="channels_last", fuse="inductor"),
        _graphopt_variant(
            "graphopt-low-cl-fuse", f"graphopt {low} + CL + fusion", memory_format="channels_last", precision="low", fuse="inductor"
        ),
        _graphopt_variant(
            "graphopt-low-cl-graph", f"graphopt {low} + CL + torch.compile", memory_format="channels_last", precision="low", fuse="graph"
        ),
        _graphopt_variant("graphopt-tune", "graphopt tuned (accuracy 3e-2)", tune=True, accuracy=3e-2),
        _graphopt_variant("graphopt-tune-exact", "graphopt tuned (exact)", tune=True),
        _graphopt_variant("graphopt-openvino", 'graphopt engine="openvino" fp32', direct="openvino-f32", engine="openvino"),
        _graphopt_variant("graphopt-openvino-low", f'graphopt engine="openvino" {low}', direct="openvino", engine="openvino", precision="low"),
        _graphopt_variant("graphopt-ort", 'graphopt engine="onnxruntime"', direct="ort-plain", engine="onnxruntime"),
        _graphopt_variant("graphopt-inductor", 'graphopt engine="inductor" fp32', direct="compile-freeze-cl", engine="inductor"),
        _graphopt_variant("graphopt-inductor-low", f'graphopt engine="inductor" {low}', direct="compile-freeze-amp-cl", engine="inductor", precision="low"),
        _graphopt_variant("graphopt-int8", 'graphopt precision="int8"', "int8", precision="int8"),
        # the output error the int8 peers reach on the anchors (7e-2 to 1.4e-1 measured), instead of the default 5e-2
        _graphopt_variant("graphopt-int8-1e-1", 'graphopt precision="int8", accuracy=1e-1', precision="int8", accuracy=1e-1),
        _graphopt_variant("graphopt-openvino-int8", 'graphopt engine="openvino" int8', direct="openvino-int8", engine="openvino", precision="int8"),
        _graphopt_variant("graphopt-ort-int8", 'graphopt engine="onnxruntime" int8', engine="onnxruntime", precision="int8"),
        # every int8 candidate (graphopt's kernels, each engine's) and the float ones, the fastest within the budget
        _graphopt_variant("graphopt-tune-int8", "graphopt tuned with calibration (accuracy 5e-2)", tune=True, calibration=True, accuracy=5e-2),
        Variant("compile", "torch.compile fp32", "peer", _torch_compile()),
        _low("compile-amp-cl", f"torch.compile {low} autocast + CL", _torch_compile(channels_last=True, autocast=True)),
        Variant("compile-freeze-cl", "torch.compile freezing fp32 + CL", "peer", _torch_compile(channels_last=True, freezing=True)),
        _low("compile-freeze-amp-cl", f"torch.compile freezing {low} autocast + CL", _torch_compile(channels_last=True, autocast=True, freezing=True)),
        Variant("fx-ofi", "fx optimize_for_inference", "peer", _fx_optimize_for_inference),
        Variant("jit-freeze", "jit freeze + optimize_for_inference", "peer", _jit_freeze),
        Variant("ort-graphopt", "onnxruntime fp32 (graphopt export)", "graphopt", _onnxruntime(graphopt_export=True)),
        Variant("ort-plain", "onnxruntime fp32 (plain export)", "peer", _onnxruntime(graphopt_export=False)),
        Variant("ort-plain-again", "onnxruntime fp32 (plain export) again (the noise floor)", "noise", _onnxruntime(graphopt_export=False), direct="ort-plain"),
        Variant("openvino", "OpenVINO (default precision)", "peer", _openvino(precision=None), precision="auto"),
        Variant("openvino-f32", "OpenVINO f32", "peer", _openvino(precision="f32")),
        Variant("openvino-f32-again", "OpenVINO f32 again (the noise floor)", "noise", _openvino(precision="f32"), direct="openvino-f32"),
        Variant("openvino-int8", "OpenVINO int8 (NNCF)", "peer", _openvino_int8, precision="int8"),
        Variant("pt2e-int8", "torchao PT2E x86 int8 + torch.compile freezing", "peer", _pt2e_int8, precision="int8"),
    ]


def select(available: list[Variant], patterns: Iterable[str] | None, excluded: Iterable[str] = ()) -> list[Variant]:
    """The variants whose keys match ``patterns`` (shell-style, e.g. ``graphopt*``; None: all) and not ``excluded``.

    The baseline is always kept: every ratio and error is measured against it.
    Raises ValueError naming the known keys when a pattern matches nothing.
    """
    keys = [variant.key for variant in available]
    wanted, unwanted = list(patterns or ["*"]), list(excluded)
    for pattern in wanted + unwanted:
        if not fnmatch.filter(keys, pattern):
            raise ValueError(f"no variant matches {pattern!r}; the variants are: {', '.join(keys)}")

    def matches(variant: Variant, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(variant.key, pattern) for pattern in patterns)

    return [v for v in available if v.role == "baseline" or (matches(v, wanted) and not matches(v, unwanted))]

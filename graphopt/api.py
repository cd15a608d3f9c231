"""``graphopt.optimize``: a pipeline of named stages, each with one job and typed inputs and outputs.

    check_options (graphopt.options)  -> Options      every refusal of a bad option, before anything costly
    prepare       (graphopt.stages)   -> Workspace    the model's deep copy, the example inputs on the device
    capture_model                     -> Capture      reference run, side effects, second inputs, the graph
    rewrite                           -> Rewritten    the verified passes
    build_runtime                     -> Runtime      fusion, or an engine's runner, verified
    assemble                          -> OptimizedModule, with its Report

``tune=True`` builds candidates through the same stages (`graphopt.tuning` chooses among them); its engine
candidates share one capture, one run of the portable passes and the conversions, passed explicitly
(`stages.SharedByEngines`).

The user's model is deep-copied once, at entry, and never touched again. The returned
`OptimizedModule` shares the optimized graph's parameters and submodules directly (no
wrapper prefix), so ``state_dict()`` keys are the model's own where a parameter still
exists, and ``.to()``, ``.parameters()`` and hooks behave as on any module.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from graphopt import dynamic, generation, generation_build, tuning
from graphopt.backends import DEFAULT_ENGINE, ENGINES, EngineInfo
from graphopt.capture import one_at_a_time
from graphopt.device import device_types
from graphopt.errors import InvalidOptionError, warn_at_caller
from graphopt.inputs import copied_inputs
from graphopt.options import MEMORY_FORMATS as MEMORY_FORMATS  # where the CLI reads the memory formats from
from graphopt.options import Options, check_options
from graphopt.passes import REGISTRY
from graphopt.precision import INT8, emulated_on_cpu, runs_on
from graphopt.progress import shown as show_progress
from graphopt.report import Report
from graphopt.runtime import OptimizedModule, int8_modules
from graphopt.side_effects import preserved_user_objects
from graphopt.stages import SharedByEngines, assemble, build_runtime, capture_model, prepare, rewrite
from graphopt.validate import check_inputs


@one_at_a_time
def optimize(
    model: nn.Module,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    mode: str | None = None,
    passes: Sequence[str] | None = None,
    disable: Iterable[str] = (),
    frontend: str = "auto",
    dynamic_shapes: Any = dynamic.DEFAULT,
    dynamic_batch: bool = True,
    verify: bool | str = True,
    memory_format: str = "auto",
    keep_channels_last_outputs: bool = False,
    precision: str = "fp32",
    low_precision_ops: Iterable[str] | None = None,
    fp32_ops: Iterable[str] | None = None,
    calibration: Iterable[Any] | None = None,
    fuse: str | bool | None = None,
    engine: str = DEFAULT_ENGINE,
    device: str | torch.device | None = None,
    tune: bool = False,
    accuracy: float | None = None,
    tune_budget_s: float = tuning.DEFAULT_BUDGET_S,
    tune_target: str = "latency",
    tune_batch_size: int | None = None,
    remeasure: bool = False,
    progress: bool | None = None,
) -> OptimizedModule:
    """Return a faster, verified copy of ``model``; ``model`` itself is never modified.

    Args:
        model: the ``nn.Module`` to optimize.
        example_inputs: a tensor, a tuple of forward()'s positional arguments or a dict of
            its keyword arguments (``model(**batch)``), with the shapes, dtypes and device the
            model will run on.
        example_kwargs: keyword arguments of forward() beside ``example_inputs`` (as in
            ``torch.export.export(model, args, kwargs)``). Keyword inputs take their places in
            forward()'s signature; parameters skipped before them take their defaults (e.g.
            ``None``). The optimized module accepts the same calls, by position or by name.
        mode: ``"inference"``, ``"training"``, or None: inference when ``model`` is in
            eval mode, training otherwise. The copy is put in that mode.
        passes: pass names to run, in order, instead of the mode's preset.
        disable: pass names to leave out.
        frontend: ``"fx"`` (symbolic_trace), ``"export"`` (torch.export) or ``"auto"``
            (fx, then export).
        dynamic_shapes: the input dimensions the optimized module may be called with other
            sizes of, in torch.export's vocabulary: ``"batch+sequence"`` (default: the batch
            dimension, and the sequence dimensions of token inputs such as ``input_ids`` and
            ``attention_mask``), ``"batch"``, ``"auto"`` (every dimension the model allows),
            None (every size fixed) or a torch.export spec by parameter name or position, e.g.
            ``{"input_ids": {1: torch.export.Dim("seq", max=512)}}``. A dimension varies only
            where the captured graph keeps it dynamic and verification ran at a second size of it
            (see ``graphopt.dynamic``).
        dynamic_batch: False is ``dynamic_shapes=None`` (kept for older code).
        verify: compare outputs with the original after every pass (dtype-aware
            tolerance); a mismatch raises `VerificationError`.
        memory_format: ``"auto"`` (channels_last only if it measures faster on the
            example inputs; for CPU inference, oneDNN's fused kernels with prepacked weights
            (`use_onednn_kernels`) are tried next and kept only if they measure faster too),
            ``"channels_last"`` (always, for models with 2-D/3-D convs) or ``"preserve"``
            (keep the model's layout); with these two the oneDNN kernels are opt-in
            (``passes=``).
        keep_channels_last_outputs: leave 4-D outputs in channels_last instead of
            converting them back to the contiguous layout the model returned.
        precision: ``"fp32"`` (no change), ``"bf16"`` or ``"fp16"``: run conv, linear,
            matmul and attention in that dtype, sensitive ops in fp32 (opt-in: it changes
            numerics, verified with the low dtype's tolerance). ``"int8"`` (CPU inference,
            with ``calibration``): convs and linears on oneDNN's int8 kernels, each layer
            whose error would exceed ``accuracy`` kept in float32 (see `graphopt.passes.quantize_int8`);
            where none stays in int8 (over the budget, or not faster), a warning says so and the
            result is the default float32 call's.
        low_precision_ops, fp32_ops: override the op families of the precision policy
            (names: see ``graphopt.passes.use_low_precision``).
        calibration: with ``precision="int8"``, the batches each layer's input range is
            measured on: an iterable of batches shaped like ``example_inputs`` (a DataLoader
            of ``(inputs, labels)`` works: the first items of each batch are used). With
            ``tune=True``, int8 calibrated on them becomes one of the candidates.
        fuse: ``None`` (no fusion), ``"inductor"`` (regions of connected pointwise ops
            compiled by torch.compile), ``"torchscript"`` (the same regions scripted with
            torch.jit.script, deprecated by PyTorch) or ``"graph"`` (the whole optimized
            graph handed to torch.compile). Compiled during ``optimize``; a region whose
            backend fails stays eager, with the reason in ``report.fusion``. For a causal
            language model's ``generate()`` on the PyTorch engine, ``None`` also compiles the
            decode graph whole (Inductor, freezing) where it is not measured slower,
            ``"graph"`` compiles it unmeasured, and ``False`` compiles nothing
            (``report.generation.compiled``; see `graphopt.generation_build.compile_decode`).
        engine: the runtime the optimized graph runs on (``graphopt.backends.ENGINES``):
            ``"pytorch"`` (default: graphopt's own passes and kernels, any mode and device),
            ``"openvino"``, ``"onnxruntime"`` or ``"inductor"`` (inference; the graph after
            the portable passes, handed to that runtime, which chooses layouts and kernels
            itself; ``precision`` is the runtime's: see ``graphopt engines``). The engine's
            outputs are verified against the original model on the example and on the second
            input; ``report.engine`` says how. A runtime that is not installed raises
            `EngineError` naming the extra to install.
        device: the device the model will run on (default: where its parameters are);
            the copy is moved there, and the example inputs must be on it. On CUDA,
            graphs with convolutions and static input shapes turn on cudnn.benchmark.
        tune: build candidate configurations (the graph with no passes; memory formats;
            each low precision ``accuracy`` admits; int8 with ``calibration``; fusion when
            ``tune_budget_s`` allows),
            time them on the example inputs (``tune_target="throughput"``: at ``tune_batch_size``) and return the
            fastest within ``accuracy``.
            Options given explicitly (``memory_format``, ``precision``, ``fuse``,
            ``passes``) are kept, not tuned. Choices are cached (see ``graphopt.tuning``); a cached
            choice is verified on this model and tuned again if over ``accuracy``. Not with
            ``verify=False`` (a candidate's error must be measured).
        accuracy: with ``tune``, the largest error allowed, relative to the output's scale
            (default: the fp32 tolerance, 1e-4, so only exact candidates; 3e-2 admits bf16).
            With ``precision="int8"``, the output error budget (default 5e-2), measured on the
            example inputs and verified on them and on a second input.
        tune_budget_s: with ``tune``, about how many seconds tuning may take beyond each precision class's first
            candidate on each engine, which is always built (see ``graphopt.tuning.candidates``).
        tune_target: with ``tune``, what the candidates are ranked by: ``"latency"`` (default: seconds per call on
            the example inputs) or ``"throughput"`` (samples per second at ``tune_batch_size``: each candidate is timed
            on inputs whose batch dimension, dim 0 of each tensor with the example's batch size, holds that many rows,
            the example's repeated, and must accept them; see ``graphopt.tuning``). Not for a causal language model's
            ``generate()``, which tune times per new token.
        tune_batch_size: with ``tune_target="throughput"``, the batch size (an int >= 1) to time at; one other than the
            example's needs the batch dimension free (``dynamic_shapes`` other than None).
        remeasure: time the measured passes again instead of reusing a clear decision this
            machine took before for the same graph and inputs (also ``GRAPHOPT_REMEASURE=1``;
            see ``graphopt.timing``).
        progress: show a status line on stderr while capturing, running the passes,
            tuning and compiling: None (default) on a terminal only, True always, False never.

    Returns:
        An `OptimizedModule` with ``.graphopt_report``; for a causal language model with its key/value cache on
        (transformers' ``GenerationMixin``, ``config.use_cache``), also ``.generate()`` (see `graphopt.generation`).
    """
    if progress is not None and not isinstance(progress, bool):
        raise InvalidOptionError(f"progress={progress!r}: use True (always), False (never) or None (on a terminal only)")
    with show_progress(progress):
        model, example_inputs, options = check_options(
            model, example_inputs, example_kwargs=example_kwargs, mode=mode, passes=passes, disable=disable, frontend=frontend,
            dynamic_shapes=dynamic_shapes, dynamic_batch=dynamic_batch, verify=verify, memory_format=memory_format,
            keep_channels_last_outputs=keep_channels_last_outputs, precision=precision, low_precision_ops=low_precision_ops,
            fp32_ops=fp32_ops, calibration=calibration, fuse=fuse, engine=engine, device=device, tune=tune, accuracy=accuracy,
            tune_budget_s=tune_budget_s, tune_target=tune_target, tune_batch_size=tune_batch_size, remeasure=remeasure,
        )  # fmt: skip
        if options.tune:
            return _tuned(model, example_inputs, options)
        return run_stages(model, example_inputs, options)


def run_stages(model: nn.Module, example_inputs: Any, options: Options, shared: SharedByEngines | None = None) -> OptimizedModule:
    """``optimize``'s stages after the options, in order (see `graphopt.stages`); ``shared``: within a tune call, what
    its engine candidates share."""
    if options.generation:
        return _with_generation(model, example_inputs, options, shared)
    started = time.perf_counter()
    workspace = prepare(model, example_inputs, options)
    # forward() runs many times below (reference, capture, checks): what it writes outside the call (globals,
    # closures) is put back; the copy's own attributes are graphopt's, and some passes change them (pad_channels)
    with preserved_user_objects(workspace.owned, module_attributes=False):
        stage_started = time.perf_counter()
        capture = capture_model(workspace, options, shared)
        captured = time.perf_counter()
        rewritten = rewrite(workspace, capture, options, shared)
        rewritten_at = time.perf_counter()
        runtime = build_runtime(workspace, capture, rewritten, options, shared)
        built = time.perf_counter()
        optimized = assemble(workspace, capture, rewritten, runtime, options)
    stages = {"capture": captured - stage_started, "passes": rewritten_at - captured, "runtime": built - rewritten_at}
    optimized.graphopt_report.stage_seconds = {**stages, "other": time.perf_counter() - started - sum(stages.values())}
    if options.int8 and options.info.own_passes and options.passes is None and not int8_modules(optimized):
        return _float_instead_of_int8(model, example_inputs, options, optimized.graphopt_report)
    return optimized


def _with_generation(model: nn.Module, example_inputs: Any, options: Options, shared: SharedByEngines | None) -> OptimizedModule:
    """A causal language model with its cache on: its calls through the stages on a copy whose cache is off, and
    ``generate()`` on the prefill and decode graphs of another copy (`graphopt.generation`) on ``options``' engine,
    verified. The calls run graphopt's PyTorch graph whatever the engine (the report says so)."""
    optimized = _calls_without_cache(model, example_inputs, options, shared)
    owned = prepare(model, example_inputs, dataclasses.replace(options, int8=False)).owned  # int8 generation needs no calibration
    return _with_generator(optimized, generation_build.build(model, example_inputs, owned, options.info, options.precision, options.int8_accuracy, _step_passes(options)))


def _step_passes(options: Options) -> generation_build.StepPasses:
    """The passes the generation graphs go through on the PyTorch engine: those ``optimize`` selected for inference."""
    return generation_build.StepPasses(options.pass_infos, options.remeasure, options.fuse)


def _calls_without_cache(model: nn.Module, example_inputs: Any, options: Options, shared: SharedByEngines | None) -> OptimizedModule:
    """A causal language model's calls, optimized on a copy whose cache is off, on graphopt's PyTorch graph."""
    without_cache = generation.without_cache(model)
    given = {**_DEFAULTS, **options.shared_by_candidates(), **options.fixed_by_caller(), "engine": DEFAULT_ENGINE, "tune": False, "precision": "fp32"}
    return run_stages(without_cache, example_inputs, check_options(without_cache, example_inputs, **given)[2], shared)


def _with_generator(optimized: OptimizedModule, generator: generation.Generator) -> OptimizedModule:
    """``optimized`` with ``generator`` as its generate(), in its report too."""
    optimized.generator = generator
    optimized.graphopt_report.generation = generator.report
    if generator.report.engine != DEFAULT_ENGINE:
        optimized.graphopt_report.notes.append(f"engine={generator.report.engine!r} runs generate(); calls of the module run graphopt's PyTorch graph")
    if generator.report.precision != "fp32":
        optimized.graphopt_report.notes.append(f"precision={generator.report.precision!r} applies to generate(); calls of the module compute in fp32")
    return optimized


def _tuned_generation(model: nn.Module, example_inputs: Any, options: Options) -> OptimizedModule:
    """``tune=True`` for a causal language model: its calls on graphopt's PyTorch graph, and generate() on the engine
    that generates fastest (`tuning.tune_generation`), each candidate verified."""
    optimized = _calls_without_cache(model, example_inputs, options, None)
    ids, mask = generation.prompt_of(example_inputs)
    fixed = "engine" in options.fixed_by_caller()
    engines = [options.info] if fixed else [info for info in ENGINES.values() if info.generates]

    def build(engine: EngineInfo, precision: str) -> generation.Generator:
        owned = prepare(model, example_inputs, dataclasses.replace(options, int8=False)).owned
        return generation_build.build(model, example_inputs, owned, engine, precision, options.tune_accuracy, _step_passes(options))

    def decoding(generator: generation.Generator) -> Callable[[], Any]:
        return generation.decoding(generator, ids, mask, tuning.TUNE_NEW_TOKENS)

    assert options.tune_accuracy is not None
    candidates = tuning.generation_candidates(engines, options.tune_accuracy, options.fixed_by_caller().get("precision"))
    # the choice depends on the candidates and the engines' versions besides what tune's key holds; remeasure= only
    # decides whether a remembered choice is used, so a choice made again is remembered under the same key
    settings = {
        **options.shared_by_candidates(), "remeasure": None, **options.fixed_by_caller(), "budget_s": options.tune_budget_s,
        "generate": [(info.name, precision) for info, precision in candidates], "versions": {info.name: info.version() for info in engines},
    }  # fmt: skip
    key = tuning.cache_key(model, (ids, mask), {**settings, "accuracy": options.tune_accuracy})
    generator, report = tuning.tune_generation(build, candidates, decoding, options.tune_accuracy, options.tune_budget_s, key, options.remeasure)
    optimized = _with_generator(optimized, generator)
    optimized.graphopt_report.tune = report
    return optimized


# optimize's defaults: a tune candidate is built with the options the caller gave, and these for the rest
_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(optimize).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "progress"
}


def build_candidate(model: nn.Module, example_inputs: Any, shared: SharedByEngines, **given: Any) -> OptimizedModule:
    """One of tune's candidates: ``optimize(model, example_inputs, **given)``, its engine candidates building from ``shared``."""
    model, example_inputs, options = check_options(model, example_inputs, **{**_DEFAULTS, **given})
    return run_stages(model, example_inputs, options, shared)


def _float_instead_of_int8(model: nn.Module, example_inputs: Any, options: Options, attempt: Report) -> OptimizedModule:
    """The default float32 call's result, for ``precision="int8"`` where no layer stayed in int8.

    The int8 pipeline leaves its layers on oneDNN's float32 kernels, chosen without timing (int8 needs them);
    the default call keeps them only where they time faster. The int8 attempt's quantizing pass entry goes
    into the report, so that ``report.why(layer)`` still says why the layer is not in int8.
    """
    quantize = next((p for p in attempt.passes if REGISTRY[p.name].quantizes), None)
    reason = quantize.notes[0] if quantize is not None and quantize.notes else "the quantizing pass did not run"
    message = (
        f"precision='int8': no conv or linear stayed in int8 ({reason}), so this is the default "
        "float32 call's result (precision='fp32'); report.why(<layer>) says why each layer is not in int8"
    )
    warn_at_caller(f"graphopt: {message}", UserWarning)
    optimized = optimize(model, example_inputs, **options.shared_by_candidates(), memory_format=options.memory_format)
    report = optimized.graphopt_report
    report.notes.insert(0, message)
    report.warnings.append(message)
    if quantize is not None:
        report.passes.append(quantize)
    return optimized


def _tuned(model: nn.Module, example_inputs: Any, options: Options) -> OptimizedModule:
    """``optimize(tune=True)``: the fastest accurate candidate (see `graphopt.tuning`); with ``calibration``, int8 is one."""
    if options.generation:
        return _tuned_generation(model, example_inputs, options)
    low_precisions = [name for name in ("bf16", "fp16") if runs_on(name, model)]
    emulated = {name: reason for name in low_precisions if (reason := emulated_on_cpu(name, model))}
    args = copied_inputs(check_inputs(model, example_inputs))  # the candidates are timed on it, not on the caller's tensors
    batches = None if options.calibration is None else list(options.calibration)  # iterated once: each int8 build reads the same batches
    common, fixed = options.shared_by_candidates(), options.fixed_by_caller()
    shared = SharedByEngines()  # the engine candidates build from one capture, one run of the portable passes

    def build(**candidate: Any) -> OptimizedModule:
        int8 = {"calibration": batches} if candidate.get("precision") == INT8 else {}
        return build_candidate(model, example_inputs, shared, **{**common, **fixed, **candidate, **int8})

    # a model in train mode is tuned apart from eval, and a choice for latency apart from one for throughput at each batch
    settings = {**common, "mode": options.mode, "budget_s": options.tune_budget_s, "target": options.tune_target, "batch": options.tune_batch_size}
    if batches is not None:
        settings["calibration"] = f"{len(batches)} batches"
    cpu_inference = options.mode == "inference" and device_types(model) == {"cpu"}
    return tuning.tune(
        build,
        model,
        args,
        fixed=fixed,
        accuracy=options.tune_accuracy,
        budget_s=float(options.tune_budget_s),
        low_precisions=low_precisions,
        settings=settings,
        onednn=cpu_inference and torch.backends.mkldnn.is_available(),
        emulated=emulated,
        int8=batches is not None,
        engines=[info for info in ENGINES.values() if not info.own_passes] if cpu_inference else [],  # the other engines serve CPU inference
        batch_size=options.tune_batch_size,
    )

"""``optimize``'s first stage: every option checked, before anything costly runs (`check_options` -> `Options`).

Each refusal of a bad option or option combination is here, as an `InvalidOptionError` (or a
subclass) saying what to pass instead; the later stages (`graphopt.stages`) take the checked
`Options` and refuse nothing the caller could have been told up front.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from graphopt import dynamic
from graphopt.backends import DEFAULT_ENGINE, ENGINES, EngineInfo, engine_info
from graphopt.backends.fuse_compile import FUSE_BACKENDS
from graphopt.capture import check_frontend
from graphopt.errors import InvalidModelError, InvalidOptionError, ModeSwitchError, warn_at_caller
from graphopt.generation import check_model as check_generation_model
from graphopt.generation import is_cached_lm as generation_model
from graphopt.passes import MODES, Mode, PassInfo
from graphopt.pipeline import engine_left_out, select_passes
from graphopt.precision import INT8, PRECISIONS, check_int8, check_precision, precision_policy
from graphopt.runtime import OptimizedModule, int8_modules, prepacked_modules
from graphopt.runtime.portable import to_aten
from graphopt.validate import check_model, positional_inputs
from graphopt.verify import tolerance_for

MEMORY_FORMATS = ("auto", "channels_last", "preserve")
TUNE_TARGETS = ("latency", "throughput")  # tune=True's ranking: seconds per call at the example's batch, or samples per second at tune_batch_size


@dataclass(frozen=True)
class Options:
    """``optimize``'s options once checked: as the caller gave them (what tune's candidates are built with), and
    what the stages read, derived from them (the resolved mode, the engine, the dtypes, the passes to run)."""

    # as given (``mode`` as given, or the mode an optimized module was optimized in)
    mode_given: str | None
    passes: Sequence[str] | None
    disable: Iterable[str]
    frontend: str
    dynamic_shapes: Any  # resolved from dynamic_shapes= and dynamic_batch=
    verify: bool | str
    memory_format: str
    keep_channels_last_outputs: bool
    precision: str
    low_precision_ops: Iterable[str] | None
    fp32_ops: Iterable[str] | None
    calibration: Iterable[Any] | None
    fuse: str | bool | None  # as given: False compiles nothing, generate()'s decode graph included (`calls_fuse`: the calls')
    engine: str
    device: str | torch.device | None
    tune: bool
    accuracy: float | None
    tune_budget_s: float
    tune_target: str
    tune_batch_size: int | None  # tune_target="throughput": the batch the candidates are timed at
    remeasure: bool
    # derived
    mode: Mode
    info: EngineInfo
    int8: bool
    int8_accuracy: float | None  # precision="int8": the output error budget
    low_dtype: torch.dtype | None  # bf16/fp16: the dtype the result computes in
    graph_dtype: torch.dtype | None  # the dtype graphopt's passes put in the graph (None where another engine computes in low_dtype itself)
    low_ops: frozenset[str]
    kept_ops: frozenset[str]
    measure: bool  # the measured passes decide by timing on this machine
    pass_infos: Sequence[PassInfo]
    strict: bool  # verify="strict"
    tune_accuracy: float | None  # tune=True: the largest error a candidate may have
    generation: bool = False  # a causal language model with its key/value cache: generate() is built too (graphopt.generation)

    @property
    def calls_fuse(self) -> str | None:
        """What the calls' graph compiles (None: nothing); ``fuse=False`` is None for them too."""
        return None if self.fuse is False else self.fuse  # type: ignore[return-value]  # True was refused

    def shared_by_candidates(self) -> dict[str, Any]:
        """The options every tune candidate is built with, as the caller gave them."""
        return dict(
            mode=self.mode_given, disable=self.disable, frontend=self.frontend, dynamic_shapes=self.dynamic_shapes,
            keep_channels_last_outputs=self.keep_channels_last_outputs, low_precision_ops=self.low_precision_ops, fp32_ops=self.fp32_ops,
            device=self.device, verify=self.verify, remeasure=self.remeasure,
        )  # fmt: skip

    def fixed_by_caller(self) -> dict[str, Any]:
        """The options tune would choose but the caller set explicitly: kept, not tuned."""
        given = (
            ("memory_format", self.memory_format, "auto"), ("precision", self.precision, "fp32"), ("fuse", self.fuse, None),
            ("passes", self.passes, None), ("engine", self.engine, DEFAULT_ENGINE),
        )  # fmt: skip
        return {name: value for name, value, default in given if value != default}


def check_options(
    model: nn.Module,
    example_inputs: Any,
    *,
    example_kwargs: Mapping[str, Any] | None,
    mode: str | None,
    passes: Sequence[str] | None,
    disable: Iterable[str],
    frontend: str,
    dynamic_shapes: Any,
    dynamic_batch: bool,
    verify: bool | str,
    memory_format: str,
    keep_channels_last_outputs: bool,
    precision: str,
    low_precision_ops: Iterable[str] | None,
    fp32_ops: Iterable[str] | None,
    calibration: Iterable[Any] | None,
    fuse: str | bool | None,
    engine: str,
    device: str | torch.device | None,
    tune: bool,
    accuracy: float | None,
    tune_budget_s: float,
    tune_target: str,
    tune_batch_size: int | None,
    remeasure: bool,
) -> tuple[nn.Module, Any, Options]:
    """The module to optimize (the one inside DataParallel/DDP, or an optimized module's graph), the example inputs as
    forward()'s positional arguments, and the checked options; a bad option raises `InvalidOptionError`, a model that
    cannot be optimized `InvalidModelError`. Runs nothing costly (no forward(), no copy, no capture)."""
    check_model(model)
    calls_fuse = None if fuse is False else fuse  # False: nothing compiled, generate()'s decode graph included; for the calls as None
    if mode is None and isinstance(model, OptimizedModule):
        mode = model.graphopt_report.mode  # its graph module's training flag may not say (torch.export's does not)
    model = _unwrap(model, mode)
    if example_kwargs is not None:
        example_inputs = positional_inputs(model, example_inputs, example_kwargs)  # forward()'s positional arguments from here on
    if int8_modules(model):
        raise InvalidModelError(
            f"{', '.join(int8_modules(model)[:3])} already run oneDNN's int8 kernels, which cannot be captured again: "
            "optimize the original model with the options you want instead"
        )
    if prepacked_modules(model):
        raise InvalidModelError(
            f"{', '.join(prepacked_modules(model)[:3])} already run oneDNN kernels on prepacked weights, "
            "which cannot be captured again: optimize the original model with the options you want instead"
        )
    resolved_mode = _resolve_mode(mode, model)
    info = engine_info(engine)
    _check_engine(info, resolved_mode, precision, memory_format, calls_fuse, passes)
    int8 = precision == INT8
    int8_accuracy = None
    if int8:
        if tune:
            raise InvalidOptionError("tune=True chooses the precision itself: leave precision out, and calibration= makes int8 one of its candidates")
        int8_accuracy = check_int8(model, resolved_mode, memory_format, calls_fuse, accuracy, device)
    elif calibration is not None and not tune:
        raise InvalidOptionError("calibration= is for precision='int8' (or tune=True, which then tries int8): pass one of them, or leave calibration out")
    if accuracy is not None and not (tune or int8):  # it would be silently ignored
        raise InvalidOptionError(
            f"accuracy={accuracy!r} applies with tune=True (the largest error a candidate may have) or precision='int8' "
            "(the output error budget of the int8 layers): pass one of them, or leave accuracy out"
        )
    if tune and verify is False:  # tune keeps a candidate only if its error, measured by verification, is within accuracy
        raise InvalidOptionError(
            "tune=True returns the fastest candidate within accuracy, which it knows from each candidate's verified error: "
            "verify=False would leave every error unmeasured. Leave verify out (or use verify='strict'), "
            "or optimize without tune=True, passing the options you want"
        )
    low_dtype = None if int8 else check_precision(precision, model)
    graph_dtype = low_dtype if info.own_passes else None  # another engine computes in the low precision itself
    low_ops, kept_ops = precision_policy(low_precision_ops, fp32_ops)
    if calls_fuse is not None and calls_fuse not in FUSE_BACKENDS:
        raise InvalidOptionError(f"unknown fuse {fuse!r}: use None, False or one of {', '.join(map(repr, FUSE_BACKENDS))}")
    if memory_format not in MEMORY_FORMATS:
        raise InvalidOptionError(f"unknown memory_format {memory_format!r}: use one of {', '.join(map(repr, MEMORY_FORMATS))}")
    # int8 runs the oneDNN kernels it quantizes, unmeasured; another engine gets the portable passes only
    measure = memory_format == "auto" and not int8 and info.own_passes
    pass_infos = select_passes(
        resolved_mode,
        passes,
        disable,
        preserve_layout=memory_format == "preserve" or not info.own_passes,
        low_precision=graph_dtype is not None,
        fuse=calls_fuse,
        measure=measure,
        int8=int8 and info.own_passes,  # another engine quantizes itself
        portable=not info.own_passes,
    )
    check_frontend(frontend)
    resolved_shapes = dynamic.resolve(dynamic_shapes, dynamic_batch)
    strict = _check_verify(verify)
    tune_accuracy = _check_tuning(accuracy, tune_budget_s, precision) if tune else None
    _check_tune_target(tune, tune_target, tune_batch_size, example_inputs, resolved_shapes)
    generation = generation_model(model) and _check_generation(model, resolved_mode, info, precision, calibration, tune_target)
    options = Options(
        mode_given=mode, passes=passes, disable=disable, frontend=frontend, dynamic_shapes=resolved_shapes, verify=verify,
        memory_format=memory_format, keep_channels_last_outputs=keep_channels_last_outputs, precision=precision,
        low_precision_ops=low_precision_ops, fp32_ops=fp32_ops, calibration=calibration, fuse=fuse, engine=engine, device=device,
        tune=tune, accuracy=accuracy, tune_budget_s=tune_budget_s, tune_target=tune_target, tune_batch_size=tune_batch_size, remeasure=remeasure,
        mode=resolved_mode, info=info, int8=int8,
        int8_accuracy=int8_accuracy, low_dtype=low_dtype, graph_dtype=graph_dtype, low_ops=low_ops, kept_ops=kept_ops,
        measure=measure, pass_infos=pass_infos, strict=strict, tune_accuracy=tune_accuracy, generation=generation,
    )  # fmt: skip
    return model, example_inputs, options


def _unwrap(model: nn.Module, mode: str | None) -> nn.Module:
    """The module to optimize: the one inside nn.DataParallel/DDP, or the graph of an already optimized module."""
    if isinstance(model, nn.DataParallel):
        warn_at_caller(
            "graphopt optimizes the module inside nn.DataParallel and returns it unwrapped. DataParallel is slower "
            "than DistributedDataParallel even on one machine (one process scatters and gathers through GPU 0): run "
            "one process per GPU with torchrun and wrap the optimized module in "
            "torch.nn.parallel.DistributedDataParallel(module, device_ids=[local_rank]).",
            UserWarning,
        )
        return model.module
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    if isinstance(model, OptimizedModule):
        if model.graphopt_report.mode == "inference" and mode == "training":
            raise ModeSwitchError(
                "this module was optimized for inference (BatchNorm folded, dropout removed): it cannot be optimized "
                "for training. Optimize the original model with mode='training'."
            )
        if mode is not None:  # a graph that fixed the other mode would go on computing in it
            model.check_mode_switch(mode == "training")
        # oneDNN kernels with prepacked weights cannot be captured: ATen's ops, which they compute, can
        return to_aten(model.graph_module) if prepacked_modules(model.graph_module) else model.graph_module
    return model


def _resolve_mode(mode: str | None, model: nn.Module) -> Mode:
    if mode is None:
        return "training" if model.training else "inference"
    if mode not in MODES:
        raise InvalidOptionError(f"unknown mode {mode!r}: use 'inference', 'training', or None (inference when the model is in eval mode)")
    return mode  # type: ignore[return-value]


def _check_engine(info: EngineInfo, mode: Mode, precision: str, memory_format: str, fuse: str | None, passes: Sequence[str] | None) -> None:
    """Refuse, before anything costly, what engine ``info`` cannot do; the PyTorch engine takes every option."""
    if info.own_passes:
        return
    info.check_installed()
    name = info.name
    if mode == "training":
        raise InvalidOptionError(
            f"engine={name!r} serves inference only: its compiled graph has no autograd. Train with engine='pytorch' (the default), "
            f"and optimize the trained model with mode='inference', engine={name!r} to serve it"
        )
    if precision not in info.precisions:
        raise InvalidOptionError(f"engine={name!r} computes in {', '.join(map(repr, info.precisions))}, not precision={precision!r}: choose one of those, or engine='pytorch'")
    if fuse is not None:
        raise InvalidOptionError(f"engine={name!r} compiles the whole graph itself: leave fuse= out (it is for engine='pytorch')")
    if memory_format == "channels_last":
        raise InvalidOptionError(f"engine={name!r} chooses its own memory layouts: leave memory_format= out (it is for engine='pytorch')")
    pytorch_only = [pass_name for pass_name in passes or () if pass_name in engine_left_out()]
    if pytorch_only:
        raise InvalidOptionError(
            f"passes= asks for {', '.join(pytorch_only)}, whose result only PyTorch runs: engine={name!r} gets the portable passes, leave them out"
        )


def _check_verify(verify: Any) -> bool:
    """Whether ``verify`` asks for strict verification; an unknown value raises `InvalidOptionError`."""
    if verify is not True and verify is not False and verify != "strict":
        raise InvalidOptionError(
            f"verify={verify!r}: use True (check every pass; roll back one that fails, with a warning), 'strict' "
            "(any mismatch raises VerificationError) or False (no checks)"
        )
    return verify == "strict"


def _check_tuning(accuracy: float | None, budget_s: float, precision: str) -> float:
    """tune=True's accuracy budget (default: the tolerance of the precision the caller fixed, fp32's if none); a budget
    that is not a positive number raises `InvalidOptionError`."""
    if accuracy is None:
        accuracy = tolerance_for(PRECISIONS[precision] or torch.float32)
    if not (isinstance(accuracy, (int, float)) and accuracy > 0):
        raise InvalidOptionError(f"accuracy={accuracy!r}: give the largest error allowed relative to the output's scale, e.g. 1e-4 or 3e-2")
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise InvalidOptionError(f"tune_budget_s={budget_s!r}: give a number of seconds, e.g. 60")
    return float(accuracy)


def _check_tune_target(tune: bool, target: str, batch: Any, example_inputs: Any, dynamic_shapes: Any) -> None:
    """Refuse a ``tune_target``/``tune_batch_size`` pair tune cannot time: an unknown target, either without what it
    needs, a batch that is not a positive int, or one other than the example's where every size is fixed."""
    if target not in TUNE_TARGETS:
        raise InvalidOptionError(f"unknown tune_target {target!r}: use one of {', '.join(map(repr, TUNE_TARGETS))}")
    if target == "throughput" and not tune:
        raise InvalidOptionError("tune_target='throughput' says what tune=True ranks candidates by: pass tune=True too, or leave tune_target out")
    if target != "throughput":
        if batch is not None:
            raise InvalidOptionError(
                f"tune_batch_size={batch!r} is the batch tune_target='throughput' times the candidates at: pass tune=True, tune_target='throughput' "
                "too, or leave tune_batch_size out (latency is timed on the example inputs)"
            )
        return
    if batch is None:
        raise InvalidOptionError("tune_target='throughput' times each candidate at the batch size you serve: give that size, e.g. tune_batch_size=32")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidOptionError(f"tune_batch_size={batch!r}: give the number of samples per call to time the candidates at, an int >= 1, e.g. 32")
    example = dynamic.batch_size(example_inputs)
    if example is None:
        raise InvalidOptionError(
            "tune_target='throughput' times each candidate at tune_batch_size rows of the inputs' batch dimension (dim 0), and no example "
            "input is a tensor with one: leave tune_target out to tune for latency"
        )
    if batch != example and dynamic_shapes is None:
        raise InvalidOptionError(
            f"tune_batch_size={batch} differs from the example's batch {example}, and every size is fixed (dynamic_shapes=None or dynamic_batch=False), "
            f"so no candidate would accept it: give example inputs of batch {batch}, or let the batch vary (dynamic_shapes='batch', or leave it out)"
        )


def _check_generation(model: nn.Module, mode: Mode, info: EngineInfo, precision: str, calibration: Any, tune_target: str) -> bool:
    """A causal language model with its cache on gets generate() (True); what generation does not do yet is refused."""
    check_generation_model(model, training=mode == "training")
    *others, last = [repr(engine.name) for engine in ENGINES.values() if engine.generates]
    engines = f"{', '.join(others)} or {last}" if others else last
    unsupported = [
        text
        for text, given in (
            (f"engine={info.name!r} (generation runs on engine={engines} so far)", not info.generates),
            (
                f"precision={precision!r} on engine={info.name!r} (generation computes in "
                + "; ".join(f"{', '.join(engine.generation_precisions)} on {engine.name}" for engine in ENGINES.values() if engine.generates)
                + ")",
                info.generates and precision not in info.generation_precisions,
            ),
            ("calibration= (int8 generation compresses the weights alone, without calibration data)", calibration is not None),
            ("tune_target='throughput' (tune=True times generate() per new token, at the example prompt's batch)", tune_target == "throughput"),
        )
        if given
    ]
    if unsupported:
        raise InvalidOptionError(
            f"{type(model).__name__} generates with its key/value cache, and graphopt's generate() does not take {'; '.join(unsupported)}: "
            "leave the option out (or choose an engine that computes in the precision), or set model.config.use_cache = False to optimize its forward alone (scoring, no generation)"
        )
    return True

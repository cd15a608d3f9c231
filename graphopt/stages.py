"""``optimize``'s stages after the options, in order; each takes what the ones before it returned.

    prepare(model, example_inputs, options)                    -> Workspace  the model's copy, the inputs on the device
    capture_model(workspace, options, shared)                  -> Capture    reference run, side effects, second inputs,
                                                                             the graph checked against eager, the Verifier
    rewrite(workspace, capture, options, shared)               -> Rewritten  the verified passes: graph, pass rows, diffs
    build_runtime(workspace, capture, rewritten, options, shared) -> Runtime  fusion, or the engine's runner, verified
    assemble(workspace, capture, rewritten, runtime, options)  -> OptimizedModule with its Report

``shared`` is None but within one ``tune=True`` call, where every engine candidate (each engine other than
PyTorch, in each precision) builds from the first one's capture, portable passes and conversions
(`SharedByEngines`). Only `assemble` builds the report, from the other stages' results; warnings are
raised where they arise, pointing at the caller's line.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from graphopt import dynamic, progress
from graphopt import verify as verify_outputs
from graphopt.backends import EngineInfo, EngineInput, EngineRunner
from graphopt.backends.fuse_compile import compile_graph, compile_regions
from graphopt.capture import Captured, capture_graph
from graphopt.device import enable_cudnn_benchmark, resolve_device
from graphopt.diff import GraphDiff, NodeInfo, snapshot
from graphopt.errors import InvalidModelError, SideEffectWarning, VerificationError, VerificationWarning, warn_at_caller
from graphopt.inputs import InputSignature, argument_names, copied_inputs, unread_arguments
from graphopt.options import Options
from graphopt.passes import PassContext
from graphopt.pipeline import Verifier, run_verified
from graphopt.precision import calibration_batches
from graphopt.report import EngineReport, FusionReport, PassReport, Report
from graphopt.runtime import OptimizedModule, updates_state
from graphopt.side_effects import side_effects_message, watch_side_effects
from graphopt.validate import SecondInputs, check_inputs, reference_run, with_values_of
from graphopt.verify import Check, tolerance_for


@dataclass
class SharedByEngines:
    """Within one ``tune=True`` call, what the first engine candidate made at each step ("capture", "passes",
    "conversions": `EngineInput.reused`), for the other engine candidates to build from."""

    made: dict[str, Any] = field(default_factory=dict)


def _once(shared: SharedByEngines | None, info: EngineInfo, step: str, make: Callable[[], Any]) -> Any:
    """``make()``; within a tune call (``shared``), for an engine other than PyTorch, what the first engine candidate made at ``step``."""
    if shared is None or info.own_passes:
        return make()
    if step not in shared.made:
        shared.made[step] = make()
    return shared.made[step]


@dataclass
class Workspace:
    """What the stages work on, never the caller's model or tensors: a deep copy of the model on the target
    device, in the mode optimized for, and copies of the example inputs (every run of the stages uses these)."""

    model: nn.Module  # the caller's (unwrapped) model: copied and read (its name, its state_dict keys), never run
    target: torch.device
    args: tuple[Any, ...]
    request: dynamic.Request  # the dimensions the caller asked to vary, and forward()'s argument names
    calibration: tuple[tuple[Any, ...], ...]  # precision="int8": the calibration batches, checked like the example
    training: bool
    move: bool  # device= given: copies go to target
    owned: nn.Module = field(init=False)  # the copy every stage runs

    def fresh_copy(self) -> nn.Module:
        """A new deep copy of the model, on the target device, in the mode optimized for."""
        try:
            owned = copy.deepcopy(self.model)
        except Exception as error:
            raise InvalidModelError(
                f"could not copy {type(self.model).__name__} ({type(error).__name__}: {error}); graphopt works on a deep copy "
                "so that your model is never modified: make the model deep-copyable (copy.deepcopy)"
            ) from error
        if self.move:
            owned.to(self.target)
        return owned.train(self.training)


def prepare(model: nn.Module, example_inputs: Any, options: Options) -> Workspace:
    """The example inputs checked and copied onto the target device, the dynamic dimensions asked for, the calibration
    batches (int8) checked like the example, and the model's deep copy (`InvalidInputsError`, `InvalidModelError`)."""
    target = resolve_device(options.device, model, example_inputs)
    on = target if options.device is not None else None
    args = copied_inputs(check_inputs(model, example_inputs, on))
    request = dynamic.request(options.dynamic_shapes, args, argument_names(model, len(args)))
    batches = calibration_batches(options.calibration, lambda batch: check_inputs(model, batch, on), args, request.dims) if options.int8 else ()
    workspace = Workspace(model, target, args, request, batches, training=options.mode == "training", move=options.device is not None)
    workspace.owned = workspace.fresh_copy()
    return workspace


@dataclass
class Capture:
    """The capture stage's result: the graph, checked against eager, and what every later check compares with."""

    captured: Captured
    example: Check  # the example inputs and the original's outputs (and gradients, training) on them
    second: Check | None  # the second input the result is verified on (int8: a calibration batch's values), None: none accepted
    others: SecondInputs  # the second inputs tried, and why the model refused any
    verifier: Verifier | None  # None: verify=False
    fixed_arguments: Collection[str]  # arguments the graph does not read (any value computes the same)
    nodes: list[NodeInfo]  # the captured graph's nodes, read before the passes
    free: dynamic.Dims  # per argument, the dimensions calls may vary: where a second size was verified
    unverified_dims: str  # why dimensions the graph could vary stay fixed ("": none)
    warnings: list[str]  # side effects of forward(), what verification cannot say: already raised


def capture_model(workspace: Workspace, options: Options, shared: SharedByEngines | None) -> Capture:
    """Run the original on the example (the reference), watch forward()'s side effects, find the second inputs it
    accepts, and capture its graph (`graphopt.capture`); then what the result will be verified on, and by whom."""
    owned, args, request, training = workspace.owned, workspace.args, workspace.request, workspace.training

    def reference_and_graph() -> tuple[Check, SecondInputs, Captured, str, Collection[str], list[NodeInfo]]:
        with watch_side_effects(owned) as watch:
            example = Check(args, reference_run(owned, args, gradients=training), "the example inputs")
        others = SecondInputs(owned, args, request.dims, gradients=training)
        captured = capture_graph(owned, example, options.frontend, request, others if options.verify else None)
        # read before the passes, which may leave an argument unread where any value computes the same (a removed dropout's p)
        fixed_arguments = unread_arguments(captured.graph_module, args, request.names) if captured.frontend == "fx" else ()
        effects = side_effects_message(watch.effects, type(workspace.model).__name__)
        return example, others, captured, effects, fixed_arguments, snapshot(captured.graph_module.graph)

    # the captured graph's nodes are read now: an engine candidate sharing this capture gets it after the passes
    example, others, captured, side_effects, fixed_arguments, nodes = _once(shared, options.info, "capture", reference_and_graph)
    warnings_ = []
    if side_effects:
        warn_at_caller(f"graphopt: {side_effects}", SideEffectWarning)
        warnings_.append(side_effects)
    second = captured.second
    if options.int8 and second is not None:  # resampled example values say nothing of a calibrated model: real ones do
        second = with_values_of(second, workspace.calibration[-1], owned) or second
    if options.verify:
        warnings_ += _unverifiable(example, second, others, options.low_dtype)
    verifier = Verifier(example, second, options.mode, options.strict, original=workspace.fresh_copy, int8_accuracy=options.int8_accuracy) if options.verify else None
    # sizes may vary in calls only where a second size was verified (or, unverified, where the graph keeps them dynamic)
    free = captured.dims
    if options.verify:
        free = dynamic.varied(args, second.args) if second is not None else tuple(frozenset() for _ in captured.dims)
    unverified = _unverified_dims(captured.dims, free, request.names, others)
    return Capture(captured, example, second, others, verifier, fixed_arguments, nodes, free, unverified, warnings_)


@dataclass
class Rewritten:
    """The rewrite stage's result: the graph after the verified passes, and what each pass did."""

    graph_module: fx.GraphModule
    passes: list[PassReport]  # in order, rolled-back ones included with the reason
    diffs: dict[str, GraphDiff]
    second_input_error: float | None  # the final graph's error on the second input (None: not checked)
    second_input_gradient_error: float | None  # training: its gradients' error there


def rewrite(workspace: Workspace, capture: Capture, options: Options, shared: SharedByEngines | None) -> Rewritten:
    """Run the selected passes, each checked against the original (`pipeline.run_verified`): a pass that fails is
    rolled back (the passes run again without it, on a new capture), or, ``verify="strict"``, raises."""
    context = PassContext(
        mode=options.mode,
        example_inputs=workspace.args,
        keep_channels_last_outputs=options.keep_channels_last_outputs,
        measure=options.measure,
        precision=options.graph_dtype,
        low_precision_ops=options.low_ops,
        fp32_ops=options.kept_ops,
        device=workspace.target,
        calibration=workspace.calibration,
        accuracy=options.int8_accuracy,
        remeasure=options.remeasure,
    )
    recaptures = iter([capture.captured.graph_module])

    def fresh_graph() -> fx.GraphModule:
        """The captured graph, then (a pass rolled back) the same capture of a new copy of the model."""
        graph = next(recaptures, None)
        if graph is not None:
            return graph
        return capture_graph(workspace.fresh_copy(), capture.example, capture.captured.frontend, workspace.request).graph_module

    def passes() -> tuple[fx.GraphModule, list[PassReport], dict[str, GraphDiff], Any]:
        return run_verified(fresh_graph, options.pass_infos, context, capture.verifier, capture.captured.max_error)

    gm, reports, diffs, second_comparison = _once(shared, options.info, "passes", passes)
    outputs, gradients = second_comparison if second_comparison is not None else (None, None)
    return Rewritten(gm, list(reports), dict(diffs), None if outputs is None else outputs.max_error, None if gradients is None else gradients.max_error)


@dataclass
class Runtime:
    """What runs the optimized graph: None (the graph module itself, eager), a compiled graph (fuse="graph") or an
    engine's runner; and what the report says of it."""

    runner: Callable[..., Any] | None = None
    fusion: FusionReport | None = None
    engine: EngineReport | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # already raised


def build_runtime(workspace: Workspace, capture: Capture, rewritten: Rewritten, options: Options, shared: SharedByEngines | None) -> Runtime:
    """cudnn.benchmark where it pays, ``fuse=``'s compilation, or the engine's build from the optimized graph (engines
    other than PyTorch), verified like a pass on the example and the second input."""
    gm, args = rewritten.graph_module, workspace.args
    runtime = Runtime(notes=list(filter(None, [enable_cudnn_benchmark(gm, workspace.target)])))
    if options.calls_fuse is not None:
        # compiled code is specific to the autograd mode: compile for the one forward will run in
        inference = options.mode == "inference" and not updates_state(gm)
        run_context = torch.inference_mode if inference else torch.enable_grad if options.mode == "training" else torch.no_grad
        if options.calls_fuse == "graph":
            runtime.runner, runtime.fusion = compile_graph(gm, args, context=run_context, dynamic=capture.free)
        else:
            runtime.fusion = compile_regions(gm, options.calls_fuse, args, context=run_context, dynamic_batch=any(0 in dims for dims in capture.free))
    if options.info.own_passes:
        return runtime
    info = options.info
    checks = [check for check in (capture.example, capture.second) if check is not None] if options.verify else []
    conversions = _once(shared, info, "conversions", dict)
    int8_budget = (workspace.calibration, options.int8_accuracy) if options.int8 else None
    compute_dtype = torch.int8 if options.int8 else options.low_dtype
    runner, runtime.engine = _on_engine(info, gm, args, capture.free, options.precision, compute_dtype, checks, conversions, capture.verifier, int8_budget)
    runtime.runner = runner
    if options.int8 and runner.int8_fell_back:
        message = (
            f"precision='int8': no conv or linear stayed in int8 within accuracy={options.int8_accuracy:g} on engine={info.name!r}, "
            f"so this is its float32 result; the engine's notes say why each layer is not in int8"
        )
        warn_at_caller(f"graphopt: {message}", UserWarning)
        runtime.warnings.append(message)
    return runtime


def assemble(workspace: Workspace, capture: Capture, rewritten: Rewritten, runtime: Runtime, options: Options) -> OptimizedModule:
    """The `OptimizedModule` handed back: the optimized graph, what runs it, the calls it accepts (`InputSignature`),
    and the `Report` of every stage (notes and warnings in the order the stages raised them)."""
    captured, verifier = capture.captured, capture.verifier
    report = Report(
        mode=options.mode,
        frontend=captured.frontend,
        capture_attempts=captured.attempts,
        notes=[*captured.notes, *runtime.notes, *filter(None, [capture.unverified_dims])],
        verified=bool(options.verify),
        tolerance=options.int8_accuracy or _output_tolerance(capture.example.expected.outputs, options.low_dtype),
        capture_seconds=captured.seconds,
        passes=rewritten.passes,
        second_input_error=rewritten.second_input_error,
        second_input_gradient_error=rewritten.second_input_gradient_error,
        dynamic=dynamic.describe(capture.free, workspace.request.names),
        fusion=runtime.fusion,
        engine=runtime.engine,
        diffs=rewritten.diffs,
        captured_nodes=capture.nodes,
    )
    if options.verify:
        report.second_input = capture.second.differences if capture.second is not None else ""
    rolled_back = [f"pass {p.name!r} was rolled back: it failed verification (see its entry below)" for p in report.passes if p.rolled_back]
    report.warnings = [*capture.warnings, *rolled_back, *runtime.warnings]
    if verifier is not None and options.low_dtype is not None and (capture.example.description, options.low_dtype) in verifier.autocast:
        report.tolerance = verifier.low_precision_tolerances(capture.example, options.low_dtype)[0]  # what the precision was held to
        report.notes += _autocast_notes(verifier)
    # an engine's program fixes arguments without tensors at the example's values, as torch.export does
    fixed_values = captured.frontend == "export" or not options.info.own_passes
    signature = InputSignature(workspace.model, workspace.args, capture.free, fixed_values=fixed_values, fixed_arguments=capture.fixed_arguments)
    return OptimizedModule(rewritten.graph_module, report, runtime.runner, original_keys=workspace.model.state_dict().keys(), signature=signature)


def _on_engine(
    info: EngineInfo,
    gm: fx.GraphModule,
    args: tuple[Any, ...],
    free: dynamic.Dims,
    precision: str,
    compute_dtype: torch.dtype | None,
    checks: list[Check],
    conversions: dict[str, Any],
    verifier: Verifier | None,
    int8_budget: tuple[tuple[tuple[Any, ...], ...], float] | None = None,
) -> tuple[EngineRunner, EngineReport]:
    """The runner engine ``info`` builds from the optimized graph, verified on ``checks`` like a pass (else `VerificationError`).

    ``conversions``: what the engines made from this same graph before (`EngineInput.reused`). The runner is
    held to what a graph computing in ``compute_dtype`` is held to (`Verifier.output_tolerance`): in bf16/fp16
    torch.autocast's own error, in int8 (``int8_budget``: the calibration batches and the budget) the budget."""
    info.check_graph(gm, copied_inputs(args))
    started = time.perf_counter()
    calibration, accuracy = int8_budget or ((), None)
    for _ in progress.steps([info.name], "engine"):  # a status line while it builds (compilers take minutes on large models)
        runner = info.make(EngineInput(gm, copied_inputs(args), free, precision, conversions, calibration, accuracy))
    report = EngineReport(info.name, precision, build_seconds=time.perf_counter() - started, notes=list(runner.notes))
    errors = []
    for check in checks:
        with torch.inference_mode():
            actual = runner(*copied_inputs(check.args))
        tolerance = verifier.output_tolerance(check, compute_dtype) if verifier is not None else None
        comparison = verify_outputs.compare(check.expected.outputs, actual, compute_dtype, tolerance)
        if not comparison.ok:
            size = "" if comparison.max_error == float("inf") else f" by {comparison.max_error:.3e} relative to the output's scale (tolerance {comparison.tolerance:.0e})"
            reason = f"engine={info.name!r} ({precision}) computes {comparison.where} differently from the original model on {check.description}{size}: {comparison.detail}."
            raise VerificationError(
                f"{reason} Your model is unchanged; use engine='pytorch' (the default) or another engine, and please report the model.",
                max_error=comparison.max_error,
                reason=reason,
            )
        errors.append(comparison.max_error)
    report.max_error = errors[0] if errors else None
    report.second_input_error = errors[1] if len(errors) > 1 else None
    return runner, report


def _autocast_notes(verifier: Verifier) -> list[str]:
    """How the low precision was judged: torch.autocast's own errors in it, and the multiple a graph may reach."""
    notes = []
    for (description, dtype), (outputs, gradients) in verifier.autocast.items():
        name = str(dtype).removeprefix("torch.")
        own = f"{outputs:.1e} of the output's scale" + (f", gradients {gradients:.1e}" if gradients is not None else "")
        notes.append(
            f"{name} judged against torch.autocast({name}) on {description}: autocast's own error {own}; "
            f"accepted up to {verify_outputs.AUTOCAST_FACTOR:g}x that, and at least one {name} rounding ({verify_outputs.low_precision_floor(dtype):.1e})"
        )
    return notes


def _unverified_dims(kept: dynamic.Dims, free: dynamic.Dims, names: Sequence[str], others: SecondInputs) -> str:
    """Why dimensions the graph could vary stay fixed: no second size of them was verified ('' when none)."""
    fixed = tuple(mine - verified for mine, verified in zip(kept, free, strict=True))
    if not any(fixed):
        return ""
    refused = f" (the model refused one: {others.refused[0]})" if others.refused else ""
    return f"{dynamic.describe(fixed, names)} kept at the example's size: no second size could be verified{refused}"


def _unverifiable(example: Check, second: Check | None, others: SecondInputs, low_dtype: torch.dtype | None) -> list[str]:
    """What the user must know about the checks themselves: outputs too small to verify, no second input."""
    warnings_ = []
    # said once: on the example, else on the second input
    for check in filter(None, [example, second]):
        degenerate = verify_outputs.degenerate_outputs(check.expected.outputs, low_dtype)
        if degenerate:
            warnings_.append(
                f"on {check.description}, {'; '.join(degenerate)}: verification cannot tell a correct rewrite from a wrong "
                "one at that scale (the activations vanish with these weights, e.g. a random initialisation). Verify with "
                "trained weights, or example inputs that give outputs of normal magnitude."
            )
            break
    if second is None:
        refused = "; ".join(others.refused[:2])
        warnings_.append(
            "verified on the example inputs only: no second input (other batch size, values, strides) was accepted"
            + (f" ({refused})" if refused else "")
        )
    for warning in warnings_:
        warn_at_caller(f"graphopt: {warning}", VerificationWarning)
    return warnings_


def _output_tolerance(expected: Any, compute_dtype: torch.dtype | None) -> float | None:
    tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(expected) if isinstance(leaf, torch.Tensor)]
    tolerances = [tolerance_for(t.dtype) for t in tensors if t.is_floating_point()]
    if compute_dtype is not None:
        tolerances = [max(t, tolerance_for(compute_dtype)) for t in tolerances]
    return min(tolerances) if tolerances else None

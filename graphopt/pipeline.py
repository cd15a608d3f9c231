"""The pipeline: ordered passes per mode, each followed by a lint and a numeric check.

Every pass list is derived from the registry's `PassInfo` (`graphopt.passes`): the
presets, the passes an ``optimize`` call runs (`select_passes`), the fastest CPU
configuration (`cpu_kernel_passes`, for tune and the benchmark) and ONNX export's
subset (`onnx_left_out`, `onnx_refused`). After every pass the pipeline lints the graph,
records which nodes the pass created and erased, and (``verify=True``) runs the graph
on the example inputs and compares with the original model's outputs (in training
mode also the gradients); the final graph is also checked on a second input (another
batch size, fresh values, other strides). A pass that fails either check is rolled
back and the others stand (`run_verified`), or, with ``verify="strict"``, the failure
raises `VerificationError` naming the pass, the error, the output and the rewrites.

A `measured` pass (with ``ctx.measure``) is undone only if the graph runs clearly slower with
it (`graphopt.timing.compare_latency`: paired rounds until the ratio is clearly
`MIN_MEASURED_GAIN` faster or clearly slower, or `MEASURE_BUDGET_S` is spent): the preset's
choice stands through a measurement within the noise, so that runs on a loaded machine agree,
and the note says so. A clear decision is remembered on this machine (the CPU,
torch, the thread count, the graph before and after the pass, the example inputs' shapes,
dtypes and strides) and reused instead of measured again, unless ``ctx.remeasure`` or
``GRAPHOPT_REMEASURE=1``. The report shows one time per graph: a measurement that starts
from the graph the previous one ended with reports that graph's earlier time.
"""

from __future__ import annotations

import copy
import difflib
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt import progress, timing, verify
from graphopt.checkpoint import key_map
from graphopt.errors import GraphoptError, InvalidOptionError, PassModeError, UnknownPassError, VerificationError, VerificationWarning, warn_at_caller
from graphopt.passes import MODES, REGISTRY, Mode, PassContext, PassInfo, PassResult
from graphopt.passes import base as pass_base
from graphopt.passes.fold_conv_bn import fold_conv_bn
from graphopt.diff import GraphDiff, snapshot
from graphopt.report import NodeChange, PassReport
from graphopt.timing import Comparison, compare_latency

MEASURE_BUDGET_S = 2.0  # seconds spent timing one measured pass when the difference is not clear sooner


def preset(mode: Mode, measure: bool = True) -> tuple[str, ...]:
    """The passes ``mode`` runs by default, in registry order; without ``measure`` (memory_format other than
    "auto") the `preset_only_measured` ones are left out."""
    return tuple(name for name, info in REGISTRY.items() if mode in info.presets and (measure or not info.preset_only_measured))


PRESETS: dict[Mode, tuple[str, ...]] = {mode: preset(mode) for mode in MODES}

__all__ = [
    "PRESETS", "PassContext", "PassResult", "Verifier", "cpu_kernel_passes", "list_passes", "onnx_left_out", "onnx_refused",
    "preset", "preset_with", "resolve_passes", "run_passes", "run_verified", "select_passes",
]  # fmt: skip


def list_passes() -> list[PassInfo]:
    """Every registered pass, in run order, with its modes and one-line description."""
    return list(REGISTRY.values())


def _lookup(name: Any, option: str) -> PassInfo:
    if not isinstance(name, str) or name not in REGISTRY:
        close = difflib.get_close_matches(str(name), REGISTRY, n=1)
        suggestion = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownPassError(
            f"unknown pass {name!r} in {option}=.{suggestion} Known passes: {', '.join(REGISTRY)} "
            "(see graphopt.list_passes())"
        )
    return REGISTRY[name]


def _check_lists(passes: Any, disable: Any) -> None:
    if isinstance(passes, str) or isinstance(disable, str):
        raise UnknownPassError(f"passes= and disable= take a list of pass names, e.g. passes=[{fold_conv_bn.__name__!r}]")


def resolve_passes(mode: Mode, passes: Sequence[str] | None, disable: Iterable[str], measure: bool = True) -> list[PassInfo]:
    """The passes to run: ``passes`` (in that order) or the mode's preset (`preset` with ``measure``), minus ``disable``."""
    _check_lists(passes, disable)
    disabled = {_lookup(name, "disable").name for name in disable}
    if passes is None:
        return [REGISTRY[name] for name in preset(mode, measure) if name not in disabled]
    chosen = [_lookup(name, "passes") for name in passes]
    for info in chosen:
        if mode not in info.modes:
            raise PassModeError(
                f"pass {info.name!r} applies to {' and '.join(info.modes)} mode, not {mode}: "
                f"{info.description}. Remove it from passes= or call optimize(..., mode={info.modes[0]!r})"
            )
    return [info for info in chosen if info.name not in disabled]


def select_passes(
    mode: Mode,
    passes: Sequence[str] | None,
    disable: Iterable[str],
    *,
    preserve_layout: bool,
    low_precision: bool,
    fuse: str | None,
    measure: bool = True,
    int8: bool = False,
    portable: bool = False,
) -> list[PassInfo]:
    """The passes an ``optimize`` call runs: the preset (or ``passes``) shaped by its memory-format, precision and fuse options.

    Without ``measure`` (memory_format other than "auto") the preset leaves out its
    `preset_only_measured` passes. ``preserve_layout``: memory_format="preserve" leaves out the `layout` passes; without
    ``low_precision`` the `lowers_precision` pass is left out, with it (and no ``passes``)
    it goes in at its registry place. ``runs_last`` passes move to the end; with ``fuse``
    the ``fuse="without"`` passes are left out and, for region fusion, the
    ``fuse="regions"`` pass is added. With ``int8`` (and no ``passes``) the `quantizes` pass goes in with
    the `cpu_kernels` passes it quantizes, unmeasured; without it, it is left out. ``portable``: for an engine
    other than PyTorch, the passes `engine_left_out` names are left out too.
    """
    _check_lists(passes, disable)
    requested = set(passes or ())
    disabled = [*disable, *(engine_left_out() if portable else ())]
    for info in REGISTRY.values():
        if info.layout and preserve_layout:
            if info.name in requested:
                raise InvalidOptionError(f"passes= asks for {info.name} but memory_format='preserve' forbids it: drop one of them")
            disabled.append(info.name)
        if info.lowers_precision and not low_precision:
            if info.name in requested:
                raise InvalidOptionError(f"passes= asks for {info.name} but precision='fp32': pass precision='bf16' or 'fp16'")
            disabled.append(info.name)
        if info.quantizes and not int8:
            if info.name in requested:
                raise InvalidOptionError(f"passes= asks for {info.name} but precision is not 'int8': pass precision='int8' and calibration=")
            disabled.append(info.name)
    infos = resolve_passes(mode, passes, disabled, measure)
    if passes is None and low_precision:
        infos = [info for info in REGISTRY.values() if info in infos or (info.lowers_precision and info.name not in disabled)]
    if passes is None and int8:
        infos = [info for info in REGISTRY.values() if info in infos or ((info.quantizes or info.cpu_kernels) and info.name not in disabled)]
    if fuse is not None:
        infos = [info for info in infos if info.fuse != "without"]
    if fuse in ("inductor", "torchscript"):
        infos += [info for info in REGISTRY.values() if info.fuse == "regions" and info not in infos and info.name not in disabled]
    ordered = [info for info in infos if not info.runs_last]
    return ordered + [info for info in REGISTRY.values() if info.runs_last and info in infos]


def preset_with(mode: Mode, extra: Iterable[str] = (), *, low_precision: bool, channels_last: bool) -> list[str]:
    """``mode``'s preset plus ``extra`` passes, in registry order, as ``passes=`` for the given precision and layout options.

    The precision pass goes in with ``low_precision``; the layout passes stay out without ``channels_last``.
    """
    wanted = set(extra)
    return [
        name
        for name, info in REGISTRY.items()
        if (mode in info.presets or name in wanted or (info.lowers_precision and low_precision)) and not (info.layout and not channels_last)
    ]


def cpu_kernel_passes(precision: str, layout: str) -> list[str]:
    """The inference preset for ``precision`` and ``layout`` with the `cpu_kernels` passes: the fastest CPU configuration."""
    kernels = [name for name, info in REGISTRY.items() if info.cpu_kernels]
    return preset_with("inference", kernels, low_precision=precision != "fp32", channels_last=layout == "channels_last")


def onnx_left_out() -> list[str]:
    """The passes `export_onnx` leaves out: their result is CPU-specific or saves nothing outside PyTorch."""
    return [name for name, info in REGISTRY.items() if info.onnx != "exported"]


def engine_left_out() -> list[str]:
    """The passes an engine other than PyTorch does not get: their result is PyTorch-specific (kernels, layouts,
    in-place buffers), so the engine's graph has the portable passes only, those `export_onnx` exports too."""
    return onnx_left_out()


def onnx_refused() -> list[str]:
    """The passes whose result ONNX cannot express: `export_onnx` refuses ``passes=`` that ask for them."""
    return [name for name, info in REGISTRY.items() if info.onnx == "inexpressible"]


def _node_changes(nodes: Iterable[fx.Node]) -> list[NodeChange]:
    return [NodeChange.of(node) for node in nodes]


def _measure(before: fx.GraphModule, after: fx.GraphModule, ctx: PassContext) -> Comparison:
    """``before`` against ``after`` on the example inputs (forward only), until settled (`compare_latency`) or the budget is spent."""
    with verify.isolated(before), verify.isolated(after):
        return compare_latency(
            lambda: before(*ctx.example_inputs), lambda: after(*ctx.example_inputs), threshold=pass_base.MIN_MEASURED_GAIN, budget_s=MEASURE_BUDGET_S, asks="slower"
        )


def _tensor_signature(tensor: torch.Tensor) -> list[Any]:
    layout = list(tensor.stride()) if tensor.layout == torch.strided else str(tensor.layout)  # prepacked oneDNN weights have none
    return [list(tensor.shape), str(tensor.dtype), str(tensor.device), layout]


def _graph_signature(gm: fx.GraphModule) -> list[Any]:
    """What a graph's speed depends on: its code, its modules' configurations, its tensors' shapes, dtypes and layouts."""
    modules = [[name, type(module).__qualname__, module.extra_repr()] for name, module in gm.named_modules() if name]
    tensors = {name: _tensor_signature(t) for name, t in [*gm.named_parameters(), *gm.named_buffers()]}
    for node in gm.graph.nodes:  # tensors stored as plain attributes
        value = operator.attrgetter(str(node.target))(gm) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor):
            tensors[str(node.target)] = _tensor_signature(value)
    return [gm.code, modules, sorted(tensors.items())]


def _decision_key(info: PassInfo, before: fx.GraphModule, after: fx.GraphModule, ctx: PassContext) -> str:
    """Everything a measured decision depends on besides the CPU (`graphopt.timing.decision_key` adds it)."""
    inputs = [_tensor_signature(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in pytree.tree_leaves(ctx.example_inputs)]
    return timing.decision_key(
        info.name, pass_base.MIN_MEASURED_GAIN, torch.__version__, torch.get_num_threads(), _graph_signature(before), _graph_signature(after), inputs
    )


def _measured_decision(info: PassInfo, before: fx.GraphModule, after: fx.GraphModule, ctx: PassContext) -> tuple[Comparison, bool]:
    """``before`` against ``after`` (`_measure`), and whether that was remembered from an earlier run.

    A clear measurement is remembered; with ``ctx.remeasure`` (or ``GRAPHOPT_REMEASURE=1``) a
    remembered one is measured again, and a new result that is not clear forgets it.
    """
    key = _decision_key(info, before, after, ctx)
    remembered = None if ctx.remeasure or timing.remeasure_requested() else timing.remembered(key)
    if remembered is not None:
        return remembered, True
    measurement = _measure(before, after, ctx)
    timing.remember(key, measurement)
    return measurement, False


def _decision_note(measurement: Comparison, cached: bool) -> str:
    """``measured on the example inputs: 16.52 ms without, 8.10 ms with (2.04x): kept``, and why where it is not clear.

    The pass is undone only where `Comparison.slower`; "with" is "without" over the paired ratio, so the figures agree.
    """
    source = "measured on the example inputs in an earlier run on this machine" if cached else "measured on the example inputs"
    before = f"{measurement.baseline_s * 1e3:.2f} ms without" + (" (as timed above)" if measurement.anchored else "")
    figures = f"{source}: {before}, {measurement.candidate_s * 1e3:.2f} ms with ({measurement.ratio:.2f}x)"
    if measurement.slower:
        return f"{figures}: undone (clearly slower with it, beyond the measurement noise)"
    if measurement.settled:  # clearly not slower: the interval is at least at 1 / threshold
        return f"{figures}: kept"
    return f"{figures}: kept (within the measurement noise: the preset's choice stands unless the pass is clearly slower)"


@dataclass
class Verifier:
    """Checks a graph against the original: outputs on the example after every pass, the second input at the end.

    In training mode gradients are compared too (which parameters receive them, and, while
    every pass so far was exact, their values). ``second_each_pass`` also checks the second
    input after every pass: used to find the pass to blame when the final check fails.
    """

    example: verify.Check
    second: verify.Check | None
    mode: Mode
    strict: bool = False
    second_each_pass: bool = False
    original: Callable[[], nn.Module] | None = None  # a fresh copy of the original model (float64 confirmation, autocast)
    int8_accuracy: float | None = None  # optimize(precision="int8"): the accepted output error once layers run in int8
    # (check description, low dtype) -> torch.autocast's own errors on that check (outputs, gradients): see `low_precision_tolerances`
    autocast: dict[tuple[str, torch.dtype], tuple[float, float | None]] = field(default_factory=dict)

    def low_precision_tolerances(self, check: verify.Check, dtype: torch.dtype) -> tuple[float, float]:
        """The errors a graph computing in ``dtype`` may have on ``check`` (outputs, gradients): `verify.AUTOCAST_FACTOR`
        times torch.autocast's own in that dtype, measured on the original once per check, and never under one
        rounding in ``dtype`` (`verify.low_precision_floor`: where autocast changes little or nothing)."""
        key = (check.description, dtype)
        if key not in self.autocast:
            assert self.original is not None
            self.autocast[key] = verify.autocast_errors(check, self.original(), dtype, gradients=self.mode == "training")
        outputs, gradients = self.autocast[key]
        floor = verify.low_precision_floor(dtype)
        return max(floor, verify.AUTOCAST_FACTOR * outputs), max(floor, verify.AUTOCAST_FACTOR * (gradients or 0.0))

    def output_tolerance(self, check: verify.Check, compute_dtype: torch.dtype | None) -> float | None:
        """The output error a graph computing in ``compute_dtype`` may have on ``check``: bf16/fp16 as
        `low_precision_tolerances`, int8 the caller's accuracy budget, else None (the output dtype's tolerance)."""
        if compute_dtype in (torch.bfloat16, torch.float16) and self.original is not None:
            return self.low_precision_tolerances(check, compute_dtype)[0]
        return self.int8_accuracy if compute_dtype == torch.int8 else None

    def compare(
        self, gm: fx.GraphModule, check: verify.Check, compute_dtype: torch.dtype | None, removed: set[str]
    ) -> tuple[verify.Comparison, verify.Comparison | None]:
        """The graph's error on ``check``: outputs, and in training mode gradients (else None).

        A graph computing in bf16 or fp16 is held to torch.autocast's own error in that dtype on the same
        input (`low_precision_tolerances`); int8 to the caller's accuracy budget; the rest to float32's tolerance."""
        training = self.mode == "training"
        low = compute_dtype in (torch.bfloat16, torch.float16) and self.original is not None
        actual = verify.run_reference(gm, check.args, gradients=training)
        outputs = verify.compare(check.expected.outputs, actual.outputs, compute_dtype, self.output_tolerance(check, compute_dtype))
        if not training or check.expected.gradients is None or actual.gradients is None:
            return outputs, None
        if low:
            gradient_tolerance = self.low_precision_tolerances(check, compute_dtype)[1]  # type: ignore[arg-type]
        else:
            gradient_tolerance = max(verify.tolerance_for(torch.float32), verify.tolerance_for(compute_dtype) if compute_dtype else 0.0)
        values = compute_dtype is None or low
        gradients = verify.compare_gradients(check.expected.gradients, actual.gradients, gradient_tolerance, removed, values=values)
        if self.original is not None and compute_dtype is None:
            gradients = verify.confirm_gradients(gradients, self.original(), gm, check.args, removed)
        if not values and gradients.ok:
            return outputs, None  # which parameters receive gradients was checked; there is no value error to report
        return outputs, gradients


def _removed_parameters(reports: Iterable[PassReport]) -> set[str]:
    """The original state keys the passes so far took out of the graph or rewrote (checkpoint.StateChange)."""
    return set(key_map([change for report in reports for change in report.state_changes]))


def _verify(
    name: str, gm: fx.GraphModule, verifier: Verifier, check: verify.Check, report: PassReport | None, compute_dtype: torch.dtype | None, removed: set[str]
) -> tuple[verify.Comparison, verify.Comparison | None]:
    """The graph's errors on ``check`` after pass ``name`` ("": the whole pipeline); `VerificationError` when too large."""
    blame = f"pass {name!r}" if name else "the optimized graph"
    advice = f"Your model is unchanged; run optimize(..., disable=[{name!r}]) to skip this pass, and please report the model." if name else "Your model is unchanged; please report the model."
    try:
        comparisons = verifier.compare(gm, check, compute_dtype, removed)
    except Exception as error:
        reason = f"{blame} fails on {check.description} ({type(error).__name__}: {error})."
        raise VerificationError(f"{reason} {advice}", pass_name=name or None, reason=reason) from error
    for comparison in filter(None, comparisons):
        if comparison.ok:
            continue
        recorded = "; ".join(f"{r.where}: {r.detail}" for r in report.rewrites[:10]) if report is not None else ""
        rewrites = f" Its rewrites: {recorded or 'none recorded'}." if report is not None else ""
        scale = "gradient's" if comparison.where.startswith("gradient") else "output's"
        size = "" if comparison.max_error == float("inf") else f" by {comparison.max_error:.3e} relative to the {scale} scale (tolerance {comparison.tolerance:.0e})"
        reason = f"{blame} changed {comparison.where} on {check.description}{size}: {comparison.detail}.{rewrites}"
        raise VerificationError(f"{reason} {advice}", pass_name=name or None, max_error=comparison.max_error, reason=reason)
    return comparisons


def run_passes(
    gm: fx.GraphModule,
    infos: Sequence[PassInfo],
    ctx: PassContext,
    verifier: Verifier | None,
    capture_error: float = 0.0,
) -> tuple[fx.GraphModule, list[PassReport], dict[str, GraphDiff], tuple[verify.Comparison, verify.Comparison | None] | None]:
    """Run ``infos`` in order on ``gm``, each verified on the example, the result on the second input.

    ``capture_error`` is the captured graph's error, carried by passes that change nothing.
    With ``ctx.measure``, a `measured` pass that makes the graph clearly slower is undone.
    Returns the optimized graph module (``gm`` itself unless a pass was undone), the reports,
    the graph diff of each pass and the final graph's errors on the second input (outputs,
    gradients; None without ``verifier`` or a second input). A failed check raises
    `VerificationError` naming the pass, or no pass for the final check (`run_verified`
    rolls the pass back).
    """
    reports: list[PassReport] = []
    diffs = {}
    latency = None  # the report's time for the graph as it stands (None: it changed since it was last timed)
    error = capture_error
    gradient_error = None  # no pass has compared gradients yet
    compute_dtype = None  # set once a pass lowers precision: later checks use its tolerance
    for info in progress.steps(infos, "passes", lambda info: info.name):
        started = time.perf_counter()
        before = list(gm.graph.nodes)
        before_changes = {node: NodeChange.of(node) for node in before}
        before_nodes = snapshot(gm.graph)
        undo_copy = copy.deepcopy(gm) if info.measured and ctx.measure else None
        result = info.function(gm, ctx)
        report = result.report
        gm = result.graph_module
        try:
            gm.graph.lint()
        except Exception as lint_error:  # a malformed graph is a graphopt bug: say which pass made it
            raise GraphoptError(f"pass {info.name!r} produced an invalid graph ({lint_error}); please report this") from lint_error
        if report.state_changes and not info.changes_state:  # checkpoints rely on the registry's word
            raise GraphoptError(f"pass {info.name!r} changed stored tensors, but its PassInfo says changes_state=False; please report this")
        after = set(gm.graph.nodes)
        report.created = _node_changes(node for node in gm.graph.nodes if node not in before_changes)
        report.erased = [before_changes[node] for node in before if node not in after]
        if not info.exact and result.modified:
            compute_dtype = torch.int8 if info.quantizes else ctx.precision
        if verifier is not None and result.modified:
            removed = _removed_parameters([*reports, report])
            outputs, gradients = _verify(info.name, gm, verifier, verifier.example, report, compute_dtype, removed)
            if verifier.second_each_pass and verifier.second is not None:
                _verify(info.name, gm, verifier, verifier.second, report, compute_dtype, removed)
            report.max_error, report.mean_error = outputs.max_error, outputs.mean_error
            report.gradient_error = None if gradients is None else gradients.max_error
        elif verifier is not None:
            report.max_error, report.gradient_error = error, gradient_error
        if undo_copy is not None and result.modified:
            measurement, cached = _measured_decision(info, undo_copy, gm, ctx)
            if latency is not None:  # the graph it started from already has a time in the report
                measurement = measurement.anchored_to(latency)
            if measurement.slower:
                gm = undo_copy
                report = PassReport(info.name, max_error=error if verifier is not None else None, gradient_error=gradient_error)
            report.notes.append(_decision_note(measurement, cached))
            report.measurement, report.measurement_cached = measurement, cached
            latency = measurement.baseline_s if measurement.slower else measurement.candidate_s
        elif result.modified:
            latency = None
        report.seconds = time.perf_counter() - started  # the pass's whole cost: rewriting, checks and timing
        error = report.max_error if report.max_error is not None else error
        gradient_error = report.gradient_error if report.gradient_error is not None else gradient_error
        reports.append(report)
        origin = {change.name: info.name for change in [*report.created, *report.erased]}
        diffs[info.name] = GraphDiff(
            info.name, before_nodes, snapshot(gm.graph), {r.node: r.detail for r in report.rewrites}, report.skips, origin
        )
    second = None
    if verifier is not None and verifier.second is not None:
        second = _verify("", gm, verifier, verifier.second, None, compute_dtype, _removed_parameters(reports))
    return gm, reports, diffs, second


def run_verified(
    capture: Callable[[], fx.GraphModule],
    infos: Sequence[PassInfo],
    ctx: PassContext,
    verifier: Verifier | None,
    capture_error: float = 0.0,
) -> tuple[fx.GraphModule, list[PassReport], dict[str, GraphDiff], tuple[verify.Comparison, verify.Comparison | None] | None]:
    """`run_passes` on a freshly captured graph, then the second input; a pass that fails either is rolled back.

    A failing pass is left out and the passes run again on a new capture (``capture()``);
    when only the final check on the second input fails, the run is repeated checking the
    second input after every pass, to find the pass to blame. Each rolled-back pass keeps
    a report entry saying why, and a `VerificationWarning` is issued. With
    ``verifier.strict`` any mismatch raises `VerificationError` instead.
    Returns the graph, the reports, the diffs and the second input's comparisons (outputs, gradients).
    """
    rolled_back: dict[str, str] = {}
    gm = capture()
    while True:
        chosen = [info for info in infos if info.name not in rolled_back]
        try:
            gm, reports, diffs, second = run_passes(gm, chosen, ctx, verifier, capture_error)
            break
        except VerificationError as error:
            if verifier is None or verifier.strict or (error.pass_name is None and verifier.second_each_pass):
                raise
            if error.pass_name is None:
                verifier.second_each_pass = True  # find the pass that breaks the second input
            else:
                rolled_back[error.pass_name] = error.reason
                warn_at_caller(
                    f"graphopt rolled back pass {error.pass_name!r}, which failed verification: {error.reason} The other passes "
                    "stand. Use verify='strict' to make a mismatch an error; please report the model.",
                    VerificationWarning,
                )
            gm = capture()
    ran = dict(zip((info.name for info in chosen), reports, strict=True))
    unchanged = snapshot(gm.graph)
    for name in rolled_back:
        diffs[name] = GraphDiff(name, unchanged, unchanged, {}, [])
    reports = [ran[info.name] if info.name in ran else PassReport(info.name, rolled_back=rolled_back[info.name]) for info in infos]
    return gm, reports, diffs, second

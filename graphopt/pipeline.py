"""The pipeline: ordered passes per mode, each followed by a lint and a numeric check.

Presets are explicit ordered lists. After every pass the pipeline lints the graph,
records which nodes the pass created and erased, and (``verify=True``) runs the graph
on the example inputs and compares with the original model's outputs; a mismatch
raises `VerificationError` naming the pass, the error, the output and the rewrites.
"""

from __future__ import annotations

import copy
import difflib
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphopt import verify
from graphopt.errors import GraphoptError, PassModeError, UnknownPassError, VerificationError
from graphopt.passes import REGISTRY, Mode, PassContext, PassInfo, PassResult
from graphopt.diff import GraphDiff, snapshot
from graphopt.report import NodeChange, PassReport
from graphopt.timing import compare_latency

PRESETS: dict[Mode, tuple[str, ...]] = {
    # sync points first, on the model as written; dropout before folding so BatchNorms behind
    # a removed identity are seen by the folding pass; layout on the final set of convs, then the
    # kernel choices that depend on the dtype and layout each value ends up with
    "inference": (
        "report_sync_points", "remove_dropout", "use_attention_kernel", "create_on_device", "as_tensor",
        "remove_redundant_transfers", "fold_conv_bn", "fold_channel_scale", "to_channels_last", "use_global_pool_kernel",
        "compute_in_place",
    ),
    "training": (
        "report_sync_points", "use_attention_kernel", "create_on_device", "as_tensor", "remove_redundant_transfers",
        "drop_conv_bias", "to_channels_last",
    ),
}
# passes that must see the dtypes use_low_precision chooses: it goes in before the first of them
_AFTER_PRECISION = ("to_channels_last", "use_global_pool_kernel", "compute_in_place")
MIN_MEASURED_GAIN = 1.02  # a measured pass must make the graph at least this much faster to stay

__all__ = ["PRESETS", "PassContext", "PassResult", "list_passes", "low_precision_position", "resolve_passes", "run_passes"]


def low_precision_position(names: Sequence[str]) -> int:
    """Where use_low_precision goes in a list of pass names: after the exact rewrites, before layout and kernel choices."""
    return next((i for i, name in enumerate(names) if name in _AFTER_PRECISION), len(names))


def list_passes() -> list[PassInfo]:
    """Every registered pass, in preset order, with its modes and one-line description."""
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


def resolve_passes(mode: Mode, passes: Sequence[str] | None, disable: Iterable[str]) -> list[PassInfo]:
    """The passes to run: ``passes`` (in that order) or the mode's preset, minus ``disable``."""
    if isinstance(passes, str) or isinstance(disable, str):
        raise UnknownPassError("passes= and disable= take a list of pass names, e.g. passes=['fold_conv_bn']")
    disabled = {_lookup(name, "disable").name for name in disable}
    if passes is None:
        return [REGISTRY[name] for name in PRESETS[mode] if name not in disabled]
    chosen = [_lookup(name, "passes") for name in passes]
    for info in chosen:
        if mode not in info.modes:
            raise PassModeError(
                f"pass {info.name!r} applies to {' and '.join(info.modes)} mode, not {mode}: "
                f"{info.description}. Remove it from passes= or call optimize(..., mode={info.modes[0]!r})"
            )
    return [info for info in chosen if info.name not in disabled]


def _node_changes(nodes: Iterable[fx.Node]) -> list[NodeChange]:
    return [NodeChange.of(node) for node in nodes]


def _measure(before: fx.GraphModule, after: fx.GraphModule, ctx: PassContext) -> tuple[float, str]:
    """How many times faster ``after`` runs than ``before`` on the example inputs (forward only), and the figures."""
    with verify.isolated(before), verify.isolated(after):
        before_s, after_s = compare_latency(lambda: before(*ctx.example_inputs), lambda: after(*ctx.example_inputs))
    gain = before_s / after_s
    return gain, f"measured on the example inputs: {before_s * 1e3:.2f} ms without, {after_s * 1e3:.2f} ms with ({gain:.2f}x)"


def _verify(
    info: PassInfo, gm: fx.GraphModule, ctx: PassContext, expected: Any, report: PassReport, compute_dtype: torch.dtype | None
) -> verify.Comparison:
    """The graph's error after ``info`` ran; raises `VerificationError` naming the pass when it is too large."""
    try:
        actual = verify.run_isolated(gm, ctx.example_inputs)
    except Exception as error:
        raise VerificationError(
            f"pass {info.name!r} produced a graph that fails on the example inputs ({type(error).__name__}: {error}). "
            f"Your model is unchanged; run optimize(..., disable=[{info.name!r}]) to skip this pass, and please report the model.",
            pass_name=info.name,
        ) from error
    comparison = verify.compare(expected, actual, compute_dtype)
    if not comparison.ok:
        rewrites = "; ".join(f"{r.where}: {r.detail}" for r in report.rewrites[:10]) or "none recorded"
        raise VerificationError(
            f"pass {info.name!r} changed {comparison.where} by {comparison.max_error:.3e} relative to the "
            f"output's scale (tolerance {comparison.tolerance:.0e}; {comparison.detail}). Its rewrites: "
            f"{rewrites}. Your model is unchanged; run optimize(..., disable=[{info.name!r}]) to skip this "
            "pass, and please report the model.",
            pass_name=info.name,
            max_error=comparison.max_error,
        )
    return comparison


def run_passes(
    gm: fx.GraphModule,
    infos: Sequence[PassInfo],
    ctx: PassContext,
    expected: Any | None,
    capture_error: float = 0.0,
) -> tuple[fx.GraphModule, list[PassReport], dict[str, GraphDiff]]:
    """Run ``infos`` in order on ``gm``; verify against ``expected`` unless it is None.

    ``capture_error`` is the captured graph's error, carried by passes that change nothing.
    With ``ctx.measure``, a `measured` pass that does not make the graph faster is undone.
    Returns the optimized graph module (``gm`` itself unless a pass was undone), the reports
    and the graph diff of each pass.
    """
    reports = []
    diffs = {}
    error = capture_error
    compute_dtype = None  # set once a pass lowers precision: later checks use its tolerance
    for info in infos:
        before = list(gm.graph.nodes)
        before_changes = {node: NodeChange.of(node) for node in before}
        before_nodes = snapshot(gm.graph)
        undo_copy = copy.deepcopy(gm) if info.measured and ctx.measure else None
        started = time.perf_counter()
        result = info.function(gm, ctx)
        report = result.report
        report.seconds = time.perf_counter() - started
        gm = result.graph_module
        try:
            gm.graph.lint()
        except Exception as lint_error:  # a malformed graph is a graphopt bug: say which pass made it
            raise GraphoptError(f"pass {info.name!r} produced an invalid graph ({lint_error}); please report this") from lint_error
        after = set(gm.graph.nodes)
        report.created = _node_changes(node for node in gm.graph.nodes if node not in before_changes)
        report.erased = [before_changes[node] for node in before if node not in after]
        if not info.exact and result.modified:
            compute_dtype = ctx.precision
        if expected is not None and result.modified:
            comparison = _verify(info, gm, ctx, expected, report, compute_dtype)
            report.max_error, report.mean_error = comparison.max_error, comparison.mean_error
        elif expected is not None:
            report.max_error = error
        if undo_copy is not None and result.modified:
            gain, figures = _measure(undo_copy, gm, ctx)
            if gain < MIN_MEASURED_GAIN:
                gm = undo_copy
                undone = PassReport(info.name, seconds=report.seconds, max_error=error if expected is not None else None)
                undone.notes.append(f"{figures}: undone (a measured pass must be {MIN_MEASURED_GAIN:.2f}x faster to stay)")
                report = undone
            else:
                report.notes.append(f"{figures}: kept")
        error = report.max_error if report.max_error is not None else error
        reports.append(report)
        diffs[info.name] = GraphDiff(info.name, before_nodes, snapshot(gm.graph), {r.node: r.detail for r in report.rewrites}, report.skips)
    return gm, reports, diffs

"""The commands that optimize a model built by MODULE:FACTORY: ``graphopt optimize`` (the report, and the files it
may write: JSON report, ONNX, graphopt.save, AOTInductor package), ``graphopt export`` (ONNX) and ``graphopt diff``
(what the graph's rewrites changed, as text, HTML or a drawing).
"""

from __future__ import annotations

import argparse
import difflib
import shlex
from pathlib import Path

from graphopt.api import optimize
from graphopt.cli_arguments import UsageError, calibration_of, dynamic_shapes_of, model_and_inputs, progress_of, split_names
from graphopt.diff import diff as graph_diff_of
from graphopt.drawing import SAVE_SUFFIXES
from graphopt.export import export_onnx
from graphopt.passes import REGISTRY
from graphopt.pipeline import preset_with
from graphopt.saving import package, save


def optimize_command(args: argparse.Namespace) -> int:
    model, inputs = model_and_inputs(args)
    calibration = calibration_of(args)
    optimized = optimize(
        model,
        inputs,
        mode=args.mode,
        passes=split_names(args.passes),
        disable=split_names(args.disable) or (),
        frontend=args.frontend,
        dynamic_shapes=dynamic_shapes_of(args),
        verify="strict" if args.strict_verify else not args.no_verify,
        memory_format=args.memory_format,
        keep_channels_last_outputs=args.keep_channels_last_outputs,
        precision=args.precision,
        calibration=calibration,
        fuse=False if args.fuse == "off" else args.fuse,
        engine=args.engine,
        tune=args.tune,
        accuracy=args.accuracy,
        tune_target=args.tune_target,
        tune_batch_size=args.tune_batch_size,
        progress=progress_of(args),
    )
    print(optimized.graphopt_report)
    if args.report:
        Path(args.report).write_text(optimized.graphopt_report.to_json() + "\n")
        print(f"report written to {args.report}")
    if args.onnx:
        print(export_onnx(optimized, inputs, args.onnx, optimize=False, overwrite=args.overwrite))
    if args.save:
        print(f"saved to {save(optimized, args.save, overwrite=args.overwrite)} (graphopt run {shlex.quote(args.save)} times it)")
    if args.package:
        print(f"AOTInductor package written to {package(optimized, args.package, overwrite=args.overwrite)}")
    return 0


def export_command(args: argparse.Namespace) -> int:
    model, inputs = model_and_inputs(args)
    report = export_onnx(
        model,
        inputs,
        args.output,
        optimize=not args.no_optimize,
        dynamic_shapes=dynamic_shapes_of(args),
        opset=args.opset,
        overwrite=args.overwrite,
        precision=args.precision,
        progress=progress_of(args),
    )
    print(report)
    return 0


def _passes_for_diff(args: argparse.Namespace) -> list[str] | None:
    """The passes to run for ``graphopt diff --pass NAME``: the preset, plus NAME when it is opt-in (None: the preset)."""
    name = args.pass_name
    if name is None:
        return None
    info = REGISTRY.get(name)
    if info is None:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"--pass {name!r} is not a pass{hint} (graphopt passes lists them)")
    if args.mode not in info.modes:
        raise UsageError(f"--pass {name} applies to {' and '.join(info.modes)} mode: add --mode {info.modes[0]}")
    if info.lowers_precision and args.precision == "fp32":
        raise UsageError(f"--pass {name} runs when a low precision is asked for: add --precision bf16 (or fp16)")
    if info.layout and args.memory_format == "preserve":
        raise UsageError(f"--pass {name} changes memory formats, which --memory-format preserve forbids: leave that out")
    if args.mode in info.presets or info.lowers_precision:
        return None
    return preset_with(args.mode, [name], low_precision=args.precision != "fp32", channels_last=args.memory_format != "preserve")


def diff_command(args: argparse.Namespace) -> int:
    if args.drawing and Path(args.drawing).suffix.lower() not in SAVE_SUFFIXES:
        raise UsageError(f"--drawing: {Path(args.drawing).name!r} is not a .svg, .html or .png path")
    if (args.fold != "auto" or args.expand) and not (args.html or args.drawing):
        raise UsageError("--fold and --expand shape the drawing: add --html PATH or --drawing PATH")
    model, inputs = model_and_inputs(args)
    passes = _passes_for_diff(args)
    optimized = optimize(
        model, inputs, mode=args.mode, passes=passes, memory_format=args.memory_format, precision=args.precision,
        progress=progress_of(args),
    )  # fmt: skip
    diffs = optimized.graphopt_report.diffs
    if args.pass_name is not None and args.pass_name not in diffs:
        raise UsageError(f"pass {args.pass_name!r} did not run; these did: {', '.join(diffs)}")
    graph_diff = diffs[args.pass_name] if args.pass_name else graph_diff_of(optimized)
    print(graph_diff)
    if args.html:
        print(f"HTML diff written to {graph_diff.to_html(args.html, args.fold, args.expand or ())}")
    if args.drawing:
        print(f"drawing written to {graph_diff.draw(args.fold, args.expand or ()).save(args.drawing)}")
    return 0

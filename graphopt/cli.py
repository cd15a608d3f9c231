"""The ``graphopt`` command line.

    graphopt optimize MODULE:FACTORY --input 8x3x224x224 [--mode inference] [--report report.json] [--onnx out.onnx]
    graphopt optimize path/to/net.py:build --input 8x3x224x224   (MODULE may also be a module of the current folder)
    graphopt optimize MODULE:FACTORY --input 8x3x224x224 --save model.pt2 [--package model-aoti.pt2]
    graphopt optimize MODULE:FACTORY --input 8x3x224x224 --precision int8 --calibration batches/ [--accuracy 5e-2]
                      (--calibration: a folder of .pt files, a .pt file of a list of batches, or MODULE:FUNCTION)
    graphopt run model.pt2 [--input 4x3x224x224] [--rounds 20] [--allow-import]   (a graphopt.save file or an AOTInductor package)
    graphopt export MODULE:FACTORY OUT.onnx --input 8x3x224x224 [--precision fp16]
    graphopt diff MODULE:FACTORY --input 8x3x224x224 [--pass fold_conv_bn] [--html diff.html] [--drawing diff.png]
    graphopt lint train.py [--fix] [--format json]
    graphopt demo [--model resnet]
    graphopt bench [--models reference|anchors|NAME,...|MODULE:FACTORY] [--quick] [--output-dir DIR]
    graphopt passes
    graphopt --version

Errors name the command's options (``--overwrite``), not the library's (``overwrite=True``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import importlib.util
import json
import os
import pickle
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from graphopt import __version__
from graphopt.api import MEMORY_FORMATS, optimize
from graphopt.backends import DEFAULT_ENGINE, ENGINES
from graphopt.backends.fuse_compile import FUSE_BACKENDS
from graphopt.export import export_onnx
from graphopt.bench.harness import BenchModel
from graphopt.bench.models import select_models
from graphopt.bench.results import to_markdown
from graphopt.bench.suite import QUICK_MODELS, QUICK_VARIANTS, Settings, run_suite
from graphopt.bench.variants import variants as bench_variants
from graphopt.diff import diff as graph_diff_of
from graphopt.drawing import FOLDS, SAVE_SUFFIXES
from graphopt.dynamic import DEFAULT, POLICIES
from graphopt.lint import check_source, fix_source
from graphopt.timing import median_latencies
from graphopt.capture import FRONTENDS
from graphopt.errors import GraphoptError, ImportNotAllowedError
from graphopt.inputs import InputSignature, TensorSpec
from graphopt.models import REFERENCE_MODELS, get_reference_model
from graphopt.passes import REGISTRY, PassInfo
from graphopt.pipeline import list_passes, preset_with
from graphopt.precision import INT8, PRECISIONS
from graphopt.runtime import OptimizedModule
from graphopt.saving import is_aoti_package, load, package, save

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


class UsageError(GraphoptError):
    """A command-line argument graphopt cannot use."""


def parse_input_spec(spec: str, generator: torch.Generator, integers_below: int = 8) -> torch.Tensor:
    """``8x3x224x224`` or ``8x128:int64`` -> a random tensor (integers drawn from [0, ``integers_below``))."""
    shape_text, _, dtype_name = spec.partition(":")
    dtype = _DTYPES.get(dtype_name or "float32")
    try:
        shape = [int(size) for size in shape_text.lower().split("x")]
    except ValueError:
        shape = []
    if dtype is None or not shape or any(size <= 0 for size in shape):
        raise UsageError(
            f"--input {spec!r} is not SHAPE[:DTYPE]: write sizes joined by 'x', e.g. 8x3x224x224 or 8x128:int64 "
            f"(dtypes: {', '.join(_DTYPES)})"
        )
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, integers_below, shape, generator=generator, dtype=dtype)


def _import(module_name: str) -> ModuleType:
    """The module named ``module_name`` (importable from the current folder too) or at path ``module_name`` (a .py file)."""
    path = Path(module_name)
    if path.suffix == ".py":
        if not path.is_file():
            raise UsageError(f"{module_name} is not a file: check the path of the Python file, e.g. models/net.py:build")
        name = path.stem if path.stem not in sys.modules else f"graphopt_factory_{path.stem}"  # never shadow a module
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # the file's own imports of its neighbours
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `graphopt optimize net:build` in the folder of net.py, as `python -c` would
    return importlib.import_module(module_name)


def _import_attribute(reference: str, form: str) -> Any:
    """What ``MODULE:NAME`` (or ``path/to/file.py:NAME``) names; ``form`` is the spelling errors show."""
    module_name, _, attribute = reference.rpartition(":")
    if not module_name or not attribute:
        raise UsageError(f"{reference!r} is not {form}")
    try:
        module = _import(module_name)
    except UsageError:
        raise
    except Exception as error:  # a module that fails to import is the user's to fix, not a crash
        raise UsageError(f"cannot import {module_name!r} ({type(error).__name__}: {error}); is it on PYTHONPATH?") from error
    found = getattr(module, attribute, None)
    if found is None:
        close = difflib.get_close_matches(attribute, [name for name in dir(module) if not name.startswith("_")], n=1)
        hint = f"; did you mean {module_name}:{close[0]}?" if close else ""
        raise UsageError(f"module {module_name!r} has no attribute {attribute!r}{hint}")
    return found


def load_factory(reference: str) -> nn.Module:
    """Import ``MODULE:FACTORY`` (or ``path/to/file.py:FACTORY``) and call the factory (or take the module instance)."""
    factory = _import_attribute(reference, "MODULE:FACTORY or FILE.py:FACTORY, e.g. graphopt.models:resnet_small")
    if isinstance(factory, nn.Module):
        return factory
    if not callable(factory):
        raise UsageError(f"{reference} is a {type(factory).__name__}: name a function that returns an nn.Module")
    try:
        model = factory()
    except TypeError as error:
        raise UsageError(f"calling {reference}() failed ({error}): FACTORY must build the model with no arguments") from error
    if not isinstance(model, nn.Module):
        raise UsageError(f"{reference} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _split_names(text: str | None) -> list[str] | None:
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


def _model_and_inputs(args: argparse.Namespace) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model built by MODULE:FACTORY (in eval mode unless --mode training) and random --input tensors."""
    model = load_factory(args.target)
    if getattr(args, "mode", "inference") == "inference":
        model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    return model, tuple(parse_input_spec(spec, generator) for spec in args.input)


CALIBRATION_SOURCES = (
    "a folder of .pt files (one batch each, written by torch.save), a .pt file holding a list of batches, "
    "or MODULE:FUNCTION (or FILE.py:FUNCTION) returning or yielding batches"
)


def load_calibration(source: str) -> list[Any]:
    """The batches ``--calibration SOURCE`` names (`CALIBRATION_SOURCES`), for optimize's ``calibration``.

    A batch is a tensor, or a tuple/list/dict of tensors; `graphopt.optimize` checks each
    against the example inputs. Files are read with ``torch.load(weights_only=True)``, which
    rebuilds tensors and containers only: a data file never runs code.
    """
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.pt"))
        if not files:
            raise UsageError(
                f"--calibration {source}: the folder holds no .pt file; save one batch per file in it, "
                f"e.g. torch.save(batch, '{path / 'batch_000.pt'}')"
            )
        return [_checked_batch(_saved_tensors(file), str(file)) for file in files]
    if path.suffix == ".pt":
        if not path.is_file():
            raise UsageError(f"--calibration {source}: no such file; give {CALIBRATION_SOURCES}")
        saved = _saved_tensors(path)
        if not isinstance(saved, list) or not saved:
            what = "an empty list" if isinstance(saved, list) else f"one {type(saved).__name__}"
            raise UsageError(
                f"--calibration {source} holds {what}, not a list of batches: save one with torch.save([batch, ...], path), "
                "or one batch per file in a folder"
            )
        return [_checked_batch(batch, f"{source} item {index}") for index, batch in enumerate(saved)]
    if ":" in source:
        return _batches_from_function(source)
    raise UsageError(f"--calibration {source}: no such folder; give {CALIBRATION_SOURCES}")


def _saved_tensors(file: Path) -> Any:
    """What torch.save wrote to ``file``, read as tensors and containers only (on the CPU, where int8 runs)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # weights_only met an object it would have to run code to rebuild
        raise UsageError(
            f"--calibration: {file} holds objects other than tensors, which graphopt does not load (loading them could run "
            "code from the file): save batches as tensors, or tuples/lists/dicts of tensors (numpy arrays: torch.from_numpy first)"
        ) from error
    except Exception as error:  # not a torch.save file at all
        raise UsageError(f"--calibration: cannot read {file} as a torch.save file ({type(error).__name__}: {error})") from error


def _checked_batch(batch: Any, where: str) -> Any:
    """``batch`` if it is a tensor or a tuple/list/dict of tensors; otherwise an error naming ``where`` it came from."""
    leaves = torch.utils._pytree.tree_leaves(batch)
    if isinstance(batch, (torch.Tensor, tuple, list, dict)) and leaves and all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return batch
    raise UsageError(f"--calibration: {where} holds one {type(batch).__name__}, not a batch: a batch is a tensor, or a tuple/list/dict of tensors")


def _batches_from_function(reference: str) -> list[Any]:
    """The batches the function ``MODULE:FUNCTION`` returns or yields, called with no arguments."""
    try:
        function = _import_attribute(reference, f"MODULE:FUNCTION or FILE.py:FUNCTION; give {CALIBRATION_SOURCES}")
    except UsageError as error:
        raise UsageError(f"--calibration: {error}") from error
    if not callable(function):
        raise UsageError(f"--calibration {reference} is a {type(function).__name__}: name a function that returns or yields batches")
    try:
        result = function()
        # a tensor or dict iterates, but over rows or keys, not batches
        of_batches = isinstance(result, Iterable) and not isinstance(result, (torch.Tensor, Mapping, str, bytes))
        batches = list(result) if of_batches else None  # a generator's body runs here: its errors are the function's
    except Exception as error:  # the user's code failed: say so, not a traceback
        raise UsageError(f"--calibration {reference}() failed ({type(error).__name__}: {error}); it is called with no arguments") from error
    if batches is None:
        raise UsageError(
            f"--calibration {reference}() returned one {type(result).__name__}: return or yield the batches "
            "(a list, a generator or a DataLoader), each a tensor or a tuple/list/dict of tensors"
        )
    if not batches:
        raise UsageError(f"--calibration {reference}() gave no batch: return or yield at least one")
    return batches


def _calibration(args: argparse.Namespace) -> list[Any] | None:
    """The batches of --calibration, or None; --precision int8 requires it."""
    if args.calibration is not None:
        return load_calibration(args.calibration)
    if args.precision == INT8:
        raise UsageError(f"--precision int8 needs --calibration SOURCE, the batches each layer's input range is measured on: {CALIBRATION_SOURCES}")
    return None


DYNAMIC_CHOICES = (*POLICIES, "none")
DYNAMIC_HELP = "input sizes calls may vary: batch+sequence (default), batch, auto (every dimension the model allows), none"


def _dynamic_shapes(args: argparse.Namespace) -> str | None:
    """--dynamic-shapes as optimize's dynamic_shapes ("none": None)."""
    return None if args.dynamic_shapes == "none" else args.dynamic_shapes


def _progress(args: argparse.Namespace) -> bool | None:
    """--no-progress as optimize's progress (None: a status line on a terminal only)."""
    return False if args.no_progress else None


def _command_optimize(args: argparse.Namespace) -> int:
    model, inputs = _model_and_inputs(args)
    calibration = _calibration(args)
    optimized = optimize(
        model,
        inputs,
        mode=args.mode,
        passes=_split_names(args.passes),
        disable=_split_names(args.disable) or (),
        frontend=args.frontend,
        dynamic_shapes=_dynamic_shapes(args),
        verify="strict" if args.strict_verify else not args.no_verify,
        memory_format=args.memory_format,
        keep_channels_last_outputs=args.keep_channels_last_outputs,
        precision=args.precision,
        calibration=calibration,
        fuse=args.fuse,
        engine=args.engine,
        tune=args.tune,
        accuracy=args.accuracy,
        progress=_progress(args),
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


def _run_inputs(specs: list[str], signature: InputSignature | None, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random tensors of the --input shapes for ``graphopt run``. A spec without a dtype takes the saved signature's
    (``2x128`` for token ids is int64); integers are 0 or 1, valid token ids, masks and token types whatever the vocabulary."""
    saved = [leaf.dtype for leaf in signature.leaves if isinstance(leaf, TensorSpec)] if signature else []
    dtype_names = {dtype: name for name, dtype in _DTYPES.items()}
    specs = [
        f"{spec}:{dtype_names[saved[index]]}" if ":" not in spec and index < len(saved) and saved[index] in dtype_names else spec
        for index, spec in enumerate(specs)
    ]
    return tuple(parse_input_spec(spec, generator, integers_below=2) for spec in specs)


def _command_run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    started = time.perf_counter()
    if is_aoti_package(path):  # otherwise graphopt.load reads it, or says what is wrong with it
        if not args.input:
            raise UsageError("an AOTInductor package does not record its inputs: give their shapes with --input, e.g. --input 8x3x224x224")
        runner: Callable[..., Any] = torch._inductor.aoti_load_package(str(path))
        signature, kind = None, "AOTInductor package"
    else:
        try:
            runner = load(path, allow_import=args.allow_import)
        except ImportNotAllowedError as error:
            raise UsageError(
                f"{error.reason}: add --allow-import to let graphopt import {', '.join(error.modules)} (it runs that module's code: "
                "allow it for files you trust)"
            ) from error
        signature = runner.input_signature
        kind = f"graphopt module; accepts {signature.describe()}" if signature else "graphopt module"
    loaded_s = time.perf_counter() - started
    if args.input:
        inputs = _run_inputs(args.input, signature, torch.Generator().manual_seed(args.seed))
    else:
        inputs = runner.input_signature.example_inputs()  # the sizes it was optimized at (integers 0)
    with torch.no_grad():
        outputs = runner(*inputs)
    shapes = [list(leaf.shape) for leaf in torch.utils._pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]
    print(f"{path}: {kind}; loaded in {loaded_s:.2f}s")
    print(f"inputs {[list(leaf.shape) for leaf in torch.utils._pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]} -> outputs {shapes}")
    latency = median_latencies({"run": lambda: runner(*inputs)}, rounds=args.rounds)["run"]
    print(f"median latency {latency * 1e3:.2f} ms over {args.rounds} rounds on {torch.get_num_threads()} threads")
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


def _command_diff(args: argparse.Namespace) -> int:
    if args.drawing and Path(args.drawing).suffix.lower() not in SAVE_SUFFIXES:
        raise UsageError(f"--drawing: {Path(args.drawing).name!r} is not a .svg, .html or .png path")
    if (args.fold != "auto" or args.expand) and not (args.html or args.drawing):
        raise UsageError("--fold and --expand shape the drawing: add --html PATH or --drawing PATH")
    model, inputs = _model_and_inputs(args)
    passes = _passes_for_diff(args)
    optimized = optimize(
        model, inputs, mode=args.mode, passes=passes, memory_format=args.memory_format, precision=args.precision,
        progress=_progress(args),
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


def _python_files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            files += sorted(path.rglob("*.py"))
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"{text} does not exist: name Python files or folders to lint")
    return files


def _command_lint(args: argparse.Namespace) -> int:
    select = _split_names(args.select)
    findings = []
    for path in _python_files(args.paths):
        source = path.read_text(encoding="utf-8")
        if args.fix:
            fixed, remaining = fix_source(source, str(path), select)
            if fixed != source:
                path.write_text(fixed, encoding="utf-8")
            findings += remaining
        else:
            findings += check_source(source, str(path), select)
    if args.format == "json":
        print(json.dumps([finding.to_dict() for finding in findings], indent=2))
    else:
        for finding in findings:
            print(finding)
            print(f"    why: {finding.why}\n    fix: {finding.fix}")
        print(f"{len(findings)} finding(s)" + (" left after --fix" if args.fix else ""))
    return 1 if findings else 0


def _command_export(args: argparse.Namespace) -> int:
    model, inputs = _model_and_inputs(args)
    report = export_onnx(
        model,
        inputs,
        args.output,
        optimize=not args.no_optimize,
        dynamic_shapes=_dynamic_shapes(args),
        opset=args.opset,
        overwrite=args.overwrite,
        precision=args.precision,
        progress=_progress(args),
    )
    print(report)
    return 0


def _time_ratio(model: nn.Module, optimized: OptimizedModule, inputs: tuple[Any, ...]) -> dict[str, float]:
    def eager() -> Any:
        with torch.no_grad():
            return model(*inputs)

    return median_latencies({"eager (no_grad)": eager, "graphopt": lambda: optimized(*inputs)})


def _command_demo(args: argparse.Namespace) -> int:
    reference = get_reference_model(args.model)
    model = reference.build().eval()
    inputs = reference.example_inputs(batch_size=args.batch)
    print(f"graphopt demo: {reference.name} ({reference.description}), input {list(inputs[0].shape)}")
    optimized = optimize(model, inputs)
    print(optimized.graphopt_report)
    latencies = _time_ratio(model, optimized, inputs)
    eager = latencies["eager (no_grad)"]
    print(f"\nlatency, median of interleaved rounds on {torch.get_num_threads()} threads:")
    for name, seconds in latencies.items():
        print(f"  {name:<16} {seconds * 1e3:8.2f} ms   {eager / seconds:5.2f}x vs eager")
    print("(a ratio, not a benchmark: run on a quiet machine; `graphopt bench` compares graphopt with eager, torch.compile and onnxruntime)")
    return 0


def _bench_factory_model(args: argparse.Namespace, batch: int) -> Callable[[str], BenchModel]:
    """Builds the `BenchModel` of a ``MODULE:FACTORY`` entry of --models, with the --input shapes."""

    def from_factory(reference: str) -> BenchModel:
        load_factory(reference)  # fail now, with a clear message, rather than in the middle of the run
        specs = args.input or [f"{batch}x3x224x224"]

        def inputs() -> tuple[torch.Tensor, ...]:
            generator = torch.Generator().manual_seed(0)
            return tuple(parse_input_spec(spec, generator) for spec in specs)

        inputs()  # checks the --input specs
        return BenchModel(reference, lambda: load_factory(reference), inputs)

    return from_factory


def _bench_command_line(args: argparse.Namespace, settings: Settings, selection: str) -> str:
    """The command that repeats this run, with the defaults it used spelled out."""
    words = ["graphopt", "bench", "--models", selection, "--batch", str(settings.batch), "--device", settings.device]
    words += ["--rounds", str(settings.rounds), "--warmup", str(settings.warmup)]
    if settings.variants is not None:  # --quick's own list too: the command repeats the same run
        words += ["--variants", ",".join(settings.variants)]
    for option in ("low_precision", "exclude", "time_budget"):
        if getattr(args, option) is not None:
            words += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    for spec in args.input or ():
        words += ["--input", spec]
    return shlex.join(words)


def _command_bench(args: argparse.Namespace) -> int:
    if args.list_variants:
        for variant in bench_variants(args.low_precision or "bf16"):
            print(f"{variant.key:<22} {variant.role:<9} {variant.label}")
        return 0
    given = {name: getattr(args, name) for name in ("device", "batch", "rounds", "warmup", "low_precision") if getattr(args, name) is not None}
    defaults = Settings.quick() if args.quick else Settings()
    settings = dataclasses.replace(
        defaults,
        **given,
        variants=_split_names(args.variants) or defaults.variants,
        exclude=tuple(_split_names(args.exclude) or ()),
        time_budget_s=None if args.time_budget is None else args.time_budget * 60,
        output_dir=Path(args.output_dir),
    )
    selection = args.models or (QUICK_MODELS if args.quick else "reference")
    models = select_models(selection, settings.batch, _bench_factory_model(args, settings.batch))
    result = run_suite(models, settings, _bench_command_line(args, settings, selection))
    print()
    print(to_markdown(result))
    return 0 if any(model.error is None for model in result.models) else 1


def _when_it_runs(info: PassInfo) -> str:
    """Where a pass runs by default, or the option that asks for it."""
    if info.presets:
        return f"default: {', '.join(info.presets)}"
    if info.lowers_precision:
        return "opt-in: --precision"
    if info.quantizes:
        return "opt-in: --precision int8"
    if info.fuse == "regions":
        return "opt-in: --fuse"
    return "opt-in: --passes"


def _command_passes(args: argparse.Namespace) -> int:
    infos = list_passes()
    rows = [(info.name, f"[{', '.join(info.modes)}]", _when_it_runs(info), info.description) for info in infos]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for *cells, description in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + "  " + description)
    return 0


def _command_engines(args: argparse.Namespace) -> int:
    rows = [
        (info.name, ", ".join(info.precisions), info.missing() or "installed", f"{info.description}. Costs: {info.costs}")
        for info in ENGINES.values()
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    for name, precisions, installed, description in rows:
        print(f"{name.ljust(widths[0])}  {precisions.ljust(widths[1])}  {installed}\n    {description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphopt", description="Make PyTorch models faster by rewriting their graphs.")
    parser.add_argument("--version", action="version", version=f"graphopt {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("optimize", help="optimize a model built by MODULE:FACTORY and print the report")
    run.add_argument("target", metavar="MODULE:FACTORY", help="e.g. graphopt.models:resnet_small")
    run.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]", help="one per forward() argument, e.g. 8x3x224x224")
    run.add_argument("--mode", choices=("inference", "training"), default="inference", help="default: inference (the model is put in eval mode)")
    run.add_argument("--frontend", choices=FRONTENDS, default="auto")
    run.add_argument("--dynamic-shapes", choices=DYNAMIC_CHOICES, default=DEFAULT, help=DYNAMIC_HELP)
    run.add_argument("--passes", metavar="A,B", help="run exactly these passes, in order")
    run.add_argument("--disable", metavar="A,B", help="leave these passes out")
    checks = run.add_mutually_exclusive_group()
    checks.add_argument("--no-verify", action="store_true", help="skip the checks against the original model")
    checks.add_argument("--strict-verify", action="store_true", help="fail on any mismatch instead of rolling the pass back (for CI)")
    run.add_argument(
        "--memory-format",
        choices=MEMORY_FORMATS,
        default="auto",
        help="channels_last for convs: auto (if it measures faster), channels_last, preserve",
    )
    run.add_argument("--keep-channels-last-outputs", action="store_true", help="leave 4-D outputs in channels_last")
    run.add_argument(
        "--precision",
        choices=(*PRECISIONS, INT8),
        default="fp32",
        help="bf16/fp16: conv, linear, matmul in low precision (opt-in); int8 (CPU inference, with --calibration): "
        "convs and linears on oneDNN's int8 kernels, each layer over --accuracy kept in float32",
    )
    run.add_argument("--calibration", metavar="SOURCE", help=f"with --precision int8 (or --tune): the batches each layer's input range is measured on: {CALIBRATION_SOURCES}")
    run.add_argument("--fuse", choices=FUSE_BACKENDS, default=None, help="compile pointwise regions (inductor, torchscript) or the whole graph")
    run.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        default=DEFAULT_ENGINE,
        help="the runtime the optimized graph runs on (inference; see graphopt engines); default: graphopt's own PyTorch runtime",
    )
    run.add_argument("--tune", action="store_true", help="time candidate configurations (every installed engine too) and keep the fastest within --accuracy")
    run.add_argument(
        "--accuracy",
        type=float,
        default=None,
        help="largest error allowed, relative to the output scale: with --tune (default 1e-4; 3e-2 admits bf16) "
        "or --precision int8 (default 5e-2)",
    )
    run.add_argument("--report", metavar="PATH", help="also write the report as JSON")
    run.add_argument("--seed", type=int, default=0, help="seed of the random example inputs")
    run.add_argument("--onnx", metavar="PATH", help="also export the optimized model to ONNX (inference mode, checked)")
    run.add_argument("--save", metavar="PATH.pt2", help="also save the optimized module (graphopt.save; graphopt run loads and times it)")
    run.add_argument("--package", metavar="PATH.pt2", help="also compile it ahead of time into an AOTInductor package (inference; slow to build)")
    run.add_argument("--overwrite", action="store_true", help="with --onnx, --save or --package: replace an existing file")
    run.add_argument("--no-progress", action="store_true", help="no status line on stderr (shown on a terminal only anyway)")
    run.set_defaults(handler=_command_optimize)

    run_file = commands.add_parser("run", help="load a file graphopt optimize --save (or --package) wrote and time it on random inputs")
    run_file.add_argument("file", metavar="FILE.pt2", help="a graphopt.save file or an AOTInductor package")
    run_file.add_argument(
        "--input",
        action="append",
        metavar="SHAPE[:DTYPE]",
        help="one per input (default for graphopt files: the example's sizes); DTYPE defaults to the file's, integers are 0 or 1",
    )
    run_file.add_argument(
        "--allow-import",
        action="store_true",
        help="import the modules of the file's input and output classes (e.g. transformers.modeling_outputs); this runs "
        "their code: only for files you trust",
    )
    run_file.add_argument("--rounds", type=_positive_int, default=20, help="timed calls (default 20)")
    run_file.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    run_file.set_defaults(handler=_command_run)

    show = commands.add_parser("diff", help="optimize and show what changed in the graph (whole pipeline or one pass)")
    show.add_argument("target", metavar="MODULE:FACTORY", help="e.g. graphopt.models:resnet_small")
    show.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]", help="one per forward() argument")
    show.add_argument("--pass", dest="pass_name", metavar="NAME", help="the diff of this pass only")
    show.add_argument("--mode", choices=("inference", "training"), default="inference")
    show.add_argument("--memory-format", choices=MEMORY_FORMATS, default="auto")
    show.add_argument("--precision", choices=PRECISIONS, default="fp32")
    show.add_argument("--html", metavar="PATH", help="also write a self-contained HTML diff: the drawn graph, op counts, side by side")
    show.add_argument("--drawing", metavar="PATH", help="also write the drawn graph alone: .svg, .html, or .png (needs Chromium)")
    show.add_argument("--fold", choices=FOLDS, default="auto", help="what the drawing (--html, --drawing) folds: unchanged modules and, "
                      "on large graphs, modules at the deepest level that fits (auto), unchanged modules only, or nothing")
    show.add_argument("--expand", action="append", metavar="MODULE", help="keep this module open in the drawing (repeatable)")
    show.add_argument("--seed", type=int, default=0, help="seed of the random example inputs")
    show.add_argument("--no-progress", action="store_true", help="no status line on stderr (shown on a terminal only anyway)")
    show.set_defaults(handler=_command_diff)

    lint = commands.add_parser("lint", help="check training scripts against the performance playbook")
    lint.add_argument("paths", nargs="+", metavar="PATH", help="Python files or folders")
    lint.add_argument("--fix", action="store_true", help="apply the safe fixes in place")
    lint.add_argument("--format", choices=("text", "json"), default="text")
    lint.add_argument("--select", metavar="CODES", help="only these rule codes, e.g. GO101,GO301")
    lint.set_defaults(handler=_command_lint)

    export = commands.add_parser("export", help="optimize for inference, export to ONNX and check it with onnxruntime")
    export.add_argument("target", metavar="MODULE:FACTORY", help="e.g. graphopt.models:resnet_small")
    export.add_argument("output", metavar="OUT.onnx")
    export.add_argument("--input", action="append", required=True, metavar="SHAPE[:DTYPE]", help="one per forward() argument")
    export.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    export.add_argument("--dynamic-shapes", choices=DYNAMIC_CHOICES, default=DEFAULT, help=DYNAMIC_HELP)
    export.add_argument("--precision", choices=("fp32", "fp16"), default="fp32", help="fp16: fp16 weights, fp32 inputs and outputs")
    export.add_argument("--no-optimize", action="store_true", help="export the model as it is")
    export.add_argument("--overwrite", action="store_true", help="replace an existing file")
    export.add_argument("--seed", type=int, default=0, help="seed of the random example inputs")
    export.add_argument("--no-progress", action="store_true", help="no status line on stderr (shown on a terminal only anyway)")
    export.set_defaults(handler=_command_export)

    demo = commands.add_parser("demo", help="optimize a built-in model and compare its latency with eager")
    demo.add_argument("--model", choices=sorted(REFERENCE_MODELS), default="resnet")
    demo.add_argument("--batch", type=_positive_int, default=None, help="batch size (default: the model's example batch)")
    demo.set_defaults(handler=_command_demo)

    bench = commands.add_parser("bench", help="time eager PyTorch, graphopt and its peers side by side; write JSON, markdown and a plot")
    bench.add_argument(
        "--models", metavar="SELECTION", help="reference (default), anchors, model names or MODULE:FACTORY, comma-separated"
    )
    bench.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]", help="inputs of MODULE:FACTORY models (default BATCHx3x224x224)")
    bench.add_argument("--batch", type=_positive_int, help="batch size of the named models (default 8; --quick: 2)")
    bench.add_argument("--device", help="auto (default: cuda when available), cpu, cuda or cuda:N")
    bench.add_argument("--variants", metavar="PATTERNS", help="only these variant keys, shell-style, e.g. 'eager*,graphopt*' (see --list-variants)")
    bench.add_argument("--exclude", metavar="PATTERNS", help="leave out these variant keys, e.g. 'compile*'")
    bench.add_argument("--list-variants", action="store_true", help="list the variants and exit")
    bench.add_argument("--rounds", type=_positive_int, help="interleaved timing rounds (default 20; --quick: 2)")
    bench.add_argument("--warmup", type=int, help="warm-up calls per variant after the first (default 3; --quick: 1)")
    bench.add_argument("--low-precision", choices=("bf16", "fp16"), help="dtype of the autocast/low-precision variants (default: bf16 where supported)")
    bench.add_argument("--time-budget", type=float, metavar="MINUTES", help="start no variant after this many minutes (the rest is listed as skipped)")
    bench.add_argument("--output-dir", default="bench-results", metavar="DIR", help="where bench.json, bench.md and bench.png go")
    bench.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run for CI, well under a minute: the smallest model (unless --models), batch 2, 2 rounds, the variants "
        f"{','.join(QUICK_VARIANTS)} (unless --variants); figures mean nothing",
    )
    bench.set_defaults(handler=_command_bench)

    passes = commands.add_parser("passes", help="list the available passes: modes, where each runs by default or how to ask for it")
    passes.set_defaults(handler=_command_passes)

    engines = commands.add_parser("engines", help="list the engines an optimized graph can run on (--engine), their precisions and whether each is installed")
    engines.set_defaults(handler=_command_engines)
    return parser


# `name=value` in a library message: True/False/None, a quoted string, a list, a dict (one level of nesting: a
# torch.export spec), a number, or nothing (`passes=`)
_PYTHON_OPTION = re.compile(
    r"\b([a-z_]+)=(True|False|None|'[^']*'|\[[^\]]*\]|\{(?:[^{}]|\{[^{}]*\})*\}|[0-9][0-9.e+-]*|(?=[\s.,;:)]|$))"
)
_CALL = re.compile(r"(?:graphopt\.)?optimize\(\.\.\., ([^()]*)\)")  # "graphopt.optimize(..., mode='training')"


def cli_words(message: str, command: argparse.ArgumentParser) -> str:
    """``message`` with the library's option spellings (``overwrite=True``) in ``command``'s (``--overwrite``)."""
    flags = {action.dest: action.option_strings[-1] for action in command._actions if action.option_strings}
    choices = {action.dest: [str(choice) for choice in action.choices] for action in command._actions if action.option_strings and action.choices}
    special = {("verify", "'strict'"): "--strict-verify", ("verify", "False"): "--no-verify"}

    def flag(match: re.Match[str]) -> str:
        name, value = match.groups()
        if (name, value) in special and special[(name, value)] in flags.values():
            return special[(name, value)]
        if name not in flags:
            return match.group(0)
        if value in ("True", ""):
            return flags[name]
        if value.startswith("["):
            value = ",".join(re.findall(r"'([^']*)'", value))
        value = value.strip(chr(39))
        if name in choices:  # the command's own spelling of the value (None -> none), or every value it takes
            spelled = [choice for choice in choices[name] if choice.lower() == value.lower()]
            value = spelled[0] if spelled else "{" + ",".join(choices[name]) + "}"
        return f"{flags[name]} {value}"

    return _PYTHON_OPTION.sub(flag, _CALL.sub(lambda call: call.group(1), message))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except GraphoptError as error:
        commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        print(f"graphopt: error: {cli_words(str(error), commands.choices[args.command])}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

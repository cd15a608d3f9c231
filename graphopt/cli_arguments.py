"""Reading the ``graphopt`` command's arguments: --input shapes into tensors, MODULE:FACTORY into a model,
--calibration sources into batches, and the options optimize shares across commands.

Every argument graphopt cannot use raises `UsageError`, whose message names the option and what to give instead.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import os
import pickle
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from graphopt.dynamic import POLICIES
from graphopt.errors import GraphoptError
from graphopt.precision import INT8

DTYPES = {
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
    dtype = DTYPES.get(dtype_name or "float32")
    try:
        shape = [int(size) for size in shape_text.lower().split("x")]
    except ValueError:
        shape = []
    if dtype is None or not shape or any(size <= 0 for size in shape):
        raise UsageError(
            f"--input {spec!r} is not SHAPE[:DTYPE]: write sizes joined by 'x', e.g. 8x3x224x224 or 8x128:int64 "
            f"(dtypes: {', '.join(DTYPES)})"
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


def torchvision_hint() -> str:
    """How to install the torchvision that matches this torch: PyPI's build is CUDA's, and pulls a CUDA torch over a CPU one
    (or, beside it, fails to load its operators)."""
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    version = f"0.{minor + 15}" if major == 2 else "the release matching torch"  # torchvision 0.(N+15) goes with torch 2.N
    index = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    return (
        f"torchvision must match torch {torch.__version__}: pip install 'torchvision=={version}.*' --index-url "
        f"https://download.pytorch.org/whl/{index} (or `make torchvision`); graphopt.models.anchors has ResNet-50, MobileNetV2, "
        "EfficientNet-B0, ConvNeXt-Tiny and ViT-B/16 with torchvision's layers, without it"
    )


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
        hint = torchvision_hint() if module_name.split(".")[0] == "torchvision" else "is it on PYTHONPATH?"
        raise UsageError(f"cannot import {module_name!r} ({type(error).__name__}: {error}); {hint}") from error
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


def split_names(text: str | None) -> list[str] | None:
    """A comma-separated option (``A,B``) as its names; None where the option was not given."""
    return None if text is None else [name.strip() for name in text.split(",") if name.strip()]


def model_and_inputs(args: argparse.Namespace) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
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
        return [_checked_batch(saved_tensors(file, "--calibration"), str(file)) for file in files]
    if path.suffix == ".pt":
        if not path.is_file():
            raise UsageError(f"--calibration {source}: no such file; give {CALIBRATION_SOURCES}")
        saved = saved_tensors(path, "--calibration")
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


def saved_tensors(file: Path, option: str) -> Any:
    """What torch.save wrote to ``file`` (given with ``option``), read as tensors and containers only, on the CPU."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # weights_only met an object it would have to run code to rebuild
        raise UsageError(
            f"{option}: {file} holds objects other than tensors, which graphopt does not load (loading them could run "
            "code from the file): save tensors, or tuples/lists/dicts of tensors (numpy arrays: torch.from_numpy first)"
        ) from error
    except Exception as error:  # not a torch.save file at all
        raise UsageError(f"{option}: cannot read {file} as a torch.save file ({type(error).__name__}: {error})") from error


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


def calibration_of(args: argparse.Namespace) -> list[Any] | None:
    """The batches of --calibration, or None; --precision int8 requires it."""
    if args.calibration is not None:
        return load_calibration(args.calibration)
    if args.precision == INT8:
        raise UsageError(f"--precision int8 needs --calibration SOURCE, the batches each layer's input range is measured on: {CALIBRATION_SOURCES}")
    return None


DYNAMIC_CHOICES = (*POLICIES, "none")
DYNAMIC_HELP = "input sizes calls may vary: batch+sequence (default), batch, auto (every dimension the model allows), none"


def dynamic_shapes_of(args: argparse.Namespace) -> str | None:
    """--dynamic-shapes as optimize's dynamic_shapes ("none": None)."""
    return None if args.dynamic_shapes == "none" else args.dynamic_shapes


def progress_of(args: argparse.Namespace) -> bool | None:
    """--no-progress as optimize's progress (None: a status line on a terminal only)."""
    return False if args.no_progress else None


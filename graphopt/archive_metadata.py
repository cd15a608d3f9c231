"""graphopt.json, the metadata `graphopt.save` writes into its archive beside torch.export's program: what each key
holds (`Metadata`, the one declaration `graphopt.saving` writes by and `read` checks files against), and reading it.

`graphopt.load` uses nothing of the metadata before `read` has checked it: graphopt's format and its version first
(another version may hold other keys), then every key `Metadata` declares, no other key, and each value's type, nested
types included (a list of strings, the engine's entry and each of its keys). A file that differs raises `LoadError`
naming the key and what graphopt.save writes there, never an exception from deep inside `load`. The report and the
input signature are formats of their own (`Report.to_dict`, `InputSignature.to_dict`): `rebuilt` reads them back,
a failure named the same way. A change to what graphopt.save writes changes `Metadata` and `FORMAT_VERSION` together.
"""

from __future__ import annotations

import json
import types
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any, TypedDict, Union, get_args, get_origin, get_type_hints, is_typeddict

from graphopt.errors import LoadError, error_summary
from graphopt.inputs import InputSignature
from graphopt.report import Report

try:
    GRAPHOPT_VERSION = package_metadata.version("graphopt")
except package_metadata.PackageNotFoundError:  # run from a source tree that was not installed
    GRAPHOPT_VERSION = "unknown"
FORMAT = "graphopt.save"
FORMAT_VERSION = 4  # 2: the generation key (a language model's generate()); 3: its programs after graphopt's passes; 4: its decode compiled at load
METADATA_FILE = "graphopt.json"


class EngineEntry(TypedDict):
    """A module that runs on an engine other than PyTorch: what its `EngineInfo.load` needs."""

    name: str  # the engine's name in graphopt.backends.ENGINES
    settings: dict[str, Any]  # what its EngineRunner.save returned (the engine's own format: its loader reads it)
    files: dict[str, str]  # each file the engine wrote into the archive's engine folder: its SHA-256, in hex


class StepFiles(TypedDict):
    """A generation step's runner on an engine other than PyTorch: what its `EngineInfo.load_program` needs."""

    settings: dict[str, Any]  # what its EngineRunner.save returned
    files: dict[str, str]  # each file it wrote into the step's folder of the archive: its SHA-256, in hex


class GenerationEntry(TypedDict):
    """A causal language model's ``generate()`` (`graphopt.generation`): what rebuilds its `Generator`. The engine, its
    precision and the position limit are the report's (``report.generation``)."""

    programs: dict[str, str]  # the prefill's and decode's torch.export archives inside the archive: each one's SHA-256, in hex
    generation_config: dict[str, Any]  # the model's transformers GenerationConfig.to_dict(): what a call leaves out
    engine: dict[str, StepFiles] | None  # by step (prefill, decode); None: the steps run on PyTorch (torch.export's modules)


class Metadata(TypedDict):
    """Every key of graphopt.json and the type of its value."""

    format: str  # FORMAT
    format_version: int  # FORMAT_VERSION
    graphopt_version: str
    torch_version: str
    report: dict[str, Any]  # Report.to_dict()
    signature: dict[str, Any]  # InputSignature.to_dict(): the calls the module accepts
    original_keys: list[str]  # the original model's state_dict keys, in its order
    container_modules: list[str]  # the modules defining the inputs' and outputs' container classes, imported before reading
    inference_mode: bool  # OptimizedModule.inference_mode
    engine: EngineEntry | None  # None: the module runs on graphopt's own PyTorch runtime
    generation: GenerationEntry | None  # None: the module has no generate()


# how a message names a value's kind: JSON's names, by the Python types json.loads gives
JSON_KINDS = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number", bool: "true or false", type(None): "null"}


def _kind(expected: Any) -> type:
    """The Python type json.loads gives for a value of type ``expected`` (not looking inside it)."""
    return dict if is_typeddict(expected) else get_origin(expected) or expected


def _described(expected: Any) -> str:
    if get_origin(expected) in (Union, types.UnionType):
        return " or ".join(map(_described, get_args(expected)))
    if is_typeddict(expected):
        return f"an object with the keys {', '.join(get_type_hints(expected))}"
    return JSON_KINDS[_kind(expected)]


def _within(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _mismatch(value: Any, expected: Any, where: str = "") -> str | None:
    """How ``value`` (read from JSON at key path ``where``) is not of type ``expected``; None where it is."""
    if expected is Any:
        return None
    if get_origin(expected) in (Union, types.UnionType):
        matching = [option for option in get_args(expected) if type(value) is _kind(option)]
        expected = matching[0] if matching else expected
    if type(value) is not _kind(expected):  # `is`: true is no integer here
        return f"the key {where} is {JSON_KINDS[type(value)]}, where graphopt.save writes {_described(expected)}"
    if is_typeddict(expected):
        declared = get_type_hints(expected)
        missing = [key for key in declared if key not in value]
        unknown = [key for key in value if key not in declared]
        if missing:
            return f"the key {_within(where, missing[0])} is missing"
        if unknown:  # quoted shortened: the file does not get to write the message
            return f"the key {_within(where, unknown[0][:40])!r} is not one graphopt.save writes"
        items = [(_within(where, key), value[key], declared[key]) for key in declared]
    elif _kind(expected) is list:
        items = [(f"{where}[{index}]", item, get_args(expected)[0]) for index, item in enumerate(value)]
    elif _kind(expected) is dict:
        items = [(f"{where}[{key[:40]!r}]", item, get_args(expected)[1]) for key, item in value.items()]
    else:
        return None
    return next(filter(None, (_mismatch(item, hint, path) for path, item, hint in items)), None)


def _refused(source: Path, problem: str) -> LoadError:
    return LoadError(
        f"{source}: in its {METADATA_FILE}, {problem}: it was changed since graphopt.save wrote it, or written by another graphopt. Save the module again."
    )


def read(source: Path, text: bytes) -> Metadata:
    """The metadata of the file at ``source`` from the text of its graphopt.json, checked against `Metadata`.

    Raises `LoadError` for a file that is not graphopt's, of another format version, or whose metadata lacks a key, has
    a key graphopt.save does not write, or a value of another type; `json.JSONDecodeError` for text that is not JSON.
    """
    metadata: Any = json.loads(text)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise LoadError(f"{source} was not written by graphopt.save: its {METADATA_FILE} is not graphopt's")
    version = metadata.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise LoadError(
            f"{source} is in graphopt's file format version {version} (written by graphopt {metadata.get('graphopt_version')}); this graphopt "
            f"({GRAPHOPT_VERSION}) reads version {FORMAT_VERSION}. Load it with the graphopt that wrote it, or optimize and save the model again with this one."
        )
    problem = _mismatch(metadata, Metadata)
    if problem is not None:
        raise _refused(source, problem)
    return metadata


def rebuilt(source: Path, metadata: Metadata) -> tuple[Report, InputSignature]:
    """The report and the input signature of the checked ``metadata``, each rebuilt by its own ``from_dict``."""
    try:
        report = Report.from_dict(metadata["report"])
    except Exception as error:
        raise _refused(source, f"the key report holds no report graphopt.save writes ({error_summary(error)})") from error
    try:
        return report, InputSignature.from_dict(metadata["signature"], fixed_values=True)  # the exported graph fixed non-tensor inputs
    except Exception as error:
        raise _refused(source, f"the key signature holds no input signature graphopt.save writes ({error_summary(error)})") from error

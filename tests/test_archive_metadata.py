"""graphopt.json, the metadata of a saved archive (graphopt.archive_metadata), and the engine files it lists.

Every file below is a saved one changed by hand, its zip checksums recomputed (so only graphopt's own checks can tell):
`graphopt.load` raises `LoadError` naming the key and what graphopt.save writes there, never another exception. And the
declaration is what graphopt.save writes, for every kind of module it saves.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import archive_metadata
from graphopt.archive_metadata import EngineEntry, Metadata
from graphopt.backends import ENGINES
from graphopt.errors import LoadError
from tests.test_load_safety import edited, json_edit

AGAIN = "Save the module again."
FILE_ENGINES = [pytest.param(name, marks=pytest.mark.skipif(bool(ENGINES[name].missing()), reason=f"{name} is not installed")) for name in ("onnxruntime", "openvino")]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def example() -> torch.Tensor:
    return torch.randn(2, 4)


def metadata_of(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read(next(name for name in archive.namelist() if name.endswith("/extra/graphopt.json"))))


def metadata_edit(change: Callable[[dict[str, Any]], None]) -> dict[str, Callable[[bytes], bytes]]:
    return json_edit("extra/graphopt.json", change)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return graphopt.save(graphopt.optimize(mlp(), example()), tmp_path_factory.mktemp("plain") / "mlp.pt2")


@pytest.fixture(scope="module")
def on_onnxruntime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if ENGINES["onnxruntime"].missing():
        pytest.skip("onnxruntime is not installed")
    return graphopt.save(graphopt.optimize(mlp(), example(), engine="onnxruntime"), tmp_path_factory.mktemp("engine") / "mlp.pt2")


KINDS = {
    "plain": {},
    "bf16": {"precision": "bf16"},  # with the fp32 weights beside
    "onnxruntime": {"engine": "onnxruntime"},
    "onnxruntime int8": {"engine": "onnxruntime", "precision": "int8", "calibration": [torch.randn(4, 4) for _ in range(2)], "accuracy": 0.5},
    "openvino": {"engine": "openvino"},
}


@pytest.mark.parametrize("options", KINDS.values(), ids=KINDS)
def test_every_kind_of_saved_module_writes_exactly_the_declared_metadata(options: dict[str, Any], tmp_path: Path) -> None:
    """`Metadata` is what graphopt.save writes: each key, no other, of its type. (Training modules are not saved.)"""
    if "engine" in options and ENGINES[options["engine"]].missing():
        pytest.skip(f"{options['engine']} is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an int8 that falls back to float32 says so; saved all the same
        fast = graphopt.optimize(mlp(), example(), **options)
    path = graphopt.save(fast, tmp_path / "model.pt2")
    written = metadata_of(path)
    assert list(written) == list(get_type_hints(Metadata))
    assert archive_metadata.read(path, json.dumps(written).encode()) == written  # raises LoadError where a type differs
    if "engine" in options:
        assert list(written["engine"]) == list(get_type_hints(EngineEntry)) and written["engine"]["files"]
    else:
        assert written["engine"] is None
    assert written["generation"] is None  # a language model's: tests/test_generation_saving.py


def assert_refused(path: Path, *expected: str) -> None:
    """Loading ``path`` raises `LoadError` (no other exception) saying each of ``expected``."""
    try:
        graphopt.load(path)
        raised: Exception | None = None
    except Exception as error:
        raised = error
    assert type(raised) is LoadError, repr(raised)
    assert all(text in str(raised) for text in expected), str(raised)


# a key's own message where graphopt's format and version are checked first (a file of another version has other keys)
REMOVED = {key: [f"in its graphopt.json, the key {key} is missing", AGAIN] for key in get_type_hints(Metadata)}
REMOVED["format"] = ["was not written by graphopt.save: its graphopt.json is not graphopt's"]
REMOVED["format_version"] = ["format version None", "save the model again"]


@pytest.mark.parametrize("key", REMOVED)
def test_a_file_without_a_key_of_the_metadata_is_refused(key: str, saved: Path, tmp_path: Path) -> None:
    assert_refused(edited(saved, tmp_path / "edited.pt2", metadata_edit(lambda metadata: metadata.pop(key))), *REMOVED[key])


def wrong(key: str, value: Any, described: str) -> Any:
    return pytest.param(key, value, [f"in its graphopt.json, the key {key} is {described}, where graphopt.save writes", AGAIN], id=key)


WRONG_TYPES = [
    pytest.param("format", 1, ["its graphopt.json is not graphopt's"], id="format"),
    pytest.param("format_version", "1", ["format version 1 ", "save the model again"], id="format_version"),
    wrong("graphopt_version", 1, "an integer"),
    wrong("torch_version", None, "null"),
    wrong("report", "passes", "a string"),
    wrong("signature", [], "a list"),
    wrong("original_keys", "0.weight", "a string"),
    wrong("container_modules", "json", "a string"),
    wrong("inference_mode", 1, "an integer"),
    wrong("engine", "onnxruntime", "a string"),
    wrong("generation", ["prefill.pt2"], "a list"),
]


def test_the_cases_cover_every_key() -> None:
    assert [param.id for param in WRONG_TYPES] == list(get_type_hints(Metadata))


@pytest.mark.parametrize(("key", "value", "expected"), WRONG_TYPES)
def test_a_key_of_the_metadata_of_another_type_is_refused(key: str, value: Any, expected: list[str], saved: Path, tmp_path: Path) -> None:
    def change(metadata: dict[str, Any]) -> None:
        metadata[key] = value

    assert_refused(edited(saved, tmp_path / "edited.pt2", metadata_edit(change)), *expected)


def set_key(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """Set the value at ``path`` (keys and list indexes) of the metadata."""

    def change(metadata: dict[str, Any]) -> None:
        for part in path[:-1]:
            metadata = metadata[part]
        metadata[path[-1]] = value

    return change


NESTED = {
    "an item of original_keys": (("original_keys", 1), 3, "the key original_keys[1] is an integer, where graphopt.save writes a string"),
    "an item of container_modules": (("container_modules",), [3], "the key container_modules[0] is an integer, where graphopt.save writes a string"),
    "a key the file adds": (("extra",), True, "the key 'extra' is not one graphopt.save writes"),
    "a report of other keys": (("report",), {"mode": "inference"}, "the key report holds no report graphopt.save writes (KeyError: 'passes')"),
    "a signature of other keys": (("signature",), {"names": []}, "the key signature holds no input signature graphopt.save writes (KeyError: 'parameters')"),
}


@pytest.mark.parametrize(("path", "value", "expected"), NESTED.values(), ids=NESTED)
def test_a_value_inside_the_metadata_of_another_type_is_refused(path: tuple[str | int, ...], value: Any, expected: str, saved: Path, tmp_path: Path) -> None:
    assert_refused(edited(saved, tmp_path / "edited.pt2", metadata_edit(set_key(path, value))), f"in its graphopt.json, {expected}", AGAIN)


def without_engine_key(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda metadata: metadata["engine"].pop(key)


ENGINE_ENTRIES = {
    "a name that is a list": (set_key(("engine", "name"), ["openvino"]), "the key engine.name is a list, where graphopt.save writes a string"),
    "a name of no engine": (set_key(("engine", "name"), "tensorrt"), "names an engine this graphopt does not have ('tensorrt')"),
    "settings that are a list": (set_key(("engine", "settings"), []), "the key engine.settings is a list, where graphopt.save writes an object"),
    "files that are a list": (set_key(("engine", "files"), ["model.onnx"]), "the key engine.files is a list, where graphopt.save writes an object"),
    "a checksum that is a number": (set_key(("engine", "files", "model.onnx"), 3), "the key engine.files['model.onnx'] is an integer, where graphopt.save writes a string"),
    "no files": (without_engine_key("files"), "the key engine.files is missing"),
    "no settings": (without_engine_key("settings"), "the key engine.settings is missing"),
    "a key the file adds": (set_key(("engine", "path"), "/tmp"), "the key 'engine.path' is not one graphopt.save writes"),
    "a list": (set_key(("engine",), [{"name": "onnxruntime"}]), "the key engine is a list, where graphopt.save writes an object with the keys name, settings, files or null"),
}


@pytest.mark.parametrize(("change", "expected"), ENGINE_ENTRIES.values(), ids=ENGINE_ENTRIES)
def test_an_engine_entry_of_other_types_or_keys_is_refused(change: Callable[[dict[str, Any]], None], expected: str, on_onnxruntime: Path, tmp_path: Path) -> None:
    assert_refused(edited(on_onnxruntime, tmp_path / "edited.pt2", metadata_edit(change)), expected)


@pytest.mark.parametrize("engine", FILE_ENGINES)
def test_an_engine_file_edited_inside_the_archive_fails_its_checksum(engine: str, tmp_path: Path) -> None:
    path = graphopt.save(graphopt.optimize(mlp(), example(), engine=engine), tmp_path / "model.pt2")
    for name in metadata_of(path)["engine"]["files"]:
        changed = edited(path, tmp_path / f"edited-{name}.pt2", {f"graphopt-engine/{name}": lambda data: data[:-1] + bytes([data[-1] ^ 1])})
        assert_refused(changed, f"the engine's file {name} does not match its checksum: the file was changed. {AGAIN}")


def test_the_engine_files_in_the_archive_must_be_those_listed(on_onnxruntime: Path, tmp_path: Path) -> None:
    listed = "are not those graphopt.save listed: the file was changed. Save the module again."
    added = edited(on_onnxruntime, tmp_path / "added.pt2", {}, {"graphopt-engine/model.onnx.data": b"\0" * 16})
    assert_refused(added, "the engine's files in the archive (['model.onnx', 'model.onnx.data'])", listed)
    removed = edited(on_onnxruntime, tmp_path / "removed.pt2", {}, removed=("graphopt-engine/model.onnx",))
    assert_refused(removed, "the engine's files in the archive ([])", listed)
    unlisted = edited(on_onnxruntime, tmp_path / "unlisted.pt2", metadata_edit(lambda metadata: metadata["engine"]["files"].pop("model.onnx")))
    assert_refused(unlisted, "the engine's files in the archive (['model.onnx'])", listed)

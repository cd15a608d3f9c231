"""graphopt.load runs no code from the file, even from a file changed by hand.

torch.export.load trusts its file: it evaluates symbolic sizes with ``sympy.sympify``, compiles guards, and pastes
argument names, input keys and attribute names into the source of the module it builds. Each case below changes a
saved file so that Python hidden in one of those places writes a file PWNED (in the test's folder) when it runs, at
load or at the first call; `graphopt.load` must refuse the file before torch reads it, and nothing may run.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import load_safety, saving
from graphopt.errors import LoadError, SaveError

REFUSED = "was not written by graphopt.save, or was changed since"
TOUCH = "__import__('pathlib').Path('PWNED').touch()"


class Tagger(nn.Module):
    """Token ids and their mask in a dict, and a string option: sizes with FloorDiv and Max, guards, keys and a constant input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 2)

    def forward(self, batch: dict[str, torch.Tensor], reduce: str = "average") -> torch.Tensor:
        x = self.embed(batch["ids"]) * batch["mask"].unsqueeze(-1)
        x = torch.cat([x[:, ::2], x[:, 1::2]], dim=1)  # halves of a dynamic length: sizes s // 2 and (s + 1) // 2
        return self.head(x.mean(1) if reduce == "average" else x.sum(1))


def tokens(batch: int, length: int) -> tuple[dict[str, torch.Tensor], str]:
    return {"ids": torch.randint(0, 20, (batch, length)), "mask": torch.ones(batch, length)}, "average"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    fast = graphopt.optimize(Tagger().eval(), tokens(3, 6))
    assert fast.graphopt_report.dynamic == "batch['ids'] dims 0, 1; batch['mask'] dims 0, 1"
    return graphopt.save(fast, tmp_path_factory.mktemp("saved") / "tagger.pt2")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder the payloads write PWNED to."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "cwd"


def edited(
    source: Path, destination: Path, changes: dict[str, Callable[[bytes], bytes]], added: dict[str, bytes] | None = None, removed: tuple[str, ...] = ()
) -> Path:
    """A copy of the archive ``source``, members ``.../inner`` changed (checksums recomputed: a deliberate edit), ``added`` added,
    ``removed`` left out."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(destination, "w") as copy:
        top = archive.namelist()[0].partition("/")[0]
        for info in archive.infolist():
            inner = info.filename.partition("/")[2]
            if inner not in removed:
                copy.writestr(info, changes.get(inner, lambda data: data)(archive.read(info)))
        for inner, data in (added or {}).items():
            copy.writestr(f"{top}/{inner}", data)
    return destination


def json_edit(inner: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Callable[[bytes], bytes]]:
    """An edit of the archive's JSON member ``inner``: ``change`` changes it in place."""

    def rewrite(data: bytes) -> bytes:
        loaded = json.loads(data)
        change(loaded)
        return json.dumps(loaded).encode()

    return {inner: rewrite}


def program(change: Callable[[dict[str, Any]], None]) -> dict[str, Callable[[bytes], bytes]]:
    """An edit of the archive's program, models/model.json."""
    return json_edit("models/model.json", change)


def dicts_with(tree: Any, key: str) -> list[dict[str, Any]]:
    """The dicts of a JSON tree holding ``key``, in order."""
    if isinstance(tree, dict):
        return ([tree] if key in tree else []) + [found for value in tree.values() for found in dicts_with(value, key)]
    return [found for value in tree for found in dicts_with(value, key)] if isinstance(tree, list) else []


def assert_refused_and_nothing_ran(path: Path, folder: Path, refusal: str = REFUSED) -> None:
    """Load ``path`` and call the module: `LoadError` saying ``refusal``, and no code of the file ran (at load or at the call)."""
    try:
        graphopt.load(path)(*tokens(2, 8))
        raised: Exception | None = None
    except Exception as error:  # on a loader that lets code through, whatever the call raised after it ran
        raised = error
    assert not (folder / "PWNED").exists(), "code from the file ran"
    assert isinstance(raised, LoadError) and refusal in str(raised), raised


SIZE_PAYLOADS = {
    "import": TOUCH + " or {size}",
    "the whole expression": TOUCH,
    "attribute access": "Integer.__new__.__globals__['__builtins__']['open']('PWNED', 'w').close() or {size}",
    "lambda": f"(lambda: {TOUCH})() or {{size}}",
    "eval spelled inside a string": "Integer.__new__.__globals__['__builtins__']['ev' + 'al'](\"" + TOUCH + "\") or {size}",
    "a Symbol's assumption": f"Symbol('s0', positive=True, integer={TOUCH} or True)",
}


@pytest.mark.parametrize("payload", SIZE_PAYLOADS.values(), ids=SIZE_PAYLOADS)
def test_python_in_a_symbolic_size_is_refused_before_sympify_runs_it(payload: str, saved: Path, tmp_path: Path, folder: Path) -> None:
    def hide(model: dict[str, Any]) -> None:
        size = dicts_with(model, "expr_str")[0]
        size["expr_str"] = payload.format(size=size["expr_str"])

    assert_refused_and_nothing_ran(edited(saved, tmp_path / "edited.pt2", program(hide)), folder)


GUARD_PAYLOADS = {
    "import": TOUCH,
    "after a real guard": f"L['batch']['ids'].size()[0] >= 0 and {TOUCH}",
    "attribute access": "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'catch_warnings'][0]()._module.__builtins__['open']('PWNED', 'w')",
}


@pytest.mark.parametrize("payload", GUARD_PAYLOADS.values(), ids=GUARD_PAYLOADS)
def test_python_in_a_guard_is_refused(payload: str, saved: Path, tmp_path: Path, folder: Path) -> None:
    assert_refused_and_nothing_ran(edited(saved, tmp_path / "edited.pt2", program(lambda model: model["guards_code"].append(payload))), folder)


def forward_arg_name(model: dict[str, Any]) -> None:
    # fx writes `def forward(self, batch, NAME):` and `[batch, NAME]`: the triple quote hides the second from the first
    model["graph_module"]["module_call_graph"][0]["signature"]["forward_arg_names"][-1] = f"reduce={TOUCH} or '''):#"


def no_argument_names(model: dict[str, Any]) -> None:
    # fx would then name forward's parameters after the keys of the keyword arguments' dict in in_spec
    model["graph_module"]["module_call_graph"][0]["signature"]["forward_arg_names"] = None


def constant_input(model: dict[str, Any]) -> None:
    # torch guards a constant input with `L['reduce'] == '<value>'`
    (constant,) = [argument for argument in model["graph_module"]["graph"]["inputs"] if "as_string" in argument]
    constant["as_string"] = f"average' and {TOUCH} or '"


def input_key(model: dict[str, Any]) -> None:
    signature = model["graph_module"]["module_call_graph"][0]["signature"]
    signature["in_spec"] = signature["in_spec"].replace('\\"ids\\"', "\\\"ids'\\\"")


def range_constraint(model: dict[str, Any]) -> None:
    model["range_constraints"][TOUCH] = {"min_val": 2, "max_val": None}


def operator(model: dict[str, Any]) -> None:
    model["graph_module"]["graph"]["nodes"][0]["target"] = "torch.os.system"


OTHER_FIELDS = {
    "argument name": forward_arg_name,
    "argument names left out": no_argument_names,
    "constant input": constant_input,
    "key of the input spec": input_key,
    "range constraint": range_constraint,
    "operator": operator,
}


@pytest.mark.parametrize("change", OTHER_FIELDS.values(), ids=OTHER_FIELDS)
def test_python_in_the_programs_other_texts_is_refused(change: Callable[[dict[str, Any]], None], saved: Path, tmp_path: Path, folder: Path) -> None:
    assert_refused_and_nothing_ran(edited(saved, tmp_path / "edited.pt2", program(change)), folder)


def test_python_in_a_parameter_name_is_refused(saved: Path, tmp_path: Path, folder: Path) -> None:
    # fx writes a name that is not an identifier as getattr(self.embed, "<name>"): the quote ends the string
    name = json.dumps("embed." + 'w", exec("' + TOUCH.replace(".", "\\x2e") + '"), "').encode()

    def renamed(data: bytes) -> bytes:
        return data.replace(b'"embed.weight"', name)

    changes = {"models/model.json": renamed, "data/weights/model_weights_config.json": renamed}
    assert_refused_and_nothing_ran(edited(saved, tmp_path / "edited.pt2", changes), folder)


def test_python_in_a_key_of_the_sample_inputs_is_refused(saved: Path, tmp_path: Path, folder: Path) -> None:
    # torch's guard messages quote the inputs' paths, keys of the sample inputs included, in double quotes
    def rename(data: bytes) -> bytes:
        (batch, reduce), kwargs = torch.load(io.BytesIO(data))
        batch['a" + str(__import__("pathlib").Path("PWNED").touch()) + "'] = batch.pop("ids")
        buffer = io.BytesIO()
        torch.save(((batch, reduce), kwargs), buffer)
        return buffer.getvalue()

    assert_refused_and_nothing_ran(edited(saved, tmp_path / "edited.pt2", {"data/sample_inputs/model.pt": rename}), folder)


def hidden_in_a_size(model: dict[str, Any]) -> None:
    dicts_with(model, "expr_str")[0]["expr_str"] = TOUCH


def test_a_second_program_is_refused(saved: Path, tmp_path: Path, folder: Path) -> None:
    """torch.export.load reads every program of the archive (models/<name>.json with its inputs and weights)."""
    with zipfile.ZipFile(saved) as archive:
        read = {name.partition("/")[2]: archive.read(name) for name in archive.namelist()}
    other = {re.sub("model(?=[._])", "other", inner): data for inner, data in read.items() if re.search("model[._]", inner)}  # its weights are shared
    other["models/other.json"] = program(hidden_in_a_size)["models/model.json"](other["models/other.json"])
    assert_refused_and_nothing_ran(edited(saved, tmp_path / "edited.pt2", {}, other), folder)


def test_a_pickled_module_whose_file_was_changed_is_refused_by_torch_load(saved: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.load of a pickled OptimizedModule reads the file it holds through graphopt.load's checks."""
    fast = graphopt.optimize(Tagger().eval(), tokens(3, 6))
    changed = edited(saved, folder.parent / "edited.pt2", program(hidden_in_a_size)).read_bytes()
    buffer = io.BytesIO()
    with monkeypatch.context() as patch:
        patch.setattr(saving, "to_bytes", lambda module: changed)  # torch.save(fast) stores these bytes as its file
        torch.save(fast, buffer)
    buffer.seek(0)
    with pytest.raises(Exception) as raised:
        torch.load(buffer)  # weights_only=True: the only function it calls is graphopt's checked loader
    assert not (folder / "PWNED").exists(), "code from the file ran"
    assert raised.type is LoadError and REFUSED in str(raised.value)


class Touch:
    """Unpickled, it writes PWNED: what a pickled member of a file could do."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Path]]:
        return Path.touch, (Path("PWNED"),)


@pytest.mark.parametrize("inner", ["data/weights/model.pt", "data/constants/model.pt"])
def test_legacy_pickled_weights_and_constants_are_refused_before_torch_reads_them(inner: str, saved: Path, tmp_path: Path, folder: Path) -> None:
    """torch.export.load unpickles these legacy members (with weights_only=False where the safe loader fails)."""
    buffer = io.BytesIO()
    torch.save(Touch(), buffer)
    assert_refused_and_nothing_ran(edited(saved, tmp_path / "legacy.pt2", {}, {inner: buffer.getvalue()}), folder, f"holds pickled objects ({inner}")


def test_payload_entries_named_otherwise_than_torch_names_tensors_are_refused(saved: Path, tmp_path: Path, folder: Path) -> None:
    """torch.export.load unpickles a constant stored as opaque_obj_<n> or custom_obj_<n>; tensors are weight_<n> and tensor_<n>."""
    with zipfile.ZipFile(saved) as archive:
        weights = json.loads(archive.read(next(name for name in archive.namelist() if name.endswith("/model_weights_config.json"))))["config"]

    def opaque_constant(data: bytes) -> bytes:
        config = json.loads(data)
        config["config"]["lifted"] = {**weights["embed.weight"], "path_name": "opaque_obj_0", "is_param": False}
        return json.dumps(config).encode()

    pickled = pickle.dumps(Touch())
    pickled += b"." * (-len(pickled) % 4)  # torch reads it as float32 storage first: whole elements (pickle ignores the tail)
    changes = {"data/constants/model_constants_config.json": opaque_constant}
    path = edited(saved, tmp_path / "opaque.pt2", changes, {"data/constants/opaque_obj_0": pickled})
    assert_refused_and_nothing_ran(path, folder, "holds pickled objects (data/constants/model_constants_config.json: lifted")

    def renamed_weight(data: bytes) -> bytes:
        config = json.loads(data)
        config["config"]["embed.weight"]["path_name"] = "../constants/opaque_obj_0"
        return json.dumps(config).encode()

    path = edited(saved, tmp_path / "renamed.pt2", {"data/weights/model_weights_config.json": renamed_weight})
    assert_refused_and_nothing_ran(path, folder, "holds pickled objects (data/weights/model_weights_config.json: embed.weight")


def test_a_file_the_loader_would_refuse_is_not_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = graphopt.optimize(Tagger().eval(), tokens(3, 6))
    monkeypatch.setattr(load_safety, "_is_size", lambda node: False)  # as if torch wrote a size the grammar does not know
    with pytest.raises(SaveError, match=f"graphopt.load refuses the file torch.export.save wrote .*the symbolic size.*{REFUSED}.*Nothing was written"):
        graphopt.save(fast, tmp_path / "model.pt2")
    assert list(tmp_path.iterdir()) == []


def test_the_sizes_and_guards_torch_writes_load(saved: Path) -> None:
    """The grammar admits what torch writes: FloorDiv and Max of sizes, guards on nested inputs, keys, a constant input."""
    with zipfile.ZipFile(saved) as archive:
        model = json.loads(archive.read(next(name for name in archive.namelist() if name.endswith("/models/model.json"))))
    sizes = {found["expr_str"] for found in dicts_with(model, "expr_str")}
    assert any("FloorDiv(" in size for size in sizes) and any("Max(" in size for size in sizes), sizes
    assert any("//" in guard for guard in model["guards_code"]) and any("['batch']['ids']" in guard for guard in model["guards_code"])
    loaded = graphopt.load(saved)
    assert loaded(*tokens(2, 9)).shape == (2, 2)

"""The checks `graphopt.load` makes on a file before torch.export reads it, so that loading runs no code from the file.

- `refuse_pickles`: no entry torch.export.load would unpickle (the legacy weight formats, constants stored as pickles,
  sample inputs that torch's safe unpickler refuses);
- `refuse_code`: every text torch.export.load would run as Python (symbolic sizes, guards, operator names, attribute
  and argument names, constant inputs, pytree keys) is written as torch.export.save writes it, checked by a whitelist
  grammar (`_foreign_code` says where torch runs text, and why);
- `import_containers`: the modules defining the input and output containers (Hugging Face's ``ModelOutput``s) are
  imported only when the caller allows it, only installed ones, and only names that are dotted identifiers.

`graphopt.saving` calls them in that order, after checking the archive and its metadata (`graphopt.archive_metadata`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import keyword
import re
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from graphopt.errors import ImportNotAllowedError, LoadError, error_summary


def refuse_pickles(source: Path, archive: zipfile.ZipFile, members: dict[str, str]) -> None:
    """Raise `LoadError` if torch.export.load would unpickle anything from the file (which could run code)."""
    pickled = []
    for inner, name in members.items():
        if inner in ("data/weights/model.pt", "data/constants/model.pt"):
            pickled.append(inner)  # the legacy formats, unpickled
        elif inner.startswith(("data/weights/", "data/constants/")) and inner.endswith("_config.json"):
            # tensors are weight_<n> and tensor_<n>: torch unpickles constants named otherwise (custom_obj_, opaque_obj_)
            tensor_files = re.compile("weight_[0-9]+" if inner.startswith("data/weights/") else "tensor_[0-9]+")
            for key, entry in json.loads(archive.read(name))["config"].items():
                if entry.get("use_pickle") or not tensor_files.fullmatch(str(entry.get("path_name"))):
                    pickled.append(f"{inner}: {key}")
        elif inner.startswith("data/sample_inputs/"):
            try:  # torch.export.load unpickles sample inputs that the safe loader refuses
                torch.load(archive.open(name), weights_only=True)
            except Exception:
                pickled.append(inner)
    if pickled:
        raise LoadError(
            f"{source} holds pickled objects ({', '.join(pickled[:3])}), which graphopt.save never writes and which could run code when "
            "loaded: it was not written by graphopt.save, or was changed since. Load only files you saved."
        )


# The grammar of what torch.export.save writes where torch.export.load runs text as Python (see `_foreign_code`).
SYMBOL = re.compile(r"[a-z]+[0-9]+")  # torch's size symbols: s0, u0 (unbacked), zf0, zuf0, ...
ATTRIBUTE_PATH = re.compile(r"\w+(\.\w+)*", re.ASCII)  # a parameter's, buffer's or constant's name: layers.0.weight
NOT_DUNDER = r"(?!__)\w+"  # torch.ops.aten.__class__ is no operator
# torch.ops.aten.add.Tensor, torch.ops.aten.__and__.Tensor, torch.ops.higher_order.cond
OPERATOR = re.compile(rf"torch\.ops\.{NOT_DUNDER}\.({NOT_DUNDER}|__i?(and|or|xor|lshift|rshift)__)(\.{NOT_DUNDER})?", re.ASCII)


@functools.cache
def _symbolic_operators() -> frozenset[str]:
    """The symbolic ops torch writes as node targets (``_operator.mul``, ``torch.sym_max``); imported when a file is
    read: torch's serializer pulls in torch._dynamo, a second of `import graphopt` otherwise."""
    from torch._export.serde import serialize as torch_serialize

    return frozenset(f"{op.__module__}.{op.__name__}" for op in torch_serialize._SYM_OPS)


FLOAT_TEXT = re.compile(r"-?[0-9]+(\.[0-9]*)?(e[-+]?[0-9]+)?")
# the sympy classes sympy.srepr writes for torch's sizes, and torch's own (the deserializer's ``sympy_functions``)
SIZE_FUNCTIONS = frozenset({
    "Integer", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Equality", "Unequality", "StrictLessThan", "LessThan",
    "StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv",
    "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
})  # fmt: skip
# what torch's Python printer writes in guards: max(...), math.floor(...), math.inf
GUARD_FUNCTIONS = frozenset({"max", "min", "abs", "round", "int", "float"})
GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt"})


def _plain(text: Any) -> bool:
    """A string that stays a string literal wherever torch pastes it in quotes: no quote, backslash or control character."""
    return isinstance(text, str) and text.isprintable() and not any(character in text for character in "'\"\\")


def _parsed(text: Any) -> ast.expr | None:
    """The expression ``text`` is, if it is one line of ASCII without comments or escapes."""
    if not isinstance(text, str) or not text.isascii() or not text.isprintable() or "#" in text or "\\" in text:
        return None
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _is_size(node: ast.expr | None) -> bool:
    """A symbolic size as torch writes it, which ``sympy.sympify`` evaluates without running other Python: sympy's ``srepr``
    (``Mul(Integer(2), Symbol('s0', integer=True, positive=True))``, ``FloorDiv(...)``, ``Max(...)``) or infix arithmetic
    of integers and size symbols (``2*s0 + s1//2``)."""
    match node:
        case ast.Constant(value=value):
            return type(value) is int
        case ast.Name(id=name):
            return SYMBOL.fullmatch(name) is not None
        case ast.UnaryOp(op=ast.USub() | ast.UAdd(), operand=operand):
            return _is_size(operand)
        case ast.BinOp(op=ast.Add() | ast.Sub() | ast.Mult() | ast.FloorDiv() | ast.Mod(), left=left, right=right):
            return _is_size(left) and _is_size(right)
        case ast.Call(func=ast.Name(id="Symbol"), args=[ast.Constant(value=str(name))], keywords=assumptions):
            return SYMBOL.fullmatch(name) is not None and all(
                re.fullmatch("[a-z_]+", flag.arg or "") and isinstance(flag.value, ast.Constant) and type(flag.value.value) is bool for flag in assumptions
            )
        case ast.Call(func=ast.Name(id="Float"), args=[ast.Constant(value=str(number))], keywords=[ast.keyword(arg="precision", value=ast.Constant(value=precision))]):
            return FLOAT_TEXT.fullmatch(number) is not None and type(precision) is int
        case ast.Call(func=ast.Name(id=name), args=arguments, keywords=[]):
            return name in SIZE_FUNCTIONS and all(_is_size(argument) for argument in arguments)
    return False


def _is_guard(node: ast.expr | None) -> bool:
    """A guard as torch writes it (``L['x'].size()[0] == L['y'].size()[1]``): comparisons and arithmetic of numbers and the
    inputs' sizes, which the loaded module compiles and runs on each call."""
    match node:
        case ast.Constant(value=value):
            return type(value) in (int, float, bool) or _plain(value)
        case ast.BoolOp(values=values):
            return all(_is_guard(value) for value in values)
        case ast.UnaryOp(op=ast.Not() | ast.USub() | ast.UAdd(), operand=operand):
            return _is_guard(operand)
        case ast.BinOp(op=ast.Add() | ast.Sub() | ast.Mult() | ast.Div() | ast.FloorDiv() | ast.Mod() | ast.Pow(), left=left, right=right):
            return _is_guard(left) and _is_guard(right)
        case ast.Compare(left=left, ops=operators, comparators=right):
            return all(isinstance(op, (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in operators) and all(map(_is_guard, [left, *right]))
        case ast.Call(func=ast.Name(id=name), args=arguments, keywords=[]) if name in GUARD_FUNCTIONS:
            return all(_is_guard(argument) for argument in arguments)
        case ast.Call(func=ast.Attribute(value=ast.Name(id="math"), attr=name), args=arguments, keywords=[]) if name in GUARD_MATH:
            return all(_is_guard(argument) for argument in arguments)
        case ast.Attribute(value=ast.Name(id="math"), attr="inf" | "nan"):
            return True
    return _is_input(node)


def _is_input(node: ast.expr | None) -> bool:
    """An input or one of its sizes in a guard: ``L['x']``, ``L['batch']['ids']``, ``L['x'].size()[0]``, ``L['x'].stride()[1]``."""
    match node:
        case ast.Subscript(value=ast.Name(id="L"), slice=ast.Constant(value=key)):
            return _plain(key)
        case ast.Subscript(value=value, slice=ast.Constant(value=key)):
            return (type(key) is int or _plain(key)) and _is_input(value)
        case ast.Call(func=ast.Attribute(value=value, attr="size" | "stride" | "storage_offset"), args=[], keywords=[]):
            return _is_input(value)
    return False


def _is_constant(argument: dict[str, Any]) -> bool:
    """A constant input (``{"as_string": "mean"}``) whose value is of its kind: torch writes it into a guard."""
    [(kind, value)] = argument.items()
    kinds = {"as_int": type(value) is int, "as_float": type(value) in (int, float), "as_bool": type(value) is bool, "as_none": True}
    return _plain(value) if kind == "as_string" else kinds.get(kind, True)  # tensors and other arguments are names, checked apart


def _values_of(tree: Any, key: str) -> Iterator[Any]:
    """Every value of ``key`` in the dicts of a JSON tree, at any depth."""
    if isinstance(tree, dict):
        for name, value in tree.items():
            if name == key:
                yield value
            yield from _values_of(value, key)
    elif isinstance(tree, list):
        for value in tree:
            yield from _values_of(value, key)


def _leaves(tree: Any, keys_only: bool = False) -> Iterator[Any]:
    """The dict keys and (unless ``keys_only``) the other leaves of nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        yield from tree
        tree = tree.values()
    elif not isinstance(tree, list | tuple):
        if not keys_only:
            yield tree
        return
    for value in tree:
        yield from _leaves(value, keys_only)


def _treespec_texts(text: str) -> Iterator[Any]:
    """What a serialized pytree spec's contexts hold (dict keys, field and type names): fx pastes the inputs' keys into code."""
    _, tree = json.loads(text)
    for context in _values_of(tree, "context"):
        if context is not None:
            yield from _leaves(json.loads(context))


def _foreign_code(program: dict[str, Any], sample_inputs: Any) -> list[str]:
    """The texts of a torch.export program (``models/model.json``) and its sample inputs that torch.export.load would run as
    Python and that are not what torch.export.save writes there, each described.

    The threat: torch.export.load trusts the file it reads (torch/_export/serde/serialize.py, torch/export/_unlift.py).
    Beside the pickles `refuse_pickles` refuses, texts of the program and the sample inputs become code:

    - every symbolic size (``expr_str`` of a SymInt, SymFloat or SymBool, anywhere in the graph) goes to
      ``sympy.sympify``, which evaluates it as Python: ``__import__('os').system(...)`` runs while the file is read;
    - ``guards_code`` is compiled into the loaded module's guard function, and so are the values of constant inputs
      (``L['mode'] == 'mean'``) and the keys of the sample inputs' dicts (quoted in the guards' messages): they run at
      each call;
    - ``forward_arg_names`` (or, without them, the keys of ``in_spec``'s keyword arguments) are pasted into the source of
      the loaded module's forward, and parameter, buffer and constant names into its attribute paths
      (``getattr(self.embed, "...")``), which fx compiles;
    - a node's ``target`` may name any callable under torch, operator or math (torch's verifier refuses others, later).

    So each of them must be what torch.export.save writes there, checked by a whitelist grammar (Python's `ast` for
    expressions and guards, plain names and strings elsewhere) before torch reads the file.
    """
    module, found = program["graph_module"], []

    def check(ok: bool, what: str, value: Any) -> None:
        if not ok:
            found.append(f"{what} {str(value)[:80]!r}")

    for text in _values_of(program, "expr_str"):
        check(_is_size(_parsed(text)), "the symbolic size", text)
    for name, bounds in program.get("range_constraints", {}).items():
        check(SYMBOL.fullmatch(name) is not None and all(bounds[bound] is None or type(bounds[bound]) is int for bound in ("min_val", "max_val")), "the range of", name)
    for guard in program.get("guards_code", []):
        check(_is_guard(_parsed(guard)), "the guard", guard)
    for target in [*_values_of(module, "target"), *_values_of(module, "as_operator")]:
        check(target in _symbolic_operators() or (isinstance(target, str) and OPERATOR.fullmatch(target) is not None), "the operator", target)
    for field in ("parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name"):
        for name in _values_of(module["signature"], field):
            check(isinstance(name, str) and ATTRIBUTE_PATH.fullmatch(name) is not None, "the attribute", name)
    for argument in [*module["graph"]["inputs"], *_values_of(module["signature"], "value")]:
        check(_is_constant(argument), "the constant input", argument)
    # without forward_arg_names, fx would name forward's parameters after the keys of in_spec's keyword arguments
    check(bool(module["module_call_graph"][0]["signature"]["forward_arg_names"]), "the argument names", None)
    for signature in filter(None, (entry["signature"] for entry in module["module_call_graph"])):
        for name in signature.get("forward_arg_names") or []:
            check(isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name), "the argument name", name)
        for text in [*_treespec_texts(signature["in_spec"]), *_treespec_texts(signature["out_spec"])]:
            check(text is None or type(text) is int or _plain(text), "the input key", text)
    for key in _leaves(sample_inputs, keys_only=True):
        check(type(key) is int or _plain(key), "the sample input key", key)
    return found


def refuse_code(source: Path, archive: zipfile.ZipFile, members: dict[str, str]) -> None:
    """Raise `LoadError` if torch.export.load would run text of the file as Python that torch.export.save does not write."""
    programs = sorted(inner for inner in members if inner.startswith("models/"))
    if programs != ["models/model.json"]:  # torch.export.load reads every program of the archive; graphopt.save writes one
        found = [f"the programs {programs}"]
    else:
        sample_inputs = members.get("data/sample_inputs/model.pt")
        found = _foreign_code(
            json.loads(archive.read(members["models/model.json"])),
            torch.load(archive.open(sample_inputs), weights_only=True) if sample_inputs else (),  # found safe by refuse_pickles
        )
    if found:
        raise LoadError(
            f"{source} holds text that torch.export.load would run as Python ({'; '.join(found[:3])}), unlike anything "
            "graphopt.save writes: it was not written by graphopt.save, or was changed since. Load only files you saved."
        )


# A module name as Python writes it (transformers.modeling_outputs): never a path, never anything but names.
MODULE_NAME = re.compile(r"(?!\d)\w+(\.(?!\d)\w+)*", re.ASCII)


def _installed(name: str) -> bool:
    """Whether module ``name`` is on ``sys.path`` (Python imports its parent packages to find it, as ``import`` would)."""
    return importlib.util.find_spec(name.partition(".")[0]) is not None and importlib.util.find_spec(name) is not None


def _module_name(name: str) -> bool:
    return MODULE_NAME.fullmatch(name) is not None and not any(keyword.iskeyword(part) for part in name.split("."))


def import_containers(names: list[str], what: str, allow_import: bool, loader: str) -> None:
    """Make sure the modules defining the input and output containers of ``what`` (``container_modules``) are imported:
    torch's pytree knows a class (a Hugging Face ``ModelOutput``) once its module has run, and cannot read the file before.

    Importing a module runs its code, and the file names the module: so `load` imports only when the caller allows it,
    only after every other check of the file, only modules installed here (found on ``sys.path`` by
    ``importlib.util.find_spec``: a name, never a path), and only names that are dotted identifiers. Otherwise it raises
    `ImportNotAllowedError` saying what to import. A lazy package does not help: ``import transformers`` leaves
    ``transformers.modeling_outputs`` unimported until something of it is used.
    """
    if not all(map(_module_name, names)):
        # refused before any message quotes them as advice: a file does not get to write the command the user runs
        raise LoadError(
            f"{what} names {str(names)[:80]} as modules to import, which graphopt.save never writes: it was not written by "
            "graphopt.save, or was changed since. Load only files you saved."
        )
    missing = [name for name in names if name not in sys.modules]
    if missing and not allow_import:
        imports = " and ".join(f"`import {name}`" for name in missing)
        lazy = [f"`import {name.rpartition('.')[0]}` alone does not import {name}" for name in missing if name.rpartition(".")[0] in sys.modules]
        reason = f"{what} takes or returns classes of {', '.join(missing)}, which torch must know to read it"
        advice = f"run {imports} before {loader}" + (f" ({'; '.join(lazy)})" if lazy else "")
        if loader == "graphopt.load":
            advice += (
                ", or let graphopt.load import it: `graphopt.load(path, allow_import=True)` (command line: `graphopt run FILE "
                "--allow-import`). Importing runs that module's code: allow it for files you trust"
            )
        raise ImportNotAllowedError(f"{reason}: {advice}.", modules=missing, reason=reason)
    for name in missing:
        try:
            installed = _installed(name)
            if installed:
                importlib.import_module(name)
        except Exception as error:  # a parent package failing to import
            raise LoadError(f"importing {name}, which {what} needs, failed ({error_summary(error)}): fix that import, then load again") from error
        if not installed:
            raise LoadError(
                f"{what} takes or returns classes of {name}, which is not installed here: install the library that provides it "
                "(the one the module was saved with), then load again"
            )

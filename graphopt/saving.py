"""``graphopt.save`` / ``graphopt.load`` / ``graphopt.package``: keep an optimized module, and deploy it.

- `save` writes one ``.pt2`` file, a torch.export archive (``torch.export.save``) of the
  optimized graph with its weights, and beside them (the archive's extra files) what
  `load` needs to hand back an `OptimizedModule`: the report, the input signature (the
  calls it accepts, dynamic dimensions included), the original model's state_dict keys
  and, for low-precision weights, their fp32 values. The graph is exported from the
  optimized graph itself, at the example's sizes with the verified dimensions dynamic;
  oneDNN kernels are written in their portable form (`graphopt.runtime.portable`:
  prepacked weights as dense tensors). The file is written beside the destination,
  loaded back and compared with the module on the example's sizes and on a second size of
  each dynamic dimension, and only then moved into place.
- `load` reads it in any process that has graphopt (not the model's source): it checks
  the archive (complete, every member's checksum, graphopt's format, version and metadata
  (`graphopt.archive_metadata`: every key, no other, each of its type), no pickled entries,
  and every text torch.export.load would run as Python written as torch writes it: see
  `_foreign_code`) before torch.export reads it, so that loading runs no
  code from the file, then turns the portable calls back into oneDNN kernels, prepacked
  for this CPU. Where the inputs or outputs are classes of a library (Hugging Face's
  ``ModelOutput``s), that module must be imported first: `load` imports it only when the
  caller allows it (``allow_import=True``, see `_import_containers`).
- A module that runs on an engine other than PyTorch (``optimize(engine=...)``) is written the
  same way, with the engine's own files (OpenVINO's IR, the ONNX file) inside the archive
  under ``graphopt-engine/``, their SHA-256 checksums in graphopt's metadata; `load` checks
  them and hands them to the engine's loader (`graphopt.backends.EngineInfo.load`). Engines
  whose compiled code is specific to the machine (Inductor) write no files and compile again
  when loaded. Loading needs that engine installed; no engine runs code from its files.
- `package` compiles the graph ahead of time with AOTInductor
  (``torch._inductor.aoti_compile_and_package``) into a ``.pt2`` package that
  ``torch._inductor.aoti_load_package`` and the C++ runtime run without Python model code;
  graphopt's oneDNN ops are written as ATen for it (Inductor fuses on its own). The
  package is checked the same way before it is moved into place.

Both write inference modules only (a training run keeps checkpoints: ``state_dict()``,
``original_state_dict()``). ``fuse=`` regions are saved as their eager ops: compiled code
is specific to the machine and process (`package` is the compiled form).
"""

from __future__ import annotations

import ast
import base64
import copyreg
import functools
import hashlib
import importlib
import importlib.util
import json
import keyword
import os
import re
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

from graphopt import archive_metadata
from graphopt.archive_metadata import FORMAT, FORMAT_VERSION, GRAPHOPT_VERSION, METADATA_FILE, EngineEntry, Metadata
from graphopt.backends import ENGINES
from graphopt.capture import one_at_a_time
from graphopt.errors import ImportNotAllowedError, LoadError, SaveError, error_summary
from graphopt.inputs import InputSignature, TensorSpec, other_inputs
from graphopt.runtime import OptimizedModule, int8_modules
from graphopt.runtime.portable import ATEN_DECOMPOSITIONS, from_portable, to_portable
from graphopt.verify import compare

FP32_WEIGHTS_FILE = "graphopt-fp32-weights.json"
ENGINE_FOLDER = "graphopt-engine"  # inside the archive, beside torch.export's folders: the engine's own files
ENGINE_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a plain file name: no folders, nothing hidden


def _check_module(module: Any, what: str) -> InputSignature:
    if not isinstance(module, OptimizedModule):
        raise SaveError(f"{what} takes the module graphopt.optimize returned, not a {type(module).__name__}: optimize the model first")
    if module.graphopt_report.mode != "inference":
        raise SaveError(
            f"{what} writes inference modules; this one was optimized for training. Keep training checkpoints with "
            "module.state_dict() (or original_state_dict() for the original model's keys), and save a module optimized with mode='inference'."
        )
    if module.input_signature is None:
        raise SaveError(f"{what} needs the calls the module accepts, and this module has no input signature: optimize the model again")
    if int8_modules(module.graph_module):
        raise SaveError(
            f"{what} cannot write int8 modules yet ({', '.join(int8_modules(module.graph_module)[:3])} run oneDNN's int8 kernels, which "
            "torch.export cannot serialize): save the model optimized without precision='int8', and quantize again after loading"
        )
    return module.input_signature


def _destination(path: str | os.PathLike[str], overwrite: bool) -> Path:
    destination = Path(path)
    if destination.suffix != ".pt2":
        raise SaveError(f"{destination} does not end in .pt2: name the file you want written, e.g. model.pt2")
    if destination.exists() and not overwrite:
        raise SaveError(f"{destination} exists: pass overwrite=True to replace it, or choose another path")
    if not destination.parent.is_dir():
        raise SaveError(f"folder {destination.parent} does not exist: create it first")
    return destination


def _checked_inputs(signature: InputSignature) -> list[tuple[Any, ...]]:
    """The example's sizes, and a second size of each dynamic dimension: what a written file is compared on."""
    example = signature.example_inputs()
    if not signature.free:
        return [example]
    return [example, other_inputs(example, signature.dims(), strided=False).args]


def _export(module: OptimizedModule, signature: InputSignature) -> ExportedProgram:
    """torch.export's program of the module's graph, oneDNN kernels in portable form, the free dimensions dynamic."""
    specs = [
        {dim: Dim.AUTO for dim, size in enumerate(leaf.sizes) if size is None} or None if isinstance(leaf, TensorSpec) else None
        for leaf in signature.leaves
    ]
    dynamic_shapes = pytree.tree_unflatten(specs, signature.spec)
    try:
        program = torch.export.export(to_portable(module.graph_module), signature.example_inputs(), dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as error:
        raise SaveError(f"torch.export could not export the optimized graph ({error_summary(error)})") from error
    user_inputs = set(program.graph_signature.user_inputs)
    # placeholders only: torch names a constant input by its value ("mean"), which an op's node may also be named
    tensors = [node.meta["val"] for node in program.graph.find_nodes(op="placeholder") if node.name in user_inputs and isinstance(node.meta.get("val"), torch.Tensor)]
    fixed = [
        f"{leaf.name} dim {dim}"
        for leaf, tensor in zip([leaf for leaf in signature.leaves if isinstance(leaf, TensorSpec)], tensors, strict=True)
        for dim, size in enumerate(leaf.sizes)
        if size is None and is_concrete_int(tensor.shape[dim])  # a fixed dimension is a SymInt of a constant
    ]
    if fixed:
        raise SaveError(
            f"torch.export fixed {', '.join(fixed)} to the example's size, which the optimized module accepts other sizes of: "
            "optimize with dynamic_shapes=None (or without those dimensions) to save a module of fixed sizes"
        )
    return program


def _compare_runs(module: OptimizedModule, run: Callable[..., Any], signature: InputSignature, what: str) -> None:
    """Raise `SaveError` unless ``run`` (the written file, loaded) gives the module's outputs."""
    compute_dtype = next((t.dtype for t in module.parameters() if t.dtype in (torch.bfloat16, torch.float16)), None)
    for args in _checked_inputs(signature):
        expected = module(*args)
        comparison = compare(expected, run(*args), compute_dtype)
        if not comparison.ok:
            raise SaveError(
                f"{what} computes {comparison.where} differently from the optimized module ({comparison.detail or comparison.max_error}) on "
                f"inputs {[tuple(t.shape) for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]}. Nothing was written."
            )


def _write_beside(destination: Path, write: Callable[[Path], None], check: Callable[[Path], None]) -> None:
    """``write`` a file in a scratch folder beside ``destination``, ``check`` it, then move it into place."""
    with tempfile.TemporaryDirectory(prefix=f".{destination.name}.", dir=destination.parent) as scratch:
        staged = Path(scratch) / destination.name
        write(staged)
        check(staged)
        os.replace(staged, destination)


def _container_modules(spec: pytree.TreeSpec) -> set[str]:
    """The modules defining the containers of a pytree (e.g. transformers.modeling_outputs), beside Python's and torch's own."""
    found = set() if spec.type is None or spec.type.__module__.split(".")[0] in ("builtins", "collections", "torch") else {spec.type.__module__}
    return found.union(*(_container_modules(child) for child in spec.children()))


def _metadata(module: OptimizedModule, signature: InputSignature, program: ExportedProgram, engine: EngineEntry | None) -> Metadata:
    report = module.graphopt_report.to_dict()
    if module.graphopt_report.fusion is not None:
        report["fusion"] = None
        report["notes"].append(
            f"fuse={module.graphopt_report.fusion.backend!r} was not saved: compiled code belongs to the process that compiled it, so "
            "the loaded module runs those ops eagerly (graphopt.package compiles the whole graph ahead of time)"
        )
    try:
        signature_data = signature.to_dict()
    except TypeError as error:
        raise SaveError(f"an input that is not a tensor cannot be written to the file ({error}): only None, bools, numbers and strings can") from error
    return Metadata(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        graphopt_version=GRAPHOPT_VERSION,
        torch_version=torch.__version__,
        report=report,
        signature=signature_data,
        original_keys=list(module.original_keys),
        # classes of the inputs' and outputs' containers that must be registered with torch's pytree when the file is read
        container_modules=sorted(_container_modules(program.call_spec.in_spec) | _container_modules(program.call_spec.out_spec)),
        inference_mode=module.inference_mode,
        engine=engine,
    )


def _engine_files(module: OptimizedModule, folder: Path) -> EngineEntry | None:
    """Write the engine's own files into ``folder``: its metadata entry (name, settings, each file's SHA-256), or None
    for a module that runs on graphopt's own PyTorch runtime."""
    engine = module.graphopt_report.engine
    if engine is None:
        return None
    try:
        settings = module.runner.save(folder)
    except Exception as error:
        raise SaveError(f"engine={engine.name!r} could not write its files ({error_summary(error)}). Nothing was written.") from error
    files = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}
    if not all(path.is_file() and ENGINE_FILE_NAME.fullmatch(name) for name, path in ((name, folder / name) for name in files)):
        raise SaveError(f"engine={engine.name!r} wrote {sorted(files)}: graphopt stores plain files only. Nothing was written.")
    return EngineEntry(name=engine.name, settings=settings, files=files)


def _add_engine_files(staged: Path, folder: Path, entry: EngineEntry) -> None:
    """Append the engine's files to the archive torch.export.save wrote, under its top folder."""
    with zipfile.ZipFile(staged, "a", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        top = archive.namelist()[0].partition("/")[0]
        for name in entry["files"]:
            archive.write(folder / name, f"{top}/{ENGINE_FOLDER}/{name}")


def _engine_runner(source: Path, entry: EngineEntry, members: dict[str, str], graph_module: Any, signature: InputSignature) -> torch.nn.Module:
    """The engine's runner from the files in the archive, each checked against its SHA-256 in the metadata."""
    if entry["name"] not in ENGINES or ENGINES[entry["name"]].load is None:
        raise LoadError(f"{source} names an engine this graphopt does not have ({entry['name'][:40]!r}): load it with the graphopt that wrote it")
    info = ENGINES[entry["name"]]
    if info.missing():
        raise LoadError(f"the module in {source} runs on {info.missing()}")
    files = entry["files"]
    stored = sorted(inner.removeprefix(f"{ENGINE_FOLDER}/") for inner in members if inner.startswith(f"{ENGINE_FOLDER}/"))
    if sorted(files) != stored or not all(ENGINE_FILE_NAME.fullmatch(name) for name in stored):
        raise LoadError(f"{source}: the engine's files in the archive ({stored}) are not those graphopt.save listed: the file was changed. Save the module again.")
    with tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(source) as archive:
        folder = Path(scratch)
        for name, digest in files.items():
            data = archive.read(members[f"{ENGINE_FOLDER}/{name}"])
            if hashlib.sha256(data).hexdigest() != digest:
                raise LoadError(f"{source}: the engine's file {name} does not match its checksum: the file was changed. Save the module again.")
            (folder / name).write_bytes(data)
        try:
            return info.load(folder, entry["settings"], graph_module, signature.example_inputs())
        except Exception as error:
            raise LoadError(f"engine={info.name!r} could not load its files from {source} ({error_summary(error)})") from error


def _encode_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """Tensors as JSON: dtype, shape and the raw bytes in base64 (no pickle)."""
    return json.dumps(
        {
            name: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "data": base64.b64encode(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).decode(),
            }
            for name, t in tensors.items()
        }
    )


def _decode_tensors(text: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, entry in json.loads(text).items():
        raw = bytearray(base64.b64decode(entry["data"]))
        tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, entry["dtype"])).reshape(entry["shape"]).clone()
    return tensors


@one_at_a_time
def save(module: OptimizedModule, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``module`` (from `graphopt.optimize`, for inference) to ``path``, a ``.pt2`` file `load` reads.

    The file holds the graph, its weights, the report and the calls it accepts; loading it
    needs graphopt, not the model's code. It is written beside ``path``, loaded back and
    compared with ``module`` (at the example's sizes and a second size of each dynamic
    dimension), then moved into place: a failure leaves nothing behind. Raises `SaveError`.
    """
    signature = _check_module(module, "graphopt.save")
    destination = _destination(path, overwrite)
    program = _export(module, signature)
    engine_folder = tempfile.TemporaryDirectory(prefix=f".{destination.name}.engine.", dir=destination.parent)
    metadata = _metadata(module, signature, program, _engine_files(module, Path(engine_folder.name)))
    extra_files = {METADATA_FILE: json.dumps(metadata)}
    fp32_weights = module.fp32_weights()
    if fp32_weights:
        extra_files[FP32_WEIGHTS_FILE] = _encode_tensors(fp32_weights)
    if module.graphopt_report.fusion is not None:
        warnings.warn(
            f"graphopt.save: fuse={module.graphopt_report.fusion.backend!r} is not saved (compiled code is specific to this process): the "
            "loaded module runs those ops eagerly. graphopt.package compiles the whole graph ahead of time.",
            UserWarning,
            stacklevel=3,
        )

    def write(staged: Path) -> None:
        try:
            with warnings.catch_warnings():
                # torch's check of whether a weight covers its storage misreads channels_last weights (which do); harmless on CPU
                warnings.filterwarnings("ignore", "No complete tensor found in the group")
                torch.export.save(program, staged, extra_files=extra_files)
        except Exception as error:
            raise SaveError(f"torch.export.save could not write the program ({error_summary(error)}). Nothing was written.") from error
        if metadata["engine"] is not None:
            _add_engine_files(staged, Path(engine_folder.name), metadata["engine"])

    def check(staged: Path) -> None:
        try:
            loaded = _read(staged)
        except LoadError as error:
            raise SaveError(f"graphopt.load refuses the file torch.export.save wrote ({error}). Nothing was written: please report this with the model.") from error
        _compare_runs(module, loaded, signature, "the saved file")

    with engine_folder:
        _write_beside(destination, write, check)
    return destination


def _archive_members(source: Path) -> dict[str, str]:
    """The archive's member names by their path inside it (without the archive's top folder); checks every checksum."""
    try:
        with zipfile.ZipFile(source) as archive:
            damaged = archive.testzip()
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise LoadError(f"{source} is not a complete .pt2 archive ({error}): the file is truncated or not one graphopt.save wrote. Save the module again.") from error
    except Exception as error:  # zlib and struct errors of a damaged member
        raise LoadError(f"{source} is damaged ({type(error).__name__}: {error}): save the module again") from error
    if damaged is not None:
        raise LoadError(f"{source} is damaged: {damaged} fails its checksum. Save the module again.")
    return {name.partition("/")[2]: name for name in names}


def is_aoti_package(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an AOTInductor package (`package` writes them; `load` does not read them)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return _is_aoti(name.partition("/")[2] for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _is_aoti(inner_names: Any) -> bool:
    return any(inner.startswith("data/aotinductor/") for inner in inner_names)


def _refuse_pickles(source: Path, archive: zipfile.ZipFile, members: dict[str, str]) -> None:
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
    Beside the pickles `_refuse_pickles` refuses, texts of the program and the sample inputs become code:

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


def _refuse_code(source: Path, archive: zipfile.ZipFile, members: dict[str, str]) -> None:
    """Raise `LoadError` if torch.export.load would run text of the file as Python that torch.export.save does not write."""
    programs = sorted(inner for inner in members if inner.startswith("models/"))
    if programs != ["models/model.json"]:  # torch.export.load reads every program of the archive; graphopt.save writes one
        found = [f"the programs {programs}"]
    else:
        sample_inputs = members.get("data/sample_inputs/model.pt")
        found = _foreign_code(
            json.loads(archive.read(members["models/model.json"])),
            torch.load(archive.open(sample_inputs), weights_only=True) if sample_inputs else (),  # found safe by _refuse_pickles
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


def _import_containers(names: list[str], what: str, allow_import: bool, loader: str) -> None:
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


def _read_metadata(source: Path, what: str, allow_import: bool, loader: str) -> tuple[Metadata, dict[str, torch.Tensor], dict[str, str]]:
    if not source.is_file():
        raise LoadError(f"no file at {source}: give the path graphopt.save wrote")
    members = _archive_members(source)
    try:
        with zipfile.ZipFile(source) as archive:
            if f"extra/{METADATA_FILE}" not in members:
                hint = " (it is an AOTInductor package: run it with torch._inductor.aoti_load_package)" if _is_aoti(members) else ""
                raise LoadError(f"{source} was not written by graphopt.save{hint}: it has no {METADATA_FILE}")
            metadata = archive_metadata.read(source, archive.read(members[f"extra/{METADATA_FILE}"]))
            _refuse_pickles(source, archive, members)
            _refuse_code(source, archive, members)
            _import_containers(metadata["container_modules"], what, allow_import, loader)
            fp32_name = members.get(f"extra/{FP32_WEIGHTS_FILE}")
            fp32_weights = _decode_tensors(archive.read(fp32_name).decode()) if fp32_name else {}
    except LoadError:
        raise
    except Exception as error:  # JSON that does not parse; torch's configs or the fp32 weights of the wrong kind
        raise LoadError(f"{source} is damaged ({type(error).__name__}: {error}): save the module again") from error
    return metadata, fp32_weights, members


def _read(source: Path, allow_import: bool = False, loader: str = "graphopt.load") -> OptimizedModule:
    """The module in the file at ``source``; ``loader``: what the caller called (`load`, or torch.load through `from_bytes`)."""
    what = f"the module in {source}" if loader == "graphopt.load" else "the pickled module"  # from_bytes reads a scratch file
    metadata, fp32_weights, members = _read_metadata(source, what, allow_import, loader)
    report, signature = archive_metadata.rebuilt(source, metadata)
    try:
        program = torch.export.load(source)
        graph_module = program.module()
        from_portable(graph_module)
    except Exception as error:
        saved_with = metadata["torch_version"]
        versions = f" It was saved with torch {saved_with}; this is torch {torch.__version__}." if saved_with != torch.__version__ else ""
        raise LoadError(f"{source} could not be loaded ({error_summary(error)}).{versions}") from error
    graph_module.meta["graphopt_fp32_weights"] = fp32_weights
    report.notes.append(f"loaded from a file graphopt {metadata['graphopt_version']} wrote with torch {metadata['torch_version']}")
    runner = _engine_runner(source, metadata["engine"], members, graph_module, signature) if metadata["engine"] is not None else None
    module = OptimizedModule(graph_module, report, runner, original_keys=metadata["original_keys"], signature=signature)
    module.inference_mode = metadata["inference_mode"]
    return module


@one_at_a_time
def load(path: str | os.PathLike[str], *, allow_import: bool = False) -> OptimizedModule:
    """The `OptimizedModule` `save` wrote to ``path``, ready to run (oneDNN weights packed again for this CPU).

    Needs graphopt, not the model's code. Raises `LoadError` for a missing, truncated,
    damaged or foreign file, a file of another graphopt format version, or one holding
    pickled objects or text torch.export.load would run as Python (`_foreign_code`).
    Where the inputs or outputs are classes of a module not imported yet (Hugging Face's
    ``transformers.modeling_outputs``), raises `ImportNotAllowedError` naming it, unless
    ``allow_import``: then `load` imports it, if it is installed here. Importing runs that
    module's code: allow it for files you trust.
    """
    return _read(Path(path), allow_import)


def to_bytes(module: OptimizedModule) -> bytes:
    """``module`` as the bytes of the file `save` writes."""
    with tempfile.TemporaryDirectory() as scratch:
        return save(module, Path(scratch) / "module.pt2").read_bytes()


def from_bytes(data: bytes) -> OptimizedModule:
    """The module `to_bytes` wrote (with `load`'s checks)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "module.pt2"
        path.write_bytes(data)
        return _read(path, loader="torch.load")


def _pickled(module: OptimizedModule) -> tuple[Callable[[bytes], OptimizedModule], tuple[bytes]]:
    return from_bytes, (to_bytes(module),)


# Pickling an OptimizedModule (torch.save(module), pickle.dumps) stores `from_bytes` and the bytes of the file `save` writes.
# torch.load's safe unpickler (weights_only=True, the default) calls only functions it was told of: this one reads
# nothing but a checked archive. copy.deepcopy does not pickle (OptimizedModule.__deepcopy__).
copyreg.pickle(OptimizedModule, _pickled)
torch.serialization.add_safe_globals([from_bytes])


@one_at_a_time
def package(module: OptimizedModule, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Compile ``module`` ahead of time with AOTInductor into ``path``, a ``.pt2`` package.

    Run it with ``torch._inductor.aoti_load_package(path)`` (or AOTInductor's C++ loader):
    no Python model code, and no graphopt, is needed. The dynamic dimensions stay dynamic.
    Compiling takes a while (a C++ compiler builds code for this CPU's instruction set);
    the package is checked against ``module`` before it is moved into place. Raises `SaveError`.
    """
    signature = _check_module(module, "graphopt.package")
    destination = _destination(path, overwrite)
    program = _export(module, signature).run_decompositions(ATEN_DECOMPOSITIONS)

    def write(staged: Path) -> None:
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(staged))
        except Exception as error:
            raise SaveError(f"AOTInductor could not compile the graph ({error_summary(error)}). Nothing was written.") from error

    def check(staged: Path) -> None:
        _compare_runs(module, torch._inductor.aoti_load_package(str(staged)), signature, "the AOTInductor package")

    _write_beside(destination, write, check)
    return destination

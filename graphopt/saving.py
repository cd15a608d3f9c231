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
  `graphopt.load_safety`) before torch.export reads it, so that loading runs no
  code from the file, then turns the portable calls back into oneDNN kernels, prepacked
  for this CPU. Where the inputs or outputs are classes of a library (Hugging Face's
  ``ModelOutput``s), that module must be imported first: `load` imports it only when the
  caller allows it (``allow_import=True``, see `graphopt.load_safety.import_containers`).
- A module that runs on an engine other than PyTorch (``optimize(engine=...)``) is written the
  same way, with the engine's own files (OpenVINO's IR, the ONNX file) inside the archive
  under ``graphopt-engine/``, their SHA-256 checksums in graphopt's metadata; `load` checks
  them and hands them to the engine's loader (`graphopt.backends.EngineInfo.load`). Engines
  whose compiled code is specific to the machine (Inductor) write no files and compile again
  when loaded. Loading needs that engine installed; no engine runs code from its files.
- A causal language model's ``generate()`` is written too (`graphopt.generation_archive`): its prefill and decode
  programs, each a torch.export archive of its own under ``graphopt-generation/``, checked as the file is (checksums,
  `graphopt.load_safety`) before torch.export reads them, the model's generation_config and, on an engine other than
  PyTorch, each step's own files (OpenVINO's IR), checksummed as a graph's engine files are. `load` rebuilds generate()
  on the engine the report names; `save` compares the loaded generate()'s greedy tokens with the module's before
  moving the file into place. `package` refuses such a module: a package holds the forward alone.
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

import base64
import copyreg
import json
import os
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.export import Dim, ExportedProgram
from torch.utils import _pytree as pytree

from graphopt import archive_files, archive_metadata, generation_archive, load_safety
from graphopt.archive_metadata import FORMAT, FORMAT_VERSION, GRAPHOPT_VERSION, METADATA_FILE, EngineEntry, GenerationEntry, Metadata
from graphopt.backends import ENGINES
from graphopt.capture import one_at_a_time
from graphopt.errors import LoadError, SaveError, error_summary
from graphopt.inputs import InputSignature, TensorSpec, other_inputs
from graphopt.runtime import OptimizedModule, int8_modules
from graphopt.runtime.portable import ATEN_DECOMPOSITIONS, from_portable, to_portable
from graphopt.verify import compare

FP32_WEIGHTS_FILE = "graphopt-fp32-weights.json"
ENGINE_FOLDER = "graphopt-engine"  # inside the archive, beside torch.export's folders: the engine's own files


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


def _metadata(
    module: OptimizedModule, signature: InputSignature, program: ExportedProgram, engine: EngineEntry | None, generation: GenerationEntry | None
) -> Metadata:
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
        generation=generation,
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
    files = archive_files.checksums(folder)
    if files is None:
        raise SaveError(f"engine={engine.name!r} wrote {sorted(path.name for path in folder.iterdir())}: graphopt stores plain files only. Nothing was written.")
    return EngineEntry(name=engine.name, settings=settings, files=files)


def _engine_runner(source: Path, entry: EngineEntry, members: dict[str, str], graph_module: Any, signature: InputSignature) -> torch.nn.Module:
    """The engine's runner from the files in the archive, each checked against its SHA-256 in the metadata."""
    if entry["name"] not in ENGINES or ENGINES[entry["name"]].load is None:
        raise LoadError(f"{source} names an engine this graphopt does not have ({entry['name'][:40]!r}): load it with the graphopt that wrote it")
    info = ENGINES[entry["name"]]
    if info.missing():
        raise LoadError(f"the module in {source} runs on {info.missing()}")
    with tempfile.TemporaryDirectory() as scratch:
        archive_files.extract(source, members, ENGINE_FOLDER, entry["files"], Path(scratch), "the engine")
        try:
            return info.load(Path(scratch), entry["settings"], graph_module, signature.example_inputs())
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


def _write_checked(module: OptimizedModule, signature: InputSignature, program: ExportedProgram, destination: Path, scratch: Path) -> None:
    """`save`'s writing: the program, graphopt's metadata and the files beside it (an engine's, generate()'s programs, written
    first in folders of ``scratch``) into one archive beside ``destination``, loaded back and compared, then moved into place."""
    engine_folder = scratch / "engine"
    engine_folder.mkdir()
    generation: GenerationEntry | None = None
    generation_folders: dict[str, Path] = {}  # a folder of the archive: the folder in scratch its files are written to
    if module.generator is not None:
        generation, generation_folders = generation_archive.write(module.generator, scratch)
    metadata = _metadata(module, signature, program, _engine_files(module, engine_folder), generation)
    extra_files = {METADATA_FILE: json.dumps(metadata)}
    fp32_weights = module.fp32_weights()
    if fp32_weights:
        extra_files[FP32_WEIGHTS_FILE] = _encode_tensors(fp32_weights)

    def write(staged: Path) -> None:
        try:
            with warnings.catch_warnings():
                # torch's check of whether a weight covers its storage misreads channels_last weights (which do); harmless on CPU
                warnings.filterwarnings("ignore", "No complete tensor found in the group")
                torch.export.save(program, staged, extra_files=extra_files)
        except Exception as error:
            raise SaveError(f"torch.export.save could not write the program ({error_summary(error)}). Nothing was written.") from error
        if metadata["engine"] is not None:
            archive_files.add(staged, ENGINE_FOLDER, engine_folder, list(metadata["engine"]["files"]))
        for inner, folder in generation_folders.items():
            archive_files.add(staged, inner, folder, sorted(path.name for path in folder.iterdir()))

    def check(staged: Path) -> None:
        try:
            loaded = _read(staged, compile_decode=False)  # the file's graphs, checked as ops: compiling proves nothing of the file
        except LoadError as error:
            raise SaveError(f"graphopt.load refuses the file torch.export.save wrote ({error}). Nothing was written: please report this with the model.") from error
        _compare_runs(module, loaded, signature, "the saved file")
        if module.generator is not None:
            generation_archive.compare(module.generator, loaded.generator)

    _write_beside(destination, write, check)


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
    if module.graphopt_report.fusion is not None:
        warnings.warn(
            f"graphopt.save: fuse={module.graphopt_report.fusion.backend!r} is not saved (compiled code is specific to this process): the "
            "loaded module runs those ops eagerly. graphopt.package compiles the whole graph ahead of time.",
            UserWarning,
            stacklevel=3,
        )
    with tempfile.TemporaryDirectory(prefix=f".{destination.name}.files.", dir=destination.parent) as scratch:
        _write_checked(module, signature, program, destination, Path(scratch))
    return destination


def is_aoti_package(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an AOTInductor package (`package` writes them; `load` does not read them)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return _is_aoti(name.partition("/")[2] for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _is_aoti(inner_names: Any) -> bool:
    return any(inner.startswith("data/aotinductor/") for inner in inner_names)


def _read_metadata(source: Path, what: str, allow_import: bool, loader: str) -> tuple[Metadata, dict[str, torch.Tensor], dict[str, str]]:
    if not source.is_file():
        raise LoadError(f"no file at {source}: give the path graphopt.save wrote")
    members = archive_files.members(source)
    try:
        with zipfile.ZipFile(source) as archive:
            if f"extra/{METADATA_FILE}" not in members:
                hint = " (it is an AOTInductor package: run it with torch._inductor.aoti_load_package)" if _is_aoti(members) else ""
                raise LoadError(f"{source} was not written by graphopt.save{hint}: it has no {METADATA_FILE}")
            metadata = archive_metadata.read(source, archive.read(members[f"extra/{METADATA_FILE}"]))
            load_safety.refuse_pickles(source, archive, members)
            load_safety.refuse_code(source, archive, members)
            load_safety.import_containers(metadata["container_modules"], what, allow_import, loader)
            fp32_name = members.get(f"extra/{FP32_WEIGHTS_FILE}")
            fp32_weights = _decode_tensors(archive.read(fp32_name).decode()) if fp32_name else {}
    except LoadError:
        raise
    except Exception as error:  # JSON that does not parse; torch's configs or the fp32 weights of the wrong kind
        raise LoadError(f"{source} is damaged ({type(error).__name__}: {error}): save the module again") from error
    return metadata, fp32_weights, members


def _read(source: Path, allow_import: bool = False, loader: str = "graphopt.load", compile_decode: bool = True) -> OptimizedModule:
    """The module in the file at ``source``; ``loader``: what the caller called (`load`, or torch.load through `from_bytes`);
    ``compile_decode``: compile again a decode graph that ran compiled (off for `save`'s check of the file)."""
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
    if metadata["generation"] is not None:
        module.generator = generation_archive.read(source, metadata["generation"], members, report.generation, compile_decode)
    elif report.generation is not None:
        raise LoadError(f"{source}: its report has a generation, and its {METADATA_FILE} no generation entry: it was changed since graphopt.save wrote it. Save the module again.")
    return module


@one_at_a_time
def load(path: str | os.PathLike[str], *, allow_import: bool = False) -> OptimizedModule:
    """The `OptimizedModule` `save` wrote to ``path``, ready to run (oneDNN weights packed again for this CPU).

    Needs graphopt, not the model's code. Raises `LoadError` for a missing, truncated,
    damaged or foreign file, a file of another graphopt format version, or one holding
    pickled objects or text torch.export.load would run as Python (`graphopt.load_safety`).
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
    if module.generator is not None:
        raise SaveError(
            "graphopt.package compiles the module's forward alone, not a language model's generate() (its prefill and decode "
            "programs): graphopt.save keeps generate(), or package a module optimized with model.config.use_cache = False"
        )
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

"""A causal language model's ``generate()`` (`graphopt.generation`) in the archive `graphopt.save` writes, and back.

`write` saves the prefill and decode programs (`saved_programs`: the graphs ``generate()`` runs, torch.export's) each
as an archive of its own (``torch.export.save``: torch.export.load reads every program of one archive, and
`graphopt.load_safety` checks an archive of one), which `graphopt.saving` adds under ``graphopt-generation/`` with their
SHA-256 in graphopt.json's ``generation`` entry, beside the model's ``generation_config``. On an engine other than PyTorch, each step's runner
writes its own files too (OpenVINO's IR), under ``graphopt-generation-prefill/`` and ``graphopt-generation-decode/``,
as a graph's engine writes its own (`graphopt.saving`). The engine, its precision and the position limit are the
report's (``report.generation``).

`read` checks each program archive as `load` checks its own (the checksum, then `graphopt.load_safety`: no pickles, no
text torch would run as Python) before torch.export reads it, and rebuilds the `Generator`: torch.export's modules on the
PyTorch engine (graphopt's oneDNN kernels packed again for this CPU: `graphopt.runtime.portable.from_portable`), else
each step's runner from its files (`EngineInfo.load_program`, checksums checked first).
`compare` is `save`'s check of the written file.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from graphopt import archive_files, generation, load_safety
from graphopt.archive_metadata import GenerationEntry, StepFiles
from graphopt.backends import ENGINES, EngineInfo
from graphopt.backends.inductor_engine import compiled_step
from graphopt.errors import CompileWarning, EngineError, LoadError, SaveError, error_summary, warn_at_caller
from graphopt.report import GenerationReport
from graphopt.runtime.portable import from_portable, to_portable

FOLDER = "graphopt-generation"  # inside the archive, beside torch.export's folders: the programs
STEPS = ("prefill", "decode")  # Steps.programs' order; each step's engine files are in f"{FOLDER}-{step}"
PROGRAMS = tuple(f"{step}.pt2" for step in STEPS)
COMPARED_NEW_TOKENS = 4  # greedy tokens `compare` asks of the saved and the loaded generate()


def write(generator: generation.Generator, folder: Path) -> tuple[GenerationEntry, dict[str, Path]]:
    """Write ``generator``'s programs, and its engine's files, into folders of ``folder``: its metadata entry, and the
    folder of the archive each folder written goes to."""
    info = ENGINES[generator.report.engine]
    if not info.own_passes and info.load_program is None:
        savable = " or ".join(repr(name) for name, engine in ENGINES.items() if engine.own_passes or engine.load_program is not None)
        raise SaveError(
            f"graphopt.save keeps generate() on engine={savable} so far, not on engine={info.name!r}: optimize with one of those engines to save it, "
            "or optimize again in the process that generates. Nothing was written."
        )
    try:
        config = generator.generation_config.to_dict()
        json.dumps(config)
    except Exception as error:
        raise SaveError(f"the model's generation_config cannot be written as JSON ({error_summary(error)}): reset what it holds that is not plain data") from error
    folders = {FOLDER: folder / "programs"}
    folders[FOLDER].mkdir()
    for name, program in zip(PROGRAMS, saved_programs(generator.steps), strict=True):
        try:
            torch.export.save(program, folders[FOLDER] / name)
        except Exception as error:
            raise SaveError(f"torch.export.save could not write generate()'s {name.removesuffix('.pt2')} program ({error_summary(error)}). Nothing was written.") from error
    programs = archive_files.checksums(folders[FOLDER])
    assert programs is not None  # two plain files, written above
    engine = None
    if not ENGINES[generator.report.engine].own_passes:
        engine = {}
        for step, runner in zip(STEPS, (generator.steps.prefill, generator.steps.decode), strict=True):
            folders[f"{FOLDER}-{step}"] = folder / step
            engine[step] = _step_files(runner, folder / step, generator.report.engine)
    return GenerationEntry(programs=programs, generation_config=config, engine=engine), folders


def saved_programs(steps: generation.Steps) -> tuple[torch.export.ExportedProgram, ...]:
    """The programs of the graphs ``steps`` run: after graphopt's passes (``steps.rewritten``), each graph exported again
    with its oneDNN kernels in portable form (`graphopt.runtime.portable.to_portable`) and the dimensions dynamic as at
    capture; else the programs as they are (as captured, or as loaded)."""
    if not steps.rewritten:
        return steps.programs
    graphs = steps.graphs
    try:
        with torch.no_grad():
            return tuple(
                torch.export.export(to_portable(graph), example, dynamic_shapes=dims, strict=False)
                for graph, example, dims in zip(graphs, steps.examples, steps.dynamic_shapes, strict=True)
            )
    except Exception as error:
        raise SaveError(
            f"torch.export could not export generate()'s graphs after graphopt's passes ({error_summary(error)}). Nothing was written: "
            "optimize with passes=[] to save the graphs as captured, and please report the model."
        ) from error


def _step_files(runner: Any, folder: Path, engine: str) -> StepFiles:
    """Write a step's runner's own files into ``folder`` (made here): their metadata entry."""
    folder.mkdir()
    try:
        settings = runner.save(folder)
    except Exception as error:
        raise SaveError(f"engine={engine!r} could not write the files of generate()'s steps ({error_summary(error)}). Nothing was written.") from error
    files = archive_files.checksums(folder)
    if files is None:
        raise SaveError(f"engine={engine!r} wrote {sorted(path.name for path in folder.iterdir())}: graphopt stores plain files only. Nothing was written.")
    return StepFiles(settings=settings, files=files)


def read(source: Path, entry: GenerationEntry, members: dict[str, str], report: GenerationReport | None, compile_decode: bool = True) -> generation.Generator:
    """The `Generator` of the archive at ``source`` (``members``: its members) from its checked metadata entry and report.
    A decode graph that ran compiled (``report.decode_compiled``) is compiled again, unless ``compile_decode`` is off (`save`'s
    check of the file it wrote); where it cannot be, it runs as ops (`_compiled_again`)."""
    if report is None:
        raise _changed(source, "it has a generation entry, and its report no generation")
    if not (isinstance(report.engine, str) and isinstance(report.precision, str) and type(report.max_length) is int):
        raise _changed(source, "its report's generation holds no engine name, precision or maximum length graphopt.save writes")
    if sorted(entry["programs"]) != sorted(PROGRAMS):
        raise _changed(source, f"its generation entry lists the programs {sorted(entry['programs'])[:4]}, not {list(PROGRAMS)}")
    engine = ENGINES.get(report.engine)
    if engine is None or not engine.generates:
        raise LoadError(f"{source} generates on an engine this graphopt does not have ({report.engine[:40]!r}): load it with the graphopt that wrote it")
    if engine.missing():
        raise LoadError(f"generate() of the module in {source} runs on {engine.missing()}")
    if (entry["engine"] is None) != engine.own_passes or (entry["engine"] is not None and sorted(entry["engine"]) != sorted(STEPS)):
        raise _changed(source, f"its generation entry's engine files are not those of engine={engine.name!r}'s steps ({', '.join(STEPS)})")
    config = _generation_config(source, entry["generation_config"])
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        archive_files.extract(source, members, FOLDER, entry["programs"], folder, "generate()")
        prefill, decode = (_program(source, folder / name) for name in PROGRAMS)
        outputs = prefill.call_spec.out_spec
        if entry["engine"] is None:
            runners = [prefill.module(), decode.module()]
            for runner in runners:
                from_portable(runner)
        else:
            runners = [_step_runner(source, members, engine, step, entry["engine"][step], program, outputs, folder) for step, program in zip(STEPS, (prefill, decode))]
    steps = generation.Steps(*runners, report.max_length, (prefill, decode), outputs)
    if report.decode_compiled and compile_decode:
        steps = _compiled_again(source, steps, report)
    return generation.Generator(steps, config, report)


def _compiled_again(source: Path, steps: generation.Steps, report: GenerationReport) -> generation.Steps:
    """``steps`` with the decode graph compiled by Inductor as it was when saved (compiled code is not in the file); where
    this machine cannot compile it, the graph runs as ops, and a `CompileWarning` and the report say so."""
    try:
        runner = compiled_step(steps.programs[1], steps.decode, steps.outputs)
    except EngineError as error:
        reason = error_summary(error.__cause__ or error)
        warn_at_caller(f"{source}: generate()'s decode graph ran compiled by Inductor when saved; here it could not be compiled ({reason}) and runs as ops", CompileWarning)
        report.compiled, report.decode_compiled = f"decode graph left as ops at load: Inductor could not compile it ({reason})", False
        return steps
    return dataclasses.replace(steps, decode=runner, compiled_decode=True)


def _generation_config(source: Path, data: dict[str, Any]) -> Any:
    try:
        from transformers import GenerationConfig
    except ImportError as error:
        raise LoadError(f"generate() of the module in {source} runs transformers' generation loop: install transformers, then load again") from error
    try:
        return GenerationConfig.from_dict(data)
    except Exception as error:
        raise _changed(source, f"the key generation.generation_config holds no generation_config transformers reads ({error_summary(error)})") from error


def _step_runner(
    source: Path, members: dict[str, str], engine: EngineInfo, step: str, files: StepFiles, program: torch.export.ExportedProgram, outputs: Any, scratch: Path
) -> Any:
    """A step's runner on ``engine`` from its files in the archive (each checked against its SHA-256)."""
    folder = scratch / step
    folder.mkdir()
    archive_files.extract(source, members, f"{FOLDER}-{step}", files["files"], folder, f"generate()'s {step} step")
    assert engine.load_program is not None  # every engine with run_program has it (tests/test_generation_saving.py)
    try:
        return engine.load_program(folder, files["settings"], program, outputs)
    except Exception as error:
        raise LoadError(f"engine={engine.name!r} could not load generate()'s {step} step from {source} ({error_summary(error)})") from error


def _program(source: Path, path: Path) -> torch.export.ExportedProgram:
    """The program in the archive at ``path`` (taken out of ``source``), read once `graphopt.load_safety` finds nothing
    in it that would run code."""
    shown = Path(f"{source}/{FOLDER}/{path.name}")  # how messages name it: its place in the file the user gave
    members = archive_files.members(path, shown)
    with zipfile.ZipFile(path) as archive:
        load_safety.refuse_pickles(shown, archive, members)
        load_safety.refuse_code(shown, archive, members)
    try:
        return torch.export.load(path)
    except Exception as error:
        raise LoadError(f"{shown} could not be loaded ({error_summary(error)}): save the module again with this torch ({torch.__version__})") from error


def _changed(source: Path, problem: str) -> LoadError:
    return LoadError(f"{source}: {problem}: it was changed since graphopt.save wrote it, or written by another graphopt. Save the module again.")


def compare(saved: generation.Generator, loaded: generation.Generator) -> None:
    """Raise `SaveError` unless ``loaded`` (the written file's) generates ``saved``'s greedy tokens on a left-padded batch
    of two prompts of token 0 (a token of every vocabulary)."""
    ids = torch.zeros((2, 4), dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[0, :1] = 0
    options: dict[str, Any] = {"max_new_tokens": min(COMPARED_NEW_TOKENS, saved.steps.max_length - ids.shape[1]), "do_sample": False, "pad_token_id": 0}
    expected, actual = saved.generate(ids, mask, **options), loaded.generate(ids, mask, **options)
    if not torch.equal(expected, actual):
        raise SaveError(
            f"generate() of the saved file gives other tokens than the optimized module's ({actual[:, 4:].tolist()} instead of "
            f"{expected[:, 4:].tolist()}). Nothing was written: please report this with the model."
        )

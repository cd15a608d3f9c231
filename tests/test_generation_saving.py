"""graphopt.save / graphopt.load and ``graphopt run --generate`` of a causal language model's generate(): a fresh process
that loads the file generates the original model's tokens (greedy, and sampled from a seed), on PyTorch and on OpenVINO;
the report and the refusals come back with it; a changed file raises `LoadError`, a bad command line a message.

Tiny GPT-2 and Llama (tests.test_generation's, random weights, one layer: saving and loading do not depend on the depth,
and each layer adds to every export, conversion and compile here), each optimized and saved once for the module;
one fresh process loads every file. The GPT-2 on PyTorch has its linears on oneDNN (use_onednn_linear, told by a stub timer
that they are faster, its size threshold lowered): the file keeps graphopt's passes, and the loaded graphs run them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_type_hints

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch
import torch.nn as nn

import graphopt
from graphopt import cli, generation, generation_archive, generation_build
from graphopt.archive_metadata import GenerationEntry, StepFiles
from graphopt.backends import ENGINES
from graphopt.errors import InputMismatchError, ModeSwitchError, SaveError
from graphopt.report import GenerationReport
from tests.conftest import measured_as
from tests.test_archive_metadata import assert_refused, metadata_edit, metadata_of, set_key
from tests.test_generation import original_generate, prompt, tiny
from tests.test_load_safety import edited, json_edit

OPENVINO = pytest.mark.skipif(bool(ENGINES["openvino"].missing()), reason="openvino is not installed")
CASES = [  # each model and each engine once (the suite's time: every case is optimized, saved and loaded)
    pytest.param("gpt2-pytorch", id="gpt2-pytorch"),
    pytest.param("llama-openvino", id="llama-openvino", marks=OPENVINO),
]
SAMPLING = {"do_sample": True, "top_k": 20, "temperature": 0.8}
SEED = 5
NEW_TOKENS = 8
LAYERS = 1  # of each tiny model (see the module's docstring)
AGAIN = "Save the module again."
LINEAR_PASS = importlib.import_module("graphopt.passes.use_onednn_linear")  # the module (graphopt.passes names the function)
ONEDNN_LINEARS = ("mkldnn._linear_pointwise.default", "graphopt.linear_add.default")  # the graphs' linears on oneDNN

# Run in a fresh process: load each file named on the command line, generate, and keep what came out.
LOAD_AND_GENERATE = f"""
import sys, torch, graphopt
from graphopt.errors import GraphoptError

ids, mask = torch.load("prompt.pt")
results = {{}}
for name in sys.argv[1:]:
    module = graphopt.load(name + ".pt2", allow_import=True)
    steps = module.generator.steps
    kernels = [str(node.target) in {ONEDNN_LINEARS!r} for graph in steps.graphs if hasattr(graph, "graph") for node in graph.graph.nodes]
    greedy = module.generate(ids, mask, max_new_tokens={NEW_TOKENS})
    torch.manual_seed({SEED})
    sampled = module.generate(ids, mask, max_new_tokens={NEW_TOKENS}, **{SAMPLING!r})
    try:
        module.generate(ids, mask, max_new_tokens=500)
        refusal = "none"
    except GraphoptError as error:
        refusal = type(error).__name__ + ": " + str(error)
    results[name] = {{
        "greedy": greedy, "sampled": sampled, "refusal": refusal, "report": repr(module.graphopt_report.generation), "onednn_linears": sum(kernels),
        "compiled": type(steps.decode).__name__ if steps.compiled_decode else None,
    }}
torch.save(results, "results.pt")
"""


def the_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Another prompt than the one optimize verified on: another length, the second row left-padded."""
    return prompt(2, 5, padded=2, seed=7)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each case's original model, optimized module and file (in one folder, with the prompt beside them)."""
    folder = tmp_path_factory.mktemp("language_models")
    cases: dict[str, Any] = {"folder": folder}
    for name in [param.values[0] for param in CASES if not param.marks or not ENGINES["openvino"].missing()]:
        kind, engine = name.split("-")
        model = tiny(kind, **({"n_layer": LAYERS} if kind == "gpt2" else {"num_hidden_layers": LAYERS}))
        ids, mask = prompt(2, 6, padded=2)
        with pytest.MonkeyPatch.context() as patch:  # on PyTorch: every linear on oneDNN, measured faster by a stub
            patch.setattr(LINEAR_PASS, "MIN_WEIGHT_ELEMENTS", 1)
            patch.setattr(LINEAR_PASS, "compare_latency", lambda aten, onednn, budget_s, asks: measured_as(2.0, 1.0))
            patch.setattr(generation_build, "compare_latency", lambda ops, step, budget_s, asks: measured_as(1.0, 1.0))  # a tie: decode compiled
            fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, engine=engine)
        cases[name] = {"model": model, "module": fast, "path": graphopt.save(fast, folder / f"{name}.pt2")}
    torch.save(the_prompt(), folder / "prompt.pt")
    return cases


@pytest.fixture(scope="module")
def fresh(saved: dict[str, Any]) -> dict[str, Any]:
    """What a fresh process that loads every file generated (its PYTHONPATH kept: the graphopt under test)."""
    folder = saved["folder"]
    (folder / "load.py").write_text(LOAD_AND_GENERATE)
    names = [name for name in saved if name != "folder"]
    done = subprocess.run([sys.executable, "load.py", *names], cwd=folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "results.pt")


@pytest.mark.parametrize("name", CASES)
def test_a_fresh_process_generates_the_original_models_tokens(name: str, saved: dict[str, Any], fresh: dict[str, Any]) -> None:
    model = saved[name]["model"]
    ids, mask = the_prompt()
    assert torch.equal(fresh[name]["greedy"], original_generate(model, ids, mask, max_new_tokens=NEW_TOKENS))
    torch.manual_seed(SEED)
    assert torch.equal(fresh[name]["sampled"], original_generate(model, ids, mask, max_new_tokens=NEW_TOKENS, **SAMPLING))


@pytest.mark.parametrize("name", CASES)
def test_the_loaded_report_and_refusals_are_the_saved_modules(name: str, saved: dict[str, Any], fresh: dict[str, Any]) -> None:
    fast = saved[name]["module"]
    passes = fast.graphopt_report.generation.passes
    assert bool(passes) == (name.endswith("pytorch"))  # graphopt's passes on the PyTorch engine, kept in the file
    assert fresh[name]["report"] == repr(fast.graphopt_report.generation)
    steps = fast.generator.steps
    linears = sum(str(node.target) in ONEDNN_LINEARS for graph in steps.graphs if hasattr(graph, "graph") for node in graph.graph.nodes)
    assert fresh[name]["onednn_linears"] == linears == (0 if name.endswith("openvino") else 2 * (4 * LAYERS + 1))  # 4 per layer, and the head, per graph
    # the decode graph ran compiled by Inductor (the default): the fresh process compiled it again
    assert fresh[name]["compiled"] == ("InductorStepRunner" if name.endswith("pytorch") else None) and steps.compiled_decode == name.endswith("pytorch")
    assert fast.graphopt_report.generation.engine == name.split("-")[1]
    with pytest.raises(InputMismatchError) as refused:
        fast.generate(*the_prompt(), max_new_tokens=500)
    assert fresh[name]["refusal"] == f"InputMismatchError: {refused.value}"
    assert "beyond the model's 128" in fresh[name]["refusal"]


def test_packaging_a_module_with_generate_is_refused_saying_what_keeps_it(saved: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(SaveError, match=r"compiles the module's forward alone, not a language model's generate\(\).*graphopt.save keeps generate\(\)"):
        graphopt.package(saved["gpt2-pytorch"]["module"], tmp_path / "lm-aoti.pt2")
    assert list(tmp_path.iterdir()) == []


def test_graphs_after_passes_that_torch_export_cannot_write_are_refused_saying_what_saves(
    saved: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(graph: Any) -> None:
        raise RuntimeError("an op torch.export cannot trace")

    monkeypatch.setattr(generation_archive, "to_portable", refuse)  # the steps' graphs alone (the calls' graph exports)
    with pytest.raises(SaveError, match=r"could not export generate\(\)'s graphs after graphopt's passes \(RuntimeError: an op.*optimize with passes=\[\]"):
        graphopt.save(saved["gpt2-pytorch"]["module"], tmp_path / "lm.pt2")
    assert list(tmp_path.iterdir()) == []


@OPENVINO
def test_the_loaded_module_refuses_new_weights_and_devices_as_the_saved_one(saved: dict[str, Any]) -> None:
    loaded = graphopt.load(saved["llama-openvino"]["path"], allow_import=True)  # the one that loads without compiling
    assert loaded.graphopt_report.generation is not None and loaded.generator is not None
    with pytest.raises(ModeSwitchError, match=r"this module's generate\(\) runs graphs with their own copy of the weights"):
        loaded.load_state_dict(loaded.state_dict())
    with pytest.raises(ModeSwitchError, match=r"\.to\(meta\): this module's generate\(\)"):
        loaded.to("meta")


@pytest.mark.parametrize("name", CASES)
def test_the_metadata_holds_the_declared_generation_entry(name: str, saved: dict[str, Any]) -> None:
    entry = metadata_of(saved[name]["path"])["generation"]
    assert list(entry) == list(get_type_hints(GenerationEntry))
    assert sorted(entry["programs"]) == ["decode.pt2", "prefill.pt2"] and entry["generation_config"]["eos_token_id"] == 2
    if name.endswith("pytorch"):
        assert entry["engine"] is None
    else:  # OpenVINO's IR of each step, as a graph's engine files
        assert sorted(entry["engine"]) == ["decode", "prefill"]
        assert all(list(files) == list(get_type_hints(StepFiles)) and sorted(files["files"]) == ["model.bin", "model.xml"] for files in entry["engine"].values())


@pytest.mark.parametrize("engine", [name for name, info in ENGINES.items() if info.run_program is not None and info.load_program is None])
def test_saving_generate_on_an_engine_that_cannot_load_its_steps_is_refused_saying_which_can(engine: str, tmp_path: Path) -> None:
    report = GenerationReport(engine, "fp32", 128, 1024)
    generator = generation.Generator(None, transformers.GenerationConfig(), report)  # type: ignore[arg-type]  # refused before its steps are read
    with pytest.raises(SaveError, match=rf"keeps generate\(\) on engine='pytorch' or 'openvino' so far, not on engine='{engine}': optimize with one of those"):
        generation_archive.write(generator, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


def flipped(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def pickled_program(archive: Path, inner: str, into: Path) -> tuple[bytes, str]:
    """The program archive ``inner`` of ``archive`` with a weight stored as a pickle, and its SHA-256."""
    with zipfile.ZipFile(archive) as outer:
        (into / "program.pt2").write_bytes(outer.read(next(name for name in outer.namelist() if name.endswith("/" + inner))))

    def pickle_first(config: dict[str, Any]) -> None:
        config["config"][next(iter(config["config"]))]["use_pickle"] = True  # torch.export.load would torch.load(weights_only=False) it

    data = edited(into / "program.pt2", into / "pickled.pt2", json_edit("data/weights/model_weights_config.json", pickle_first)).read_bytes()
    return data, hashlib.sha256(data).hexdigest()


def without_report_generation(metadata: dict[str, Any]) -> None:
    metadata["report"]["generation"] = None


TAMPERED: dict[str, tuple[Callable[[Path, Path], dict[str, Any]], list[str]]] = {
    "no generation entry": (lambda path, folder: metadata_edit(set_key(("generation",), None)), ["its report has a generation, and its graphopt.json no generation entry", AGAIN]),
    "no generation in the report": (lambda path, folder: metadata_edit(without_report_generation), ["it has a generation entry, and its report no generation", AGAIN]),
    "programs that are a list": (
        lambda path, folder: metadata_edit(set_key(("generation", "programs"), ["prefill.pt2"])),
        ["the key generation.programs is a list, where graphopt.save writes an object", AGAIN],
    ),
    "an engine of no name": (
        lambda path, folder: metadata_edit(set_key(("report", "generation", "engine"), "tensorrt")),
        ["generates on an engine this graphopt does not have ('tensorrt')"],
    ),
    "a program changed": (
        lambda path, folder: {"graphopt-generation/decode.pt2": flipped},
        ["generate()'s file decode.pt2 does not match its checksum: the file was changed.", AGAIN],
    ),
}


@pytest.mark.parametrize("tamper", TAMPERED.values(), ids=TAMPERED)
def test_a_changed_generation_in_the_file_is_refused(tamper: Any, saved: dict[str, Any], tmp_path: Path) -> None:
    change, expected = tamper
    path = saved["gpt2-pytorch"]["path"]
    assert_refused(edited(path, tmp_path / "edited.pt2", change(path, tmp_path)), *expected)


def test_a_program_listed_apart_from_the_archives_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    removed = edited(saved["gpt2-pytorch"]["path"], tmp_path / "removed.pt2", {}, removed=("graphopt-generation/decode.pt2",))
    assert_refused(removed, "generate()'s files in the archive (['prefill.pt2']) are not those graphopt.save listed", AGAIN)


def test_a_program_holding_a_pickle_is_refused_though_its_checksum_was_updated(saved: dict[str, Any], tmp_path: Path) -> None:
    path = saved["gpt2-pytorch"]["path"]
    data, digest = pickled_program(path, "graphopt-generation/prefill.pt2", tmp_path)
    changes = {"graphopt-generation/prefill.pt2": lambda _: data, **metadata_edit(set_key(("generation", "programs", "prefill.pt2"), digest))}
    assert_refused(edited(path, tmp_path / "pickled.pt2", changes), "graphopt-generation/prefill.pt2 holds pickled objects", "could run code")


@OPENVINO
def test_an_engine_file_of_a_step_changed_or_missing_is_refused(saved: dict[str, Any], tmp_path: Path) -> None:
    path = saved["llama-openvino"]["path"]
    changed = edited(path, tmp_path / "changed.pt2", {"graphopt-generation-decode/model.bin": flipped})
    assert_refused(changed, "generate()'s decode step's file model.bin does not match its checksum", AGAIN)
    unlisted = edited(path, tmp_path / "unlisted.pt2", metadata_edit(set_key(("generation", "engine"), None)))
    assert_refused(unlisted, "its generation entry's engine files are not those of engine='openvino''s steps (prefill, decode)", AGAIN)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@OPENVINO
def test_graphopt_run_generates_in_a_fresh_process(saved: dict[str, Any], tmp_path: Path) -> None:
    """Sampled from --seed, the prompt a file of a tokenizer's output, the tokens printed and written with --output (on
    the file that loads without compiling: the PyTorch one's fresh load is `fresh`'s)."""
    model, path = saved["llama-openvino"]["model"], saved["llama-openvino"]["path"]
    ids, mask = the_prompt()
    torch.save({"input_ids": ids, "attention_mask": mask}, tmp_path / "prompt.pt")
    command = [sys.executable, "-m", "graphopt.cli", "run", str(path), "--generate", "--allow-import", "--prompt", "prompt.pt"]
    command += ["--max-new-tokens", "6", "--do-sample", "--seed", "3", "--output", "tokens.pt"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.manual_seed(3)
    expected = original_generate(model, ids, mask, max_new_tokens=6, do_sample=True)
    lines = done.stdout.splitlines()
    assert "graphopt language model; generate() on openvino (fp32), up to 128 positions" in lines[0]
    assert "prompt [2, 5] -> tokens [2, 11] (sampled from seed 3)" in lines[1]
    assert lines[2:4] == [",".join(map(str, sequence)) for sequence in expected.tolist()]
    assert torch.equal(torch.load(tmp_path / "tokens.pt"), expected)


@OPENVINO
def test_graphopt_run_generates_greedy_from_token_ids_given_on_the_command_line(saved: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    model, path = saved["llama-openvino"]["model"], saved["llama-openvino"]["path"]
    code, out, err = run(capsys, "run", str(path), "--generate", "--allow-import", "--prompt", "5,17,42", "--max-new-tokens", "4")
    assert code == 0, err
    expected = original_generate(model, torch.tensor([[5, 17, 42]]), torch.ones(1, 3, dtype=torch.long), max_new_tokens=4)
    assert out.splitlines()[-1] == ",".join(map(str, expected[0].tolist())) and "(greedy)" in out
    code, _, err = run(capsys, "run", str(path), "--generate", "--allow-import", "--prompt", "5,17,42", "--max-new-tokens", "126")
    assert code == 2 and "a prompt of 3 tokens plus --max-new-tokens 126 is 129 positions, beyond the model's 128" in err


REFUSED = {
    "a prompt that is not ids": (["--prompt", "5,x"], "--prompt '5,x' is not token ids: write them joined by commas"),
    "a prompt file that is missing": (["--prompt", "missing.pt"], "--prompt missing.pt: no such file"),
    "a prompt file of floats": (["--prompt", "{floats}"], "holds no token ids: save an integer tensor shaped (batch, length)"),
    "--input": (["--input", "2x6"], "--input and --rounds time the module's calls; with --generate, give the prompt's token ids with --prompt"),
}


@pytest.mark.parametrize(("arguments", "expected"), REFUSED.values(), ids=REFUSED)
def test_graphopt_run_refuses_bad_generation_arguments_with_a_message(
    arguments: list[str], expected: str, saved: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch.save(torch.rand(1, 4), tmp_path / "floats.pt")
    arguments = [argument.format(floats=tmp_path / "floats.pt") for argument in arguments]
    code, _, err = run(capsys, "run", str(saved["gpt2-pytorch"]["path"]), "--generate", *arguments)
    assert code == 2 and expected in err and "Traceback" not in err, err


def test_graphopt_run_refuses_generation_options_without_generate_and_generate_of_a_module_without_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch.manual_seed(0)
    path = graphopt.save(graphopt.optimize(nn.Sequential(nn.Linear(4, 3)).eval(), torch.randn(2, 4)), tmp_path / "linear.pt2")
    code, _, err = run(capsys, "run", str(path), "--max-new-tokens", "4", "--do-sample")
    assert code == 2 and "--max-new-tokens, --do-sample are for --generate: add --generate to generate token ids" in err
    code, _, err = run(capsys, "run", str(path), "--generate")
    assert code == 2 and "holds no generate(): it is not a causal language model optimized with its key/value cache on. Run it without --generate" in err

"""graphopt.save / load / package: round trips in a fresh process, damaged and foreign files, nothing half-written."""

from __future__ import annotations

import copy
import importlib
import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt import cli, tuning
from graphopt.errors import ImportNotAllowedError, InputMismatchError, LoadError, SaveError
from graphopt.report import Report
from graphopt.runtime.onednn import OneDNNConv, OneDNNLinear
from graphopt.verify import compare
from tests.conftest import measured_as

saving = importlib.import_module("graphopt.saving")
linear_pass = importlib.import_module("graphopt.passes.use_onednn_linear")
LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
LINEAR_ADD = torch.ops.graphopt.linear_add.default
onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


class ConvNet(nn.Module):
    """Conv + BatchNorm + ReLU, a residual block and a linear head: folding, channels_last, oneDNN convs."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.block, self.block_bn = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y = F.relu(self.bn(self.stem(x)))
        y = F.relu(self.block_bn(self.block(y)) + y)
        return self.head(y.mean((2, 3)))


class TokenEncoder(nn.Module):
    """Token ids and a padding mask, one attention layer and a feed-forward block wide enough for use_onednn_linear."""

    def __init__(self, width: int = 512, hidden: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        mask = attention_mask[:, None, None, :].bool()
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1))
        return self.norm(self.down(F.gelu(self.up(x))) + x)


def images(batch: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, 12, 12),)


def tokens(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2 :] = 0  # padding
    return torch.randint(0, 50, (batch, length)), mask


def tiny_bert() -> nn.Module:
    """A Hugging Face BERT from a config (random weights, nothing downloaded): its outputs are a transformers class."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    return BertModel(config)


def fused_linears_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """use_onednn_linear rewrites every linear it may (its timing would decide by this machine's speed)."""
    monkeypatch.setattr(linear_pass, "compare_latency", lambda aten, kernel, budget_s, asks: measured_as(2.0, 1.0))


# the default preset's prepacked kernels, kept where they measure faster: left out where a case must run ATen's convs or
# use_onednn_linear's kernels on the stored weights whatever this machine's speeds (the prepacked cases have them)
STORED_WEIGHTS = {"disable": ["use_onednn_kernels"]}

# name: (model, example, other calls, optimize options); each call differs from the example in batch (and length)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[Any, ...], list[tuple[Any, ...]], dict[str, Any]]] = {
    "conv-fx": (ConvNet, images(4), [images(1), images(7)], STORED_WEIGHTS),  # batch 1: torch.export's 0/1 specialisation must not stop it
    "conv-export": (ConvNet, images(4), [images(2), images(7)], {"frontend": "export"}),
    "conv-bf16": (ConvNet, images(4), [images(2), images(7)], {"precision": "bf16"}),
    "conv-prepacked": (ConvNet, images(4), [images(2), images(7)], {"passes": ["fold_conv_bn", "to_channels_last", "use_onednn_kernels"], "memory_format": "channels_last"}),
    "tokens-fx": (TokenEncoder, tokens(4, 16), [tokens(2, 16), tokens(5, 24)], STORED_WEIGHTS),
    "tokens-export-bf16": (TokenEncoder, tokens(4, 16), [tokens(2, 9), tokens(5, 24)], {"frontend": "export", "precision": "bf16"}),
    "tokens-prepacked": (TokenEncoder, tokens(4, 16), [tokens(2, 16), tokens(5, 24)], {"passes": ["use_onednn_kernels"]}),
    "bert": (tiny_bert, tokens(4, 16), [tokens(2, 16), tokens(5, 24)], {}),
}  # fmt: skip


KERNEL_KINDS = ("prepacked conv", "prepacked linear", "linear", "linear + add")


def kernels(module: nn.Module) -> dict[str, int]:
    """How many oneDNN kernels of each kind a module runs."""
    graph = module.graph_module.graph
    return {
        "prepacked conv": sum(isinstance(m, OneDNNConv) for m in module.modules()),
        "prepacked linear": sum(isinstance(m, OneDNNLinear) for m in module.modules()),
        "linear": sum(node.target is LINEAR_POINTWISE for node in graph.nodes),
        "linear + add": sum(node.target is LINEAR_ADD for node in graph.nodes),
    }


LOAD_IN_A_FRESH_PROCESS = """
import importlib.util, sys, torch, graphopt
from graphopt.runtime.onednn import OneDNNConv, OneDNNLinear
assert importlib.util.find_spec("tests") is None, "the test's models must not be importable here"
refused = {}
for name, load in {"load": lambda: graphopt.load("bert.pt2"), "torch.load": lambda: torch.load("bert.pickle")}.items():
    try:
        load()
    except graphopt.LoadError as error:
        refused[name] = str(error)
import transformers  # a lazy module: transformers.modeling_outputs is imported when first used
try:
    graphopt.load("bert.pt2")
except graphopt.LoadError as error:
    refused["load after import transformers"] = str(error)
import transformers.modeling_outputs  # what those errors ask for: BERT's outputs are transformers classes
calls = torch.load("calls.pt")
results = {"refused": refused}
for name, arguments in calls.items():
    module = graphopt.load(f"{name}.pt2")
    graph = module.graph_module.graph
    results[name] = {
        "outputs": [torch.utils._pytree.tree_leaves(module(*args)) for args in arguments],
        "kernels": {
            "prepacked conv": sum(isinstance(m, OneDNNConv) for m in module.modules()),
            "prepacked linear": sum(isinstance(m, OneDNNLinear) for m in module.modules()),
            "linear": sum(node.target is torch.ops.mkldnn._linear_pointwise.default for node in graph.nodes),
            "linear + add": sum(node.target is torch.ops.graphopt.linear_add.default for node in graph.nodes),
        },
        "dynamic": module.graphopt_report.dynamic,
    }
torch.save(results, "results.pt")
"""


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each case optimized and saved here, then loaded and called in a fresh process that cannot import its model."""
    folder = tmp_path_factory.mktemp("saved")
    expected: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        fused_linears_on(monkeypatch)
        for name, (build, example, calls, options) in CASES.items():
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # verification notes on random weights
                fast = graphopt.optimize(build().eval(), example, **options)
            graphopt.save(fast, folder / f"{name}.pt2")
            if name == "bert":
                torch.save(fast, folder / "bert.pickle")
            expected[name] = {"outputs": [torch.utils._pytree.tree_leaves(fast(*args)) for args in calls], "kernels": kernels(fast), "dynamic": fast.graphopt_report.dynamic, "module": fast}
    torch.save({name: calls for name, (_, _, calls, _) in CASES.items()}, folder / "calls.pt")
    (folder / "load.py").write_text(LOAD_IN_A_FRESH_PROCESS)
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "load.py"], cwd=folder, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"expected": expected, "loaded": torch.load(folder / "results.pt"), "folder": folder}


@onednn
@pytest.mark.parametrize("name", CASES)
def test_a_saved_module_computes_the_same_in_a_fresh_process(name: str, round_trips: dict[str, Any]) -> None:
    expected, loaded = round_trips["expected"][name], round_trips["loaded"][name]
    for want, got in zip(expected["outputs"], loaded["outputs"], strict=True):
        comparison = compare(want, got)
        assert comparison.ok and comparison.max_error <= 1e-6, comparison  # the same graph and kernels: float32 rounding at most
    assert loaded["kernels"] == expected["kernels"]
    assert loaded["dynamic"] == expected["dynamic"] != ""


def test_a_file_whose_outputs_are_library_classes_says_what_to_import(round_trips: dict[str, Any]) -> None:
    """In a fresh process: the exact module to import (`import transformers` is not enough), and how to let load import it."""
    classes = "takes or returns classes of transformers.modeling_outputs, which torch must know to read it: run `import transformers.modeling_outputs` before"
    allow = (
        ", or let graphopt.load import it: `graphopt.load(path, allow_import=True)` (command line: `graphopt run FILE --allow-import`). "
        "Importing runs that module's code: allow it for files you trust."
    )
    lazy = " (`import transformers` alone does not import transformers.modeling_outputs)"
    assert round_trips["loaded"]["refused"] == {
        "load": f"the module in bert.pt2 {classes} graphopt.load{allow}",
        "torch.load": f"the pickled module {classes} torch.load.",
        "load after import transformers": f"the module in bert.pt2 {classes} graphopt.load{lazy}{allow}",
    }


def test_graphopt_run_runs_a_saved_bert_in_a_fresh_process_when_allowed_to_import(round_trips: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`graphopt run --allow-import` imports transformers.modeling_outputs itself; --input shapes take the file's dtype (int64)."""
    command = [sys.executable, "-m", "graphopt.cli", "run", "bert.pt2", "--allow-import", "--input", "2x24", "--input", "2x24", "--rounds", "1"]
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=round_trips["folder"], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "inputs [[2, 24], [2, 24]] -> outputs [[2, 24, 64], [2, 64]]" in done.stdout
    # without the flag, here, where transformers.modeling_outputs is imported already: as in a fresh process
    monkeypatch.delitem(sys.modules, "transformers.modeling_outputs")
    assert cli.main(["run", str(round_trips["folder"] / "bert.pt2"), "--rounds", "1"]) == 2
    assert capsys.readouterr().err == (
        f"graphopt: error: the module in {round_trips['folder'] / 'bert.pt2'} takes or returns classes of transformers.modeling_outputs, "
        "which torch must know to read it: add --allow-import to let graphopt import transformers.modeling_outputs (it runs that "
        "module's code: allow it for files you trust)\n"
    )


@onednn
def test_the_cases_cover_each_kind_of_kernel(round_trips: dict[str, Any]) -> None:
    """The round trips above would pass vacuously if no case had the kernels the portable form must carry."""
    found = {kind: [name for name, case in round_trips["expected"].items() if case["kernels"][kind]] for kind in KERNEL_KINDS}
    assert all(found.values()), found
    assert "x dim 0" in round_trips["expected"]["conv-fx"]["dynamic"]
    assert "input_ids dims 0, 1" in round_trips["expected"]["tokens-fx"]["dynamic"]


@onednn
def test_a_loaded_module_keeps_the_report_the_signature_and_the_checkpoint_keys(round_trips: dict[str, Any]) -> None:
    fast = round_trips["expected"]["conv-bf16"]["module"]
    loaded = graphopt.load(round_trips["folder"] / "conv-bf16.pt2")
    assert loaded.graphopt_report.to_dict()["passes"] == fast.graphopt_report.to_dict()["passes"]
    assert loaded.graphopt_report.notes[-1].startswith("loaded from a file graphopt")
    assert loaded.input_signature.describe() == fast.input_signature.describe()
    assert sorted(loaded.state_dict()) == sorted(fast.state_dict())
    assert loaded.fp32_weights().keys() == fast.fp32_weights().keys() != set()
    assert all(torch.equal(loaded.fp32_weights()[key], value) for key, value in fast.fp32_weights().items())
    assert loaded.parameter_map == fast.parameter_map
    original = loaded.original_state_dict()
    assert original.keys() == fast.original_state_dict().keys()
    assert all(torch.equal(original[key], value) for key, value in fast.original_state_dict().items())
    with pytest.raises(InputMismatchError, match="has dtype float64"):
        loaded(torch.randn(2, 3, 12, 12, dtype=torch.float64))


@onednn
def test_a_loaded_module_takes_keyword_calls_and_loads_original_checkpoints(round_trips: dict[str, Any]) -> None:
    fast = round_trips["expected"]["tokens-fx"]["module"]
    loaded = graphopt.load(round_trips["folder"] / "tokens-fx.pt2")
    ids, mask = tokens(3, 11)
    assert torch.equal(loaded(attention_mask=mask, input_ids=ids), loaded(ids, mask))
    assert compare(fast(ids, mask), loaded(ids, mask)).max_error <= 1e-6
    torch.manual_seed(1)
    other = TokenEncoder().eval().state_dict()
    loaded.load_original_state_dict(other)
    fast_copy = copy.deepcopy(fast)
    fast_copy.load_original_state_dict(other)
    assert compare(fast_copy(ids, mask), loaded(ids, mask)).max_error <= 1e-6


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> graphopt.OptimizedModule:
    """`ConvNet` optimized with the default options (example: a batch of 4), once for the module: the tests and fixtures
    that take it only read it (call it, save it), each as it would its own."""
    with pytest.MonkeyPatch.context() as monkeypatch:  # an empty tuning cache, as each test has
        monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path_factory.mktemp("graphopt-cache")))
        monkeypatch.setattr(tuning, "_memory_cache", {})
        torch.manual_seed(0)
        return graphopt.optimize(ConvNet().eval(), images(4))


def test_report_and_signature_round_trip_through_json(convnet: graphopt.OptimizedModule) -> None:
    fast = convnet
    report = Report.from_dict(json.loads(fast.graphopt_report.to_json()))
    assert report.to_dict() == fast.graphopt_report.to_dict()
    assert report["fold_conv_bn"].state_changes == fast.graphopt_report["fold_conv_bn"].state_changes != []
    signature = type(fast.input_signature).from_dict(json.loads(json.dumps(fast.input_signature.to_dict())))
    assert signature.describe() == fast.input_signature.describe() == "(x: Tensor[*, 3, 12, 12] float32 on cpu)"
    assert [tuple(t.shape) for t in signature.example_inputs()] == [(4, 3, 12, 12)]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_torch_save_and_torch_load_work_for_both_frontends(frontend: str) -> None:
    fast = graphopt.optimize(ConvNet().eval(), images(4), frontend=frontend)
    buffer = io.BytesIO()
    torch.save(fast, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True, torch's default: only graphopt's checked loader runs
    x = images(3)
    assert isinstance(loaded, graphopt.OptimizedModule)
    assert compare(fast(*x), loaded(*x)).max_error == 0.0
    copied = copy.deepcopy(fast)  # copies do not go through the file
    assert copied._modules is copied.graph_module._modules and copied.graph_module is not fast.graph_module
    shallow = copy.copy(fast)
    assert shallow.graph_module is fast.graph_module and shallow._parameters is fast._parameters


def test_modules_that_cannot_be_saved_say_what_to_do(tmp_path: Path, convnet: graphopt.OptimizedModule) -> None:
    trained = graphopt.optimize(ConvNet().train(), images(4))
    with pytest.raises(SaveError, match="optimized for training.*state_dict"):
        graphopt.save(trained, tmp_path / "model.pt2")
    with pytest.raises(SaveError, match="optimized for training"):
        torch.save(trained, io.BytesIO())
    with pytest.raises(SaveError, match="takes the module graphopt.optimize returned, not a Linear"):
        graphopt.save(nn.Linear(2, 2), tmp_path / "model.pt2")
    fast = convnet
    with pytest.raises(SaveError, match="does not end in .pt2"):
        graphopt.save(fast, tmp_path / "model.pt")
    with pytest.raises(SaveError, match="folder .* does not exist"):
        graphopt.save(fast, tmp_path / "missing" / "model.pt2")
    (tmp_path / "model.pt2").write_text("mine")
    with pytest.raises(SaveError, match="exists: pass overwrite=True"):
        graphopt.save(fast, tmp_path / "model.pt2")
    assert (tmp_path / "model.pt2").read_text() == "mine"
    graphopt.save(fast, tmp_path / "model.pt2", overwrite=True)
    assert graphopt.load(tmp_path / "model.pt2")(*images(2)).shape == (2, 10)


def test_a_failed_save_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, convnet: graphopt.OptimizedModule) -> None:
    fast = convnet
    destination = tmp_path / "model.pt2"
    real_save = torch.export.save

    def fails_half_way(program: Any, path: Path, **options: Any) -> None:
        real_save(program, path, **options)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise OSError("disk full")

    monkeypatch.setattr(torch.export, "save", fails_half_way)
    with pytest.raises(SaveError, match="disk full.*Nothing was written"):
        graphopt.save(fast, destination)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    differs = saving.compare(torch.zeros(1), torch.ones(1))  # the written file, loaded back, computing something else
    monkeypatch.setattr(saving, "compare", lambda *args: differs)
    with pytest.raises(SaveError, match="computes output differently from the optimized module.*Nothing was written"):
        graphopt.save(fast, destination)
    assert list(tmp_path.iterdir()) == []


def test_a_file_right_at_the_examples_sizes_but_wrong_at_a_second_size_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, convnet: graphopt.OptimizedModule) -> None:
    fast = convnet
    read = saving._read

    def wrong_beyond_the_example(path: Path, **options: Any) -> Callable[..., torch.Tensor]:
        loaded = read(path, **options)
        return lambda x: loaded(x) + (x.shape[0] != 4)  # the written file, loaded back, off at other batch sizes only

    monkeypatch.setattr(saving, "_read", wrong_beyond_the_example)
    with pytest.raises(SaveError, match=r"computes output differently .* on inputs \[\((?!4,)[0-9]+, 3, 12, 12\)\]\. Nothing was written"):
        graphopt.save(fast, tmp_path / "model.pt2")
    assert list(tmp_path.iterdir()) == []


class Reduction(nn.Module):
    """A string option whose value is also the name of an op's node in the exported graph ("mean")."""

    def forward(self, x: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
        return x.mean(1) if reduce == "mean" else x.sum(1)


def test_a_string_input_named_like_a_node_is_saved(tmp_path: Path) -> None:
    fast = graphopt.optimize(Reduction().eval(), (torch.randn(4, 3), "mean"))
    loaded = graphopt.load(graphopt.save(fast, tmp_path / "model.pt2"))
    x = torch.randn(6, 3)
    assert torch.equal(loaded(x, "mean"), x.mean(1))


def test_fused_regions_are_saved_as_their_eager_ops(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation, said by the fusion backend
        fast = graphopt.optimize(ConvNet().eval(), images(4), fuse="torchscript")
    assert fast.graphopt_report.fusion is not None
    with pytest.warns(UserWarning, match="fuse='torchscript' is not saved"):
        graphopt.save(fast, tmp_path / "model.pt2")
    loaded = graphopt.load(tmp_path / "model.pt2")
    assert loaded.graphopt_report.fusion is None
    assert any("fuse='torchscript' was not saved" in note for note in loaded.graphopt_report.notes)
    x = images(5)
    assert compare(fast(*x), loaded(*x)).ok


@pytest.fixture(scope="module")
def saved_file(tmp_path_factory: pytest.TempPathFactory, convnet: graphopt.OptimizedModule) -> Path:
    path = tmp_path_factory.mktemp("file") / "model.pt2"
    graphopt.save(convnet, path)
    return path


def rewritten(source: Path, destination: Path, inner: str, change: Callable[[bytes], bytes]) -> Path:
    """A copy of the archive ``source`` with member ``.../inner`` changed (checksums recomputed: a deliberate edit)."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(destination, "w") as copy_:
        for info in archive.infolist():
            data = archive.read(info)
            copy_.writestr(info, change(data) if info.filename.endswith("/" + inner) else data)
    return destination


def test_a_missing_file_raises_load_error(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="no file at .*missing.pt2"):
        graphopt.load(tmp_path / "missing.pt2")


def test_a_truncated_file_raises_load_error(saved_file: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(saved_file.read_bytes()[: saved_file.stat().st_size // 2])
    with pytest.raises(LoadError, match="not a complete .pt2 archive.*truncated"):
        graphopt.load(truncated)


def test_a_tampered_file_raises_load_error(saved_file: Path, tmp_path: Path) -> None:
    data = bytearray(saved_file.read_bytes())
    with zipfile.ZipFile(saved_file) as archive:
        weight = next(info for info in archive.infolist() if "/data/weights/weight_" in info.filename)
    header = weight.header_offset
    name_length, extra_length = int.from_bytes(data[header + 26 : header + 28], "little"), int.from_bytes(data[header + 28 : header + 30], "little")
    data[header + 30 + name_length + extra_length + 5] ^= 0xFF  # one byte of the weights, changed on disk
    tampered = tmp_path / "tampered.pt2"
    tampered.write_bytes(bytes(data))
    with pytest.raises(LoadError, match=f"damaged: .*{weight.filename.rpartition('/')[2]} fails its checksum"):
        graphopt.load(tampered)
    garbled = rewritten(saved_file, tmp_path / "garbled.pt2", "extra/graphopt.json", lambda text: text[:-10])
    with pytest.raises(LoadError, match="is damaged \\(JSONDecodeError"):
        graphopt.load(garbled)


def test_a_file_of_another_format_version_raises_load_error(saved_file: Path, tmp_path: Path) -> None:
    def next_version(text: bytes) -> bytes:
        metadata = json.loads(text)
        metadata.update(format_version=saving.FORMAT_VERSION + 1, graphopt_version="9.0")
        return json.dumps(metadata).encode()

    newer = rewritten(saved_file, tmp_path / "newer.pt2", "extra/graphopt.json", next_version)
    with pytest.raises(LoadError, match=f"format version {saving.FORMAT_VERSION + 1} \\(written by graphopt 9.0\\).*reads version {saving.FORMAT_VERSION}"):
        graphopt.load(newer)


@pytest.mark.parametrize("version", [0, None, True], ids=["older", "missing", "not a number"])
def test_a_file_of_an_older_or_missing_format_version_raises_load_error(version: int | None, saved_file: Path, tmp_path: Path) -> None:
    def other_version(text: bytes) -> bytes:
        metadata = json.loads(text)
        metadata.pop("format_version")
        return json.dumps(metadata if version is None else {**metadata, "format_version": version}).encode()

    older = rewritten(saved_file, tmp_path / "older.pt2", "extra/graphopt.json", other_version)
    with pytest.raises(LoadError, match=f"format version {version} \\(written by graphopt .*reads version {saving.FORMAT_VERSION}"):
        graphopt.load(older)


def test_files_graphopt_did_not_write_raise_load_error(saved_file: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt2"
    torch.export.save(torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),)), plain)
    with pytest.raises(LoadError, match="not written by graphopt.save: it has no graphopt.json"):
        graphopt.load(plain)
    text = tmp_path / "text.pt2"
    text.write_text("not an archive")
    with pytest.raises(LoadError, match="not a complete .pt2 archive"):
        graphopt.load(text)


def test_a_file_with_pickled_entries_is_refused_before_anything_is_unpickled(saved_file: Path, tmp_path: Path) -> None:
    def pickled(text: bytes) -> bytes:
        config = json.loads(text)
        first = next(iter(config["config"]))
        config["config"][first]["use_pickle"] = True  # torch.export.load would torch.load(weights_only=False) it
        return json.dumps(config).encode()

    edited = rewritten(saved_file, tmp_path / "pickled.pt2", "data/weights/model_weights_config.json", pickled)
    with pytest.raises(LoadError, match="holds pickled objects .*could run code"):
        graphopt.load(edited)
    unsafe = rewritten(saved_file, tmp_path / "inputs.pt2", "data/sample_inputs/model.pt", lambda _: b"not a safe pickle")
    with pytest.raises(LoadError, match="holds pickled objects \\(data/sample_inputs/model.pt"):
        graphopt.load(unsafe)


def naming_modules(source: Path, destination: Path, modules: Any) -> Path:
    """A copy of the file whose metadata names ``modules`` as the modules of its input and output classes."""
    return rewritten(source, destination, "extra/graphopt.json", lambda text: json.dumps({**json.loads(text), "container_modules": modules}).encode())


@pytest.fixture
def importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Modules on sys.path, not imported yet: one that records its import, one that fails; forgotten afterwards."""
    folder = tmp_path / "modules"
    folder.mkdir()
    (folder / "graphopt_test_outputs.py").write_text("IMPORTED = True\n")
    (folder / "graphopt_test_broken.py").write_text("raise RuntimeError('broken on import')\n")
    monkeypatch.syspath_prepend(str(folder))
    yield {"records": "graphopt_test_outputs", "fails": "graphopt_test_broken"}
    for name in ("graphopt_test_outputs", "graphopt_test_broken"):
        sys.modules.pop(name, None)


def test_load_imports_the_modules_a_file_names_only_when_allowed(saved_file: Path, tmp_path: Path, importable: dict[str, str]) -> None:
    path = naming_modules(saved_file, tmp_path / "named.pt2", [importable["records"]])
    advice = r"run `import graphopt_test_outputs` before graphopt.load, or .*graphopt.load\(path, allow_import=True\).*graphopt run FILE --allow-import"
    with pytest.raises(ImportNotAllowedError, match=f"takes or returns classes of graphopt_test_outputs, .*{advice}") as refused:
        graphopt.load(path)
    assert refused.value.modules == ["graphopt_test_outputs"] and "graphopt_test_outputs" not in sys.modules
    loaded = graphopt.load(path, allow_import=True)
    assert sys.modules["graphopt_test_outputs"].IMPORTED and loaded(*images(2)).shape == (2, 10)


@pytest.mark.parametrize(
    "modules",
    [["../evil"], ["/tmp/evil.py"], ["os.system('touch PWNED')"], ["os; import shutil"], ["class.path"], ["\uff54ransformers"], ["json."]],
    ids=["relative path", "absolute path", "call", "statement", "keyword", "not ascii", "trailing dot"],
)  # a value of another type (not a list, not a string): tests/test_archive_metadata.py
def test_a_file_naming_anything_but_module_names_to_import_is_refused(modules: Any, saved_file: Path, tmp_path: Path) -> None:
    path = naming_modules(saved_file, tmp_path / "named.pt2", modules)
    for allow_import in (False, True):
        with pytest.raises(LoadError, match="as modules to import, which graphopt.save never writes.*Load only files you saved") as refused:
            graphopt.load(path, allow_import=allow_import)
        assert type(refused.value) is LoadError and "`import" not in str(refused.value)  # the file writes no command to run


def test_load_imports_only_installed_modules_and_only_after_every_other_check(saved_file: Path, tmp_path: Path, importable: dict[str, str]) -> None:
    missing = naming_modules(saved_file, tmp_path / "missing.pt2", ["no_such_package_for_graphopt.outputs"])
    with pytest.raises(LoadError, match="classes of no_such_package_for_graphopt.outputs, which is not installed here: install the library"):
        graphopt.load(missing, allow_import=True)
    broken = naming_modules(saved_file, tmp_path / "broken.pt2", [importable["fails"]])
    with pytest.raises(LoadError, match=r"importing graphopt_test_broken, which the module in .*broken.pt2 needs, failed \(RuntimeError: broken on import\)"):
        graphopt.load(broken, allow_import=True)

    def pickled(text: bytes) -> bytes:
        config = json.loads(text)
        config["config"][next(iter(config["config"]))]["use_pickle"] = True
        return json.dumps(config).encode()

    named = naming_modules(saved_file, tmp_path / "named.pt2", [importable["records"]])
    edited = rewritten(named, tmp_path / "pickled.pt2", "data/weights/model_weights_config.json", pickled)
    with pytest.raises(LoadError, match="holds pickled objects"):
        graphopt.load(edited, allow_import=True)
    assert "graphopt_test_outputs" not in sys.modules  # a file refused imports nothing


def test_run_makes_inputs_of_the_files_dtypes_with_integers_0_or_1(round_trips: dict[str, Any]) -> None:
    """0 and 1 are valid token ids, masks and token types whatever the model's vocabulary; a shape alone takes the file's dtype."""
    signature = round_trips["expected"]["tokens-fx"]["module"].input_signature  # (input_ids int64, attention_mask int64)
    ids, mask, extra = cli._run_inputs(["64x32", "64x32:float32", "3x4"], signature, torch.Generator().manual_seed(0))
    assert ids.dtype == torch.int64 and set(ids.unique().tolist()) == {0, 1}
    assert mask.dtype == torch.float32 and extra.dtype == torch.float32  # a dtype given wins; beyond the file's inputs, float32


@onednn
@pytest.mark.slow
def test_an_aoti_package_runs_without_graphopt_at_other_batch_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The portable oneDNN ops become ATen for AOTInductor; the package loads with torch alone, its batch free."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    fast = graphopt.optimize(model, (torch.randn(4, 3, 8, 8),), passes=["fold_conv_bn", "to_channels_last", "use_onednn_kernels"], memory_format="channels_last")
    assert kernels(fast)["prepacked conv"] == 1
    path = graphopt.package(fast, tmp_path / "model.pt2")
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt2"]
    script = textwrap.dedent(f"""
        import sys, torch
        runner = torch._inductor.aoti_load_package({str(path)!r})
        torch.save([runner(torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))) for batch in (1, 4, 7)], "outputs.pt")
        assert "graphopt" not in sys.modules
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = torch.load(tmp_path / "outputs.pt")
    for batch, output in zip((1, 4, 7), outputs, strict=True):
        expected = fast(torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch)))
        assert compare(expected, output).ok
    with pytest.raises(LoadError, match="AOTInductor package: run it with torch._inductor.aoti_load_package"):
        graphopt.load(path)
    with pytest.raises(SaveError, match="exists"):
        graphopt.package(fast, path)
    # `graphopt run` times a package too, on the shapes given
    assert cli.main(["run", str(path), "--rounds", "2"]) == 2
    assert "give their shapes with --input" in capsys.readouterr().err
    assert cli.main(["run", str(path), "--input", "3x3x8x8", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "AOTInductor package" in out and "outputs [[3, 4]]" in out and "median latency" in out

"""export_onnx: checked files for every reference model, fp16, atomic writes, errors, CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import cli
from graphopt.backends import onnx_export
from graphopt.models import REFERENCE_MODELS
from tests.conftest import randomize_batch_norms, relative_error
from tests.test_capture import ValueBranch


def run_onnx(path: Path, x: torch.Tensor) -> torch.Tensor:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def producers(model: onnx.ModelProto) -> dict[str, str]:
    return {output: node.op_type for node in model.graph.node for output in node.output}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_reference_models_export_and_run(tmp_path: Path, name: str) -> None:
    reference = REFERENCE_MODELS[name]
    model = randomize_batch_norms(reference.build()).eval()
    path = tmp_path / f"{name}.onnx"
    report = graphopt.export_onnx(model, reference.example_inputs(batch_size=2), path)

    assert report.files == [str(path)] and leftovers(tmp_path) == [path.name]
    onnx.checker.check_model(str(path), full_check=True)
    exported = onnx.load(str(path))
    made_by = producers(exported)
    for node in exported.graph.node:
        if node.op_type == "BatchNormalization":
            assert made_by.get(node.input[0]) not in ("Conv", "Gemm", "MatMul"), "a BatchNorm left after a conv/linear"
    assert report.batch_sizes == [2, 3] and report.max_error < 1e-4
    assert report.node_counts == dict(report.node_counts) and report.nodes == len(exported.graph.node)
    assert report.plain_node_counts is not None
    other = reference.example_inputs(batch_size=5, seed=1)[0]
    assert relative_error(model(other), run_onnx(path, other)) < 1e-4
    assert "onnxruntime at batch sizes [2, 3]" in str(report)


def test_fp16_keeps_fp32_inputs_and_outputs(tmp_path: Path) -> None:
    model = randomize_batch_norms(REFERENCE_MODELS["resnet"].build()).eval()
    path = tmp_path / "resnet16.onnx"
    x = torch.randn(2, 3, 32, 32)
    report = graphopt.export_onnx(model, (x,), path, precision="fp16", compare_plain=False)
    exported = onnx.load(str(path))
    float_type, half_type = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    assert [i.type.tensor_type.elem_type for i in exported.graph.input] == [float_type]
    assert [o.type.tensor_type.elem_type for o in exported.graph.output] == [float_type]
    conv_weights = {node.input[1] for node in exported.graph.node if node.op_type == "Conv"}
    assert {init.data_type for init in exported.graph.initializer if init.name in conv_weights} == {half_type}
    assert report.node_counts["Cast"] == 2 and report.max_error < 1e-2
    assert relative_error(model(x), run_onnx(path, x)) < 1e-2


def test_exporting_an_optimized_module_as_it_is(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    x = torch.randn(2, 3, 6, 6)
    optimized = graphopt.optimize(model, (x,), memory_format="channels_last")
    report = graphopt.export_onnx(optimized, (x,), tmp_path / "m.onnx", optimize=False)
    assert report.plain_node_counts is None and "BatchNormalization" not in report.node_counts
    assert relative_error(model(x), run_onnx(tmp_path / "m.onnx", x)) < 1e-5


def test_external_data_files_are_listed_and_load(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(2, 64)
    report = graphopt.export_onnx(model, (x,), tmp_path / "m.onnx", external_data=True, compare_plain=False)
    assert report.files == [str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx.data")]
    assert leftovers(tmp_path) == ["m.onnx", "m.onnx.data"]
    assert relative_error(model(x), run_onnx(tmp_path / "m.onnx", x)) < 1e-5


def test_model_the_exporter_cannot_handle(tmp_path: Path) -> None:
    with pytest.raises(graphopt.ExportError, match="torch.onnx.export could not export ValueBranch.*Nothing was written"):
        graphopt.export_onnx(ValueBranch(), (torch.randn(2, 3),), tmp_path / "m.onnx", optimize=False)
    assert leftovers(tmp_path) == []


def test_a_mismatch_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onnx_export, "_run_onnxruntime", lambda path, args: [torch.zeros(2, 4)])
    with pytest.raises(graphopt.VerificationError, match="onnxruntime's output\\[0\\] differs from PyTorch.*Nothing was written"):
        graphopt.export_onnx(nn.Linear(3, 4).eval(), (torch.randn(2, 3),), tmp_path / "m.onnx", compare_plain=False)
    assert leftovers(tmp_path) == []


def test_existing_files_are_kept_unless_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"keep me")
    model, x = nn.Linear(3, 4).eval(), torch.randn(2, 3)
    with pytest.raises(graphopt.ExportError, match="exists: pass overwrite=True"):
        graphopt.export_onnx(model, (x,), path)
    assert path.read_bytes() == b"keep me"
    graphopt.export_onnx(model, (x,), path, overwrite=True, compare_plain=False)
    assert relative_error(model(x), run_onnx(path, x)) < 1e-5


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: graphopt.export_onnx(nn.Linear(3, 4), (torch.randn(2, 3),), p / "m.txt"), "does not end in .onnx"),
        (lambda p: graphopt.export_onnx(nn.Linear(3, 4), (torch.randn(2, 3),), p / "nope" / "m.onnx"), "folder .* does not exist"),
        (lambda p: graphopt.export_onnx(nn.Linear(3, 4), (torch.randn(2, 3),), p / "m.onnx", precision="bf16"), "no bf16 CPU kernels"),
        (
            lambda p: graphopt.export_onnx(graphopt.optimize(nn.Linear(3, 4).train(), torch.randn(2, 3)), (torch.randn(2, 3),), p / "m.onnx", optimize=False),
            "optimized for training",
        ),
    ],
    ids=["suffix", "folder", "bf16", "training"],
)
def test_bad_requests(tmp_path: Path, call, message: str) -> None:
    with pytest.raises(graphopt.ExportError, match=message):
        call(tmp_path)


def test_cli_export_and_optimize_onnx(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.onnx"
    assert cli.main(["export", "graphopt.models:resnet_small", str(out), "--input", "2x3x32x32"]) == 0
    assert "onnxruntime at batch sizes [2, 3]" in capsys.readouterr().out
    assert cli.main(["export", "graphopt.models:resnet_small", str(out), "--input", "2x3x32x32"]) == 2
    assert "exists: pass --overwrite to replace it" in capsys.readouterr().err  # the command line's words, not the library's
    second = tmp_path / "o.onnx"
    assert cli.main(["optimize", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--onnx", str(second)]) == 0
    printed = capsys.readouterr().out
    assert "fold_conv_bn" in printed and f"ONNX export: {second}" in printed
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32), dtype=np.float32)
    assert run_onnx(second, torch.from_numpy(x)).shape == (4, 10)


def shapes(path: Path) -> dict[str, list[str | int]]:
    """Each graph input's and output's name -> its dimensions (a name for a dynamic one)."""
    graph = onnx.load(str(path)).graph
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*graph.input, *graph.output)}


def test_bert_file_names_its_dimensions_and_outputs(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    bert = transformers.BertModel(config).eval()
    tokens = {"input_ids": torch.randint(0, 50, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    graphopt.export_onnx(bert, tokens, tmp_path / "bert.onnx", compare_plain=False)
    assert shapes(tmp_path / "bert.onnx") == {  # one batch and one sequence for both inputs, ModelOutput's field names
        "input_ids": ["batch", "sequence"],
        "attention_mask": ["batch", "sequence"],
        "last_hidden_state": ["batch", "sequence", 16],
        "pooler_output": ["batch", 16],
    }


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.conv(image)
        return features.relu(), features.mean(dim=(2, 3)).tanh()


def test_cnn_file_names_its_batch_and_tuple_outputs(tmp_path: Path) -> None:
    graphopt.export_onnx(TwoHeads().eval(), (torch.randn(2, 3, 8, 8),), tmp_path / "cnn.onnx", compare_plain=False)
    assert shapes(tmp_path / "cnn.onnx") == {"image": ["batch", 3, 8, 8], "output_0": ["batch", 4, 6, 6], "output_1": ["batch", 4]}
    single = tmp_path / "single.onnx"
    graphopt.export_onnx(nn.Sequential(nn.Conv2d(3, 4, 3)).eval(), (torch.randn(2, 3, 8, 8),), single, compare_plain=False)
    assert list(shapes(single))[-1] == "output"

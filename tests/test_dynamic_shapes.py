"""Dynamic dimensions beyond the batch (`graphopt.dynamic`): what varies by default, the ``dynamic_shapes``
option in torch.export's vocabulary, verification at a second size of each, and calls outside them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.export import Dim

import graphopt
from tests.conftest import FRONTENDS
from tests.test_keyword_inputs import Encoder, batch


def tokens(size: int, length: int, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(size, length, dtype=torch.long)
    mask[1:, length // 2 :] = 0
    return {"input_ids": torch.randint(0, 100, (size, length), generator=generator), "attention_mask": mask}


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.pool = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1)


class FixedLength(nn.Module):
    """Learned positions for exactly 6 tokens: the sequence length cannot vary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(16, 8), nn.Parameter(torch.randn(6, 8))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed(input_ids) + self.positions).sum(1)


def assert_matches_then_refuses(fast: nn.Module, model: nn.Module, shapes: list[tuple[int, ...]], refused: tuple[int, ...]) -> None:
    """``fast`` matches ``model`` on inputs of ``shapes``, and refuses one of shape ``refused`` with InputMismatchError."""
    for shape in shapes:
        other = torch.randn(shape)
        torch.testing.assert_close(fast(other), model(other), rtol=1e-4, atol=1e-5)
    with pytest.raises(graphopt.InputMismatchError, match=f"x has shape \\{list(refused)}"):
        fast(torch.randn(refused))


@pytest.mark.slow
def test_a_hugging_face_bert_at_other_batch_sizes_and_sequence_lengths() -> None:
    """The issue's acceptance: optimized at batch 8, length 16; called by name at batch 3, lengths 16 and 40."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    bert = transformers.BertModel(config).eval()
    fast = graphopt.optimize(bert, tokens(8, 16))
    report = fast.graphopt_report
    assert report.frontend == "export" and "fx" in report.capture_attempts  # symbolic_trace cannot follow BERT
    assert report.dynamic == "input_ids dims 0, 1; attention_mask dims 0, 1"
    assert "batch 9 (example: 8), size 8 (example: 16)" in report.second_input
    for length in (16, 40):
        call = tokens(3, length, seed=length)
        out, expected = fast(**call), bert(**call)
        assert type(out) is type(expected)  # BaseModelOutputWithPoolingAndCrossAttentions, attribute access
        torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.pooler_output, expected.pooler_output, rtol=1e-4, atol=1e-5)
    with pytest.raises(graphopt.InputMismatchError, match=r"outside the sizes the captured graph allows \(input_ids.size\(\)\[1\] <= 512\)"):
        fast(**tokens(2, 600))  # beyond BERT's 512 positions: torch.export's guard, as a GraphoptError


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_token_inputs_vary_in_batch_and_length_by_default(frontend: str) -> None:
    model = Encoder().eval()
    fast = graphopt.optimize(model, batch(4, length=6), frontend=frontend)
    report = fast.graphopt_report
    assert report.dynamic == "input_ids dims 0, 1; attention_mask dims 0, 1"  # the float mask follows the ids' length
    assert report.second_input.startswith("batch 5 (example: 4), size 4 (example: 6)")
    for size, length in ((2, 6), (3, 11), (1, 2)):
        call = batch(size, length, seed=size)
        torch.testing.assert_close(fast(**call), model(**call), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_image_sizes_stay_fixed_by_default_and_vary_with_auto(frontend: str) -> None:
    model = Convs().eval()
    x = torch.randn(2, 3, 16, 16)
    fixed = graphopt.optimize(model, (x,), frontend=frontend)
    assert fixed.graphopt_report.dynamic == "x dim 0"
    match = r"x has shape \[2, 3, 24, 24\].*optimize with dynamic_shapes=\{'x': \{2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO\}\}"
    with pytest.raises(graphopt.InputMismatchError, match=match):
        fixed(torch.randn(2, 3, 24, 24))

    free = graphopt.optimize(model, (x,), frontend=frontend, dynamic_shapes="auto")
    report = free.graphopt_report
    # the channel count cannot vary (the conv's weight fixes it): found by trying each size alone, not a reason to fix the others
    assert report.dynamic == "x dims 0, 2, 3"
    assert report.second_input.startswith("batch 3 (example: 2), size 8 (example: 16)")
    assert_matches_then_refuses(free, model, [(2, 3, 24, 24), (5, 3, 7, 30)], (2, 4, 16, 16))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_torch_export_specs_by_name_or_position(frontend: str) -> None:
    model = Convs().eval()
    x = torch.randn(2, 3, 16, 16)
    for spec in ({"x": {2: Dim("height", min=4, max=64)}}, ({2: Dim.AUTO},)):
        fast = graphopt.optimize(model, (x,), frontend=frontend, dynamic_shapes=spec)
        assert fast.graphopt_report.dynamic == "x dim 2"  # the batch is fixed too: only what the spec names varies
        assert_matches_then_refuses(fast, model, [(2, 3, 40, 16)], (3, 3, 16, 16))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_every_size_fixed_with_none(frontend: str) -> None:
    model = Encoder().eval()
    fast = graphopt.optimize(model, batch(4), frontend=frontend, dynamic_shapes=None)
    assert fast.graphopt_report.dynamic == "none" and fast.graphopt_report.second_input.startswith("the example's batch size")
    with pytest.raises(graphopt.InputMismatchError, match=r"input_ids has shape \[4, 7\]"):
        fast(**batch(4, length=7))


def test_a_length_the_model_ties_to_a_constant_stays_fixed_and_the_report_says_why() -> None:
    model = FixedLength().eval()
    ids = torch.randint(0, 16, (4, 6))
    exported = graphopt.optimize(model, (ids,), frontend="export")
    assert exported.graphopt_report.dynamic == "input_ids dim 0"
    assert any("torch.export fixed input_ids dim 1 to the example's size" in note for note in exported.graphopt_report.notes)
    traced = graphopt.optimize(model, (ids,), frontend="fx")  # symbolic_trace does not see it: the eager model refuses other lengths
    assert traced.graphopt_report.dynamic == "input_ids dim 0"
    assert any(note.startswith("input_ids dim 1 kept at the example's size: no second size could be verified") for note in traced.graphopt_report.notes)
    for fast in (exported, traced):
        torch.testing.assert_close(fast(ids[:2]), model(ids[:2]))
        with pytest.raises(graphopt.InputMismatchError, match=r"input_ids has shape \[4, 7\].*dynamic_shapes="):
            fast(torch.randint(0, 16, (4, 7)))


def test_unknown_dynamic_shapes_say_what_to_give() -> None:
    model, x = Convs().eval(), torch.randn(2, 3, 8, 8)
    with pytest.raises(graphopt.InvalidOptionError, match="dynamic_shapes='sequence': use 'batch\\+sequence', 'batch', 'auto', None"):
        graphopt.optimize(model, (x,), dynamic_shapes="sequence")
    with pytest.raises(graphopt.InvalidOptionError, match="names 'input_id'.*did you mean 'input_ids'"):
        graphopt.optimize(Encoder().eval(), batch(2), dynamic_shapes={"input_id": {1: Dim.AUTO}})
    with pytest.raises(graphopt.InvalidOptionError, match=r"dimension \[5\] of a tensor of shape \[2, 3, 8, 8\]"):
        graphopt.optimize(model, (x,), dynamic_shapes=({5: Dim.AUTO},))
    with pytest.raises(graphopt.InvalidOptionError, match="contradicts dynamic_shapes"):
        graphopt.optimize(model, (x,), dynamic_shapes="auto", dynamic_batch=False)


def test_onnx_files_take_the_same_dynamic_sizes(tmp_path) -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    model = Encoder().eval()
    report = graphopt.export_onnx(model, batch(4), tmp_path / "encoder.onnx")
    assert report.dynamic == "input_ids dims 0, 1; attention_mask dims 0, 1" and report.batch_sizes == [4, 5]
    assert "dynamic sizes: input_ids dims 0, 1; attention_mask dims 0, 1" in str(report)
    session = onnxruntime.InferenceSession(str(tmp_path / "encoder.onnx"), providers=["CPUExecutionProvider"])
    call = batch(3, length=11, seed=3)
    (out,) = session.run(None, {name: tensor.numpy() for name, tensor in call.items()})
    torch.testing.assert_close(torch.from_numpy(out), model(**call), rtol=1e-4, atol=1e-5)
    fixed = graphopt.export_onnx(model, batch(4), tmp_path / "fixed.onnx", dynamic_shapes=None)
    assert fixed.dynamic == "none" and fixed.batch_sizes == [4]


@pytest.mark.slow
def test_the_whole_graph_is_compiled_once_for_every_dynamic_size() -> None:
    model = Encoder().eval()
    fast = graphopt.optimize(model, batch(4), fuse="graph")
    for size, length in ((2, 6), (3, 11), (5, 9)):
        call = batch(size, length, seed=size)
        torch.testing.assert_close(fast(**call), model(**call), rtol=1e-4, atol=1e-5)
    assert [region.status for region in fast.graphopt_report.fusion.regions] == ["compiled"]
    assert fast._runner.compilations == 1  # batch and length marked dynamic: no recompilation for other sizes

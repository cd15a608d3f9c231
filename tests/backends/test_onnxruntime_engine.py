"""The onnxruntime engine built directly: its session, its file, its errors.

What every engine does through ``optimize(engine=...)`` (verified on a second input, a token
model at other batch sizes and sequence lengths, a saved result loaded in a fresh process,
training and other options refused, a missing runtime naming what to install) is tested for
onnxruntime too in tests/test_engines.py, which runs every registered engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.backends import onnxruntime_engine
from graphopt.backends.engine import EngineInput
from graphopt.backends.onnx_export import onnx_program
from graphopt.errors import EngineError
from graphopt.verify import compare


class NestedOutputs(nn.Module):
    """A conv and a head returning a dict with a tuple inside: the structure must come back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        pooled = self.conv(x).mean(dim=(2, 3))
        return {"logits": self.head(pooled), "features": (pooled, torch.relu(pooled))}


class TokenAttention(nn.Module):
    """Token ids and an attention mask through an embedding and one masked attention with two heads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.qkv = nn.Linear(8, 24)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, sequence, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None, None, :].bool())
        return attended.transpose(1, 2).flatten(2) + x


def tokens(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(batch, length, dtype=torch.int64)
    mask[0, length // 2 :] = 0
    return torch.randint(0, 30, (batch, length)), mask


def built(model: nn.Module, args: tuple[Any, ...], dims: tuple[frozenset[int], ...]) -> onnxruntime_engine.OnnxRuntimeRunner:
    return onnxruntime_engine.build(EngineInput(fx.symbolic_trace(model.eval()), args, dims, "fp32"))


def assert_matches(expected: Any, actual: Any) -> None:
    comparison = compare(expected, actual)
    assert comparison.ok and comparison.max_error <= 1e-5, comparison.detail


def test_the_session_is_tuned_for_latency_and_returns_the_model_structure() -> None:
    model, x = NestedOutputs().eval(), torch.randn(2, 3, 8, 8)
    gm = fx.symbolic_trace(model)
    code = gm.code
    runner = onnxruntime_engine.build(EngineInput(gm, (x,), (frozenset({0}),), "fp32"))
    assert gm.code == code  # the engine did not change graphopt's graph

    options = runner.session.get_session_options()
    assert options.intra_op_num_threads == torch.get_num_threads()
    # threads spin between the ops of a run and stop when it returns
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    assert options.graph_optimization_level == onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert options.execution_mode == onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    # graphopt's ONNX export: the dynamic dimension and the outputs named as export_onnx names them
    assert runner.session.get_inputs()[0].shape == ["batch", 3, 8, 8]
    assert [output.name for output in runner.session.get_outputs()] == ["logits", "features_0", "features_1"]
    assert runner.example_session.get_inputs()[0].shape == [2, 3, 8, 8]  # the same file, its batch fixed to the example's

    sessions = runner.example_session, runner.session = Recording(runner.example_session), Recording(runner.session)
    other = torch.randn(5, 3, 8, 8).transpose(2, 3)  # another batch size, not contiguous
    for inputs in ((x,), (other,)):
        with torch.no_grad():
            expected = model(*inputs)
        actual = runner(*inputs)
        assert set(actual) == {"logits", "features"} and isinstance(actual["features"], tuple)
        assert_matches(expected, actual)
    assert [session.calls for session in sessions] == [1, 1]  # the example's shapes on the fixed session, the other batch not


class Recording:
    """An onnxruntime session that counts its runs."""

    def __init__(self, session: Any) -> None:
        self.session, self.calls = session, 0

    def run(self, *args: Any) -> Any:
        self.calls += 1
        return self.session.run(*args)


def test_a_token_model_runs_at_another_batch_and_sequence_length() -> None:
    model, example = TokenAttention().eval(), tokens(2, 6)
    runner = built(model, example, (frozenset({0, 1}), frozenset({0, 1})))
    assert [spec.shape for spec in runner.session.get_inputs()] == [["batch", "sequence"]] * 2
    assert [spec.shape for spec in runner.example_session.get_inputs()] == [[2, 6]] * 2
    for inputs in (example, tokens(3, 9)):
        with torch.no_grad():
            assert_matches(model(*inputs), runner(*inputs))


class KthValue(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.kthvalue(x, 2).values  # torch.export takes it; torch.onnx has no translation of it


def test_an_op_the_exporter_cannot_translate_raises_its_error_naming_the_op() -> None:
    with pytest.raises(EngineError, match=r"torch.onnx.export could not export .*No ONNX function found for .*aten\.kthvalue"):
        built(KthValue(), (torch.randn(4, 4),), (frozenset(),))


class NoneOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + 1, None


def test_an_output_onnx_cannot_hold_is_refused_instead_of_shifting_the_others() -> None:
    with pytest.raises(EngineError, match="returns 2 outputs, of which ONNX holds 1"):
        built(NoneOutput(), (torch.randn(2, 4),), (frozenset({0}),))


def test_a_saved_file_loads_with_its_external_data_and_saves_again(tmp_path: Path) -> None:
    model, x = NestedOutputs().eval(), torch.randn(2, 3, 8, 8)
    gm = fx.symbolic_trace(model)
    runner = built(model, (x,), (frozenset({0}),))
    first, external, again = tmp_path / "first", tmp_path / "external", tmp_path / "again"
    for folder in (first, external, again):
        folder.mkdir()
    assert runner.save(first) == {"example_shapes": [[2, 3, 8, 8]]}
    assert sorted(path.name for path in first.iterdir()) == ["model.onnx"]
    # the weights beside the file, as graphopt's export saves them for models over protobuf's 2 GB
    onnx_program(model, (x,), (frozenset({0}),)).save(external / "model.onnx", external_data=True)
    loaded = onnxruntime_engine.load(external, {"example_shapes": [[2, 3, 8, 8]]}, gm, (x,))
    loaded.save(again)
    assert sorted(path.name for path in again.iterdir()) == ["model.onnx", "model.onnx.data"]
    other = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        expected = model(other)
    assert_matches(expected, onnxruntime_engine.load(again, {"example_shapes": [[2, 3, 8, 8]]}, gm, (x,))(other))


def test_a_file_onnxruntime_cannot_read_raises_its_error(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not an onnx model")
    model, x = NestedOutputs().eval(), torch.randn(2, 3, 8, 8)
    with pytest.raises(EngineError, match=r"could not load the ONNX file .*\(\w+: \[ONNXRuntimeError\]"):
        onnxruntime_engine.load(tmp_path, {"example_shapes": [[2, 3, 8, 8]]}, fx.symbolic_trace(model), (x,))

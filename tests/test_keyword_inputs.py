"""Keyword example inputs (``model(**batch)``), optional inputs left at None, and the calls the optimized module takes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import graphopt
from tests.conftest import FRONTENDS


class Encoder(nn.Module):
    """A token encoder called the Hugging Face way: ids, an optional mask and optional token types."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.types = nn.Embedding(2, 8)
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, *, return_sum=True):
        hidden = self.embed(input_ids)
        if token_type_ids is not None:
            hidden = hidden + self.types(token_type_ids)
        hidden = self.norm(torch.relu(self.linear(hidden)))
        if attention_mask is not None:
            hidden = hidden * attention_mask.unsqueeze(-1)
        return hidden.sum(1) if return_sum else hidden


def batch(size: int, length: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(size, length)
    mask[:, length - 2 :] = 0
    return {"input_ids": torch.randint(0, 16, (size, length), generator=generator), "attention_mask": mask}


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_dict_of_keyword_inputs_and_calls_by_name_or_position(frontend: str) -> None:
    model = Encoder().eval()
    fast = graphopt.optimize(model, batch(8), frontend=frontend)
    assert fast.graphopt_report.frontend == frontend
    other = batch(3, seed=1)
    expected = model(**other)
    torch.testing.assert_close(fast(**other), expected)
    torch.testing.assert_close(fast(other["input_ids"], other["attention_mask"]), expected)
    torch.testing.assert_close(fast(other["input_ids"], attention_mask=other["attention_mask"]), expected)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_calls_that_leave_out_or_add_an_input_say_what_to_do(frontend: str) -> None:
    fast = graphopt.optimize(Encoder().eval(), batch(4), frontend=frontend)
    with pytest.raises(graphopt.InputMismatchError, match="attention_mask is a NoneType, not a tensor"):
        fast(input_ids=batch(4)["input_ids"])
    with pytest.raises(graphopt.InputMismatchError, match="token_type_ids was not among the example inputs: optimize with example inputs that include it"):
        fast(**batch(4), token_type_ids=torch.zeros(4, 6, dtype=torch.long))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_optional_input_skipped_before_a_named_one_stays_none(frontend: str) -> None:
    model = Encoder().eval()
    ids = batch(4)["input_ids"]
    types = torch.randint(0, 2, (4, 6))
    fast = graphopt.optimize(model, (ids,), example_kwargs={"token_type_ids": types}, frontend=frontend)
    assert re.search(r"attention_mask(: NoneType|=None), token_type_ids: Tensor", fast.input_signature.describe())
    other_ids, other_types = batch(5, seed=2)["input_ids"], torch.randint(0, 2, (5, 6))
    torch.testing.assert_close(fast(other_ids, token_type_ids=other_types), model(other_ids, token_type_ids=other_types))
    torch.testing.assert_close(fast(other_ids, None, other_types), model(other_ids, None, other_types))
    with pytest.raises(graphopt.InputMismatchError, match="attention_mask"):
        fast(other_ids, torch.ones(5, 6), other_types)


def test_misspelt_and_keyword_only_inputs_are_refused_with_the_fix() -> None:
    model = Encoder().eval()
    with pytest.raises(graphopt.InvalidInputsError, match="'attention_maks': did you mean 'attention_mask'"):
        graphopt.optimize(model, {"input_ids": batch(2)["input_ids"], "attention_maks": torch.ones(2, 6)})
    with pytest.raises(graphopt.InvalidInputsError, match="return_sum cannot be given: only forward..'s positional-or-keyword parameters can"):
        graphopt.optimize(model, batch(2), example_kwargs={"return_sum": False})


def test_the_user_model_and_inputs_are_left_as_they_were() -> None:
    model = Encoder().eval()
    inputs = batch(4)
    before = {key: value.clone() for key, value in inputs.items()}
    graphopt.optimize(model, inputs)
    assert list(inputs) == ["input_ids", "attention_mask"]
    assert all(torch.equal(inputs[key], before[key]) for key in before)


def test_export_onnx_takes_keyword_inputs(tmp_path) -> None:
    types = torch.randint(0, 2, (4, 6))
    report = graphopt.export_onnx(Encoder().eval(), {"input_ids": batch(4)["input_ids"], "token_type_ids": types}, tmp_path / "encoder.onnx")
    assert report.batch_sizes == [4, 5] and report.max_error < 1e-5

"""Keyword example inputs (``model(**batch)``), optional inputs left at None, and the calls the optimized module takes."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

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
    ids = batch(4)["input_ids"]
    with pytest.raises(graphopt.InputMismatchError, match="attention_mask is a NoneType, not a tensor"):
        fast(ids, None)
    for left_out in (lambda: fast(input_ids=ids), lambda: fast(ids)):  # forward's default None, where the graph takes a tensor
        with pytest.raises(graphopt.InputMismatchError, match=r"attention_mask was left out of the call, so forward\(\)'s default attention_mask=None applies.*Pass attention_mask"):
            left_out()
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
    with pytest.raises(graphopt.InputMismatchError, match=r"attention_mask is Tensor\[5, 6\] float32 cpu, but this optimized module accepts"):
        fast(other_ids, torch.ones(5, 6), other_types)


class Normalized(nn.Module):
    """The issue's ``forward(x, normalize=True)``; ``is True`` lets symbolic_trace go past the flag, fixing the example's value."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, normalize: bool = True):
        y = self.linear(x)
        if normalize is True:
            y = y / y.norm(dim=-1, keepdim=True)
        return y


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_left_out_flag_the_graph_fixed_is_refused_not_taken_from_the_example(frontend: str) -> None:
    model, x = Normalized().eval(), torch.randn(4, 8)
    fast = graphopt.optimize(model, (x,), example_kwargs={"normalize": False}, frontend=frontend)
    assert fast.graphopt_report.frontend == frontend
    torch.testing.assert_close(fast(x, normalize=False), model(x, normalize=False))
    expected = r"normalize was left out of the call, so forward\(\)'s default normalize=True applies, but .* the example's normalize=False .* Pass normalize=False"
    with pytest.raises(graphopt.InputMismatchError, match=expected):
        fast(x)
    with pytest.raises(graphopt.InputMismatchError, match=expected):
        fast(x=x)
    with pytest.raises(graphopt.InputMismatchError, match="normalize is True, but this optimized module accepts"):
        fast(x, True)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, scale: float = 2.0):
        return self.linear(x) * scale


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_left_out_number_runs_with_forwards_default_where_the_graph_reads_it(frontend: str) -> None:
    model, x = Scaled().eval(), torch.randn(4, 8)
    fast = graphopt.optimize(model, (x,), example_kwargs={"scale": 3.0}, frontend=frontend)
    given = 5.0 if frontend == "fx" else 3.0  # torch.export fixes the example's value
    torch.testing.assert_close(fast(x, given), model(x, given))
    if frontend == "fx":  # scale is an input of the traced graph
        torch.testing.assert_close(fast(x), model(x))
        torch.testing.assert_close(fast(x=x), model(x))
    else:  # torch.export fixed scale=3.0
        with pytest.raises(graphopt.InputMismatchError, match=r"scale was left out .* default scale=2.0 .* scale=3.0 \(torch.export fixed that value"):
            fast(x)


class DropsOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, p: float = 0.5):
        return F.dropout(self.linear(x), p=p, training=self.training)


def test_an_argument_the_captured_graph_reads_is_not_fixed_when_a_pass_removes_its_use() -> None:
    """fx keeps p as an input of the captured graph; remove_dropout then leaves it unread, and any p computes the same."""
    model, x = DropsOut().eval(), torch.randn(4, 8)
    fast = graphopt.optimize(model, (x, 0.5), frontend="fx")
    assert fast.graphopt_report["remove_dropout"].rewrites
    for p in (0.25, 0.5):
        torch.testing.assert_close(fast(x, p), model(x, p))
    torch.testing.assert_close(fast(x), model(x))


class Options(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0, reduce: str = "total", clamp: bool = False):
        y = self.linear(x) * scale
        y = y.clamp(min=0) if clamp else y
        return y.sum(-1) if reduce == "total" else y.mean(-1)


def test_numbers_strings_and_flags_torch_export_fixed_are_refused_at_other_values_also_after_load(tmp_path) -> None:
    model, x = Options().eval(), torch.randn(4, 8)
    fast = graphopt.optimize(model, (x, 0.5, "average", True), frontend="export")
    loaded = graphopt.load(graphopt.save(fast, tmp_path / "options.pt2"))
    for module in (fast, loaded):
        torch.testing.assert_close(module(x, 0.5, "average", True), model(x, 0.5, "average", True))
        for name, other in (("scale", 2.0), ("reduce", "total"), ("clamp", False)):
            with pytest.raises(graphopt.InputMismatchError, match=f"{name} is {other!r}, but this optimized module accepts .*{name}="):
                module(x, **{"scale": 0.5, "reduce": "average", "clamp": True, name: other})


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


class CachedEncoder(Encoder):
    """GPT-2's parameter order: a cache between the ids and the mask, and ``**kwargs``, so a positional mask lands in the cache."""

    def forward(self, input_ids, cache=None, attention_mask=None, token_type_ids=None, **kwargs):
        return super().forward(input_ids, attention_mask, token_type_ids)


def assert_short_and_without_values(error: pytest.ExceptionInfo) -> None:
    message = str(error.value)
    assert "tensor(" not in message and "forward(input_ids" not in message, message  # tensors described, not printed; no copy of the signature
    assert len(message) < 500, message


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_misspelt_keyword_at_call_time_gets_the_close_name(frontend: str) -> None:
    for model in (Encoder().eval(), CachedEncoder().eval()):
        fast = graphopt.optimize(model, batch(4), frontend=frontend)
        ids, mask = batch(4).values()
        with pytest.raises(graphopt.InputMismatchError, match=r"no parameter named 'attention_maks'; 'attention_maks': did you mean 'attention_mask'\?.*It takes input_ids, attention_mask") as error:
            fast(input_ids=ids, attention_maks=mask)
        assert_short_and_without_values(error)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_positional_call_of_inputs_optimized_by_name_says_to_name_them(frontend: str) -> None:
    model = CachedEncoder().eval()
    fast = graphopt.optimize(model, batch(4), frontend=frontend)
    ids, mask = batch(3, seed=1).values()
    by_name = r"fast\(input_ids=\.\.\., attention_mask=\.\.\.\)"
    with pytest.raises(graphopt.InputMismatchError, match=rf"argument 2 of the call, Tensor\[3, 6\] float32 cpu, lands by position on forward\(\)'s parameter 'cache'.*Pass the inputs by name: {by_name}") as error:
        fast(ids, mask)
    assert_short_and_without_values(error)
    with pytest.raises(graphopt.InputMismatchError, match=rf"attention_mask was left out.*all inputs by name: {by_name}") as error:
        fast(ids)
    assert_short_and_without_values(error)
    torch.testing.assert_close(fast(input_ids=ids, attention_mask=mask), model(input_ids=ids, attention_mask=mask))  # the advice works


def test_gpt2_called_by_position_or_with_a_misspelt_name_gets_the_fix() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.GPT2Model(config).eval()
    ids, mask = torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask})
    with pytest.raises(graphopt.InputMismatchError, match=r"did you mean 'attention_mask'\?") as error:
        fast(input_ids=ids, attention_maks=mask)
    assert_short_and_without_values(error)
    for call in (lambda: fast(ids, mask), lambda: fast(ids)):
        with pytest.raises(graphopt.InputMismatchError, match=r"by name: fast\(input_ids=\.\.\., attention_mask=\.\.\.\)") as error:
            call()
        assert_short_and_without_values(error)

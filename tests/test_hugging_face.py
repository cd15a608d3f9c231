"""Hugging Face friction points a new user meets: inputs by position where forward() takes a cache, and returned caches."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch

import graphopt


def gpt2(**config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    settings = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Model(transformers.GPT2Config(**{**settings, **config})).eval()


def tokens(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, length - 3 :] = 0
    return torch.randint(0, 100, (batch, length)), mask


def test_a_mask_given_by_position_where_gpt2_takes_its_cache_is_refused_with_the_fix() -> None:
    ids, mask = tokens(4, 16)
    # GPT2Model.forward(input_ids, cache, attention_mask, ...): the mask would land in the cache
    with pytest.raises(graphopt.InvalidInputsError, match=r"example input 2 is a tensor, but parameter 2 of GPT2Model.forward is '(cache|past_key_values)'.*pass the inputs by name"):
        graphopt.optimize(gpt2(), (ids, mask))


def test_a_returned_cache_is_refused_with_the_fix_and_the_fix_works() -> None:
    ids, mask = tokens(4, 16)
    model = gpt2()  # use_cache=True by default: forward returns a DynamicCache
    with pytest.raises(graphopt.InvalidInputsError, match=r"GPT2Model returns a DynamicCache.*Set model.config.use_cache = False before optimize"):
        graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask})
    model.config.use_cache = False
    fast = graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask})
    ids, mask = tokens(2, 24)
    out, expected = fast(input_ids=ids, attention_mask=mask), model(input_ids=ids, attention_mask=mask)
    assert type(out) is type(expected) and out.past_key_values is None
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)


def test_a_setting_that_a_decorator_passes_itself_gets_a_hint() -> None:
    ids, mask = tokens(4, 16)
    with pytest.raises(graphopt.InvalidInputsError, match=r"wrapped by a decorator that passes 'use_cache' by keyword itself.*model.config.use_cache = False"):
        graphopt.optimize(gpt2(), {"input_ids": ids, "attention_mask": mask, "use_cache": False})

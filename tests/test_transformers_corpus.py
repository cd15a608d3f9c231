"""Transformers called the way people call them: keyword inputs with attention masks, other batch sizes and lengths.

Eight Hugging Face models (BERT, RoBERTa, DistilBERT, GPT-2, T5 encoder, Llama, ViT, CLIP vision),
small and with random weights, built from config objects (nothing is downloaded), are optimized
from one keyword example (batch 4, length 16, padded rows masked) in three configurations: the
default, ``precision="bf16"`` and ``tune=True``. Each optimized module is then called by name at
two other batch sizes and, for token models, two sequence lengths (the default ``dynamic_shapes``
lets both vary), and must return the original's output class with the same values: within the
fp32 tolerance for the default and tuned modules (tuning's default accuracy admits exact
candidates only), within the bf16 tolerance for bf16.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch
from torch import nn

import graphopt
from graphopt.verify import tolerance_for
from tests.test_corpus import max_relative_error

pytestmark = pytest.mark.slow

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
CONFIGS: dict[str, dict[str, Any]] = {"default": {}, "bf16": {"precision": "bf16"}, "tuned": {"tune": True, "tune_budget_s": 10}}
TOLERANCES = {"default": tolerance_for(torch.float32), "bf16": tolerance_for(torch.bfloat16), "tuned": tolerance_for(torch.float32)}
EXAMPLE = (4, 16)  # batch, length
CALLS = ((2, 16), (5, 24))  # two other batch sizes; two lengths (the example's and another)


def bert() -> nn.Module:
    return transformers.BertModel(transformers.BertConfig(vocab_size=100, max_position_embeddings=64, **SMALL))


def roberta() -> nn.Module:
    return transformers.RobertaModel(transformers.RobertaConfig(vocab_size=100, max_position_embeddings=66, pad_token_id=1, **SMALL))


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)
    return transformers.DistilBertModel(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    config.use_cache = False  # what graphopt's error for a returned cache says to do
    return transformers.GPT2Model(config)


def t5_encoder() -> nn.Module:
    return transformers.T5EncoderModel(transformers.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=100))


def llama() -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=100, num_key_value_heads=1, max_position_embeddings=64, use_cache=False, **SMALL)
    return transformers.LlamaModel(config)


def vit() -> nn.Module:
    return transformers.ViTModel(transformers.ViTConfig(image_size=32, patch_size=8, **SMALL))


def clip_vision() -> nn.Module:
    return transformers.CLIPVisionModel(transformers.CLIPVisionConfig(image_size=32, patch_size=8, **SMALL))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "bert": bert, "roberta": roberta, "distilbert": distilbert, "gpt2": gpt2,
    "t5_encoder": t5_encoder, "llama": llama, "vit": vit, "clip_vision": clip_vision,
}  # fmt: skip
IMAGES = {"vit", "clip_vision"}


def inputs(name: str, batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Keyword inputs: pixels for vision models; token ids (from 2: RoBERTa pads with 1) and a mask padding all rows but the first."""
    generator = torch.Generator().manual_seed(seed)
    if name in IMAGES:
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=generator)}
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, length - length // 4 :] = 0
    return {"input_ids": torch.randint(2, 100, (batch, length), generator=generator), "attention_mask": mask}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_keyword_calls_at_other_batch_sizes_and_lengths(name: str, config: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    original = copy.deepcopy(model)
    fast = graphopt.optimize(model, inputs(name, *EXAMPLE, seed=0), **CONFIGS[config])
    report = fast.graphopt_report
    expected_dynamic = "pixel_values dim 0" if name in IMAGES else "input_ids dims 0, 1; attention_mask dims 0, 1"
    assert report.dynamic == expected_dynamic
    for seed, (batch, length) in enumerate(CALLS, start=1):
        call = inputs(name, batch, length, seed)
        with torch.no_grad():
            expected = original(**call)
        actual = fast(**call)
        error = max_relative_error(expected, actual)  # also: same output class and structure
        assert error < TOLERANCES[config], f"{name} ({config}) at batch {batch}, length {length}: relative error {error:.2e}"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values(), strict=True))

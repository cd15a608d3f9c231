"""Corpus: small Hugging Face models (random weights, built from config objects) through `graphopt.optimize`.

For each model and each preset (inference: ``model.eval()``; training: ``model.train()``, both
with default options) this checks that optimize succeeds, that the optimized module's outputs
(``ModelOutput`` dataclasses, compared leaf by leaf through ``torch.utils._pytree``) match the
original's, and that the original model's ``state_dict`` is unchanged.

Nothing is downloaded: every model is built from a config object with ``torch.manual_seed``
set first, and ``HF_HUB_OFFLINE=1`` keeps transformers off the network.

Frontends used (transformers 5.24, torch 2.13): every model needs ``torch.export`` today;
``symbolic_trace`` fails on all of them (item assignment on a Proxy, control flow on a traced
value, iterating a Proxy). The test accepts either frontend, so that fx succeeding one day does
not fail it, but requires the report to say why fx was not used when export was.
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
from torch.utils import _pytree as pytree

import graphopt

pytestmark = pytest.mark.slow

BATCH = 2
TOLERANCE = 1e-4
Built = tuple[nn.Module, tuple[Any, ...]]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (BATCH, 16), dtype=torch.int64)


def _pixels() -> torch.Tensor:
    return torch.randn(BATCH, 3, 32, 32)


def bert() -> Built:
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config), (_tokens(),)


def gpt2() -> Built:
    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=100,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2Model(config), (_tokens(),)


def vit() -> Built:
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,  # defaults are 0: make training draw masks
    )
    return transformers.ViTModel(config), (_pixels(),)


def resnet() -> Built:
    config = transformers.ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=10,
    )
    model = transformers.ResNetForImageClassification(config)
    # Non-trivial BatchNorm statistics and affine parameters (the defaults are 0/1), so folding is really tested.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 1.5)
                module.weight.normal_()
                module.bias.normal_()
    return model, (_pixels(),)


def convnext() -> Built:
    config = transformers.ConvNextConfig(
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        image_size=32,
        drop_path_rate=0.5,  # the last block's rate; at 0.1 both samples of the batch are usually kept
        layer_scale_init_value=1.0,  # the default 1e-6 scales each block's branch to nearly nothing
    )
    return transformers.ConvNextModel(config), (_pixels(),)


def swin() -> Built:
    config = transformers.SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        drop_path_rate=0.1,
    )
    return transformers.SwinModel(config), (_pixels(),)


def t5_encoder() -> Built:
    config = transformers.T5Config(
        d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=100
    )
    return transformers.T5EncoderModel(config), (_tokens(),)


MODELS: dict[str, Callable[[], Built]] = {
    "bert": bert,
    "gpt2": gpt2,
    "vit": vit,
    "resnet": resnet,
    "convnext": convnext,
    "swin": swin,
    "t5_encoder": t5_encoder,
}
# Models whose training forward draws random numbers (dropout, drop path): there the seeded
# comparison is checked not to be vacuous (another seed gives other outputs).
RANDOM_IN_TRAINING = {"bert", "gpt2", "vit", "convnext", "swin", "t5_encoder"}
PRESETS = ("inference", "training")

def build(name: str) -> Built:
    torch.manual_seed(0)
    return MODELS[name]()


def tensor_leaves(output: Any) -> tuple[list[torch.Tensor], Any]:
    """The tensor leaves of ``output`` and its tree spec; ModelOutput must flatten to tensors, not be one leaf."""
    leaves, spec = pytree.tree_flatten(output)
    assert leaves, f"{type(output).__name__} has no leaves"
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves), (
        f"{type(output).__name__} flattens to {[type(leaf).__name__ for leaf in leaves]}: pytree does not see its tensors"
    )
    return leaves, spec


def max_relative_error(expected: Any, actual: Any) -> float:
    """max|a - b| / max|ref| over every tensor leaf (the worst leaf), after checking the structures match."""
    expected_leaves, expected_spec = tensor_leaves(expected)
    actual_leaves, actual_spec = tensor_leaves(actual)
    assert type(actual) is type(expected), (
        f"output type {type(actual).__name__}, expected {type(expected).__name__}"
    )
    assert actual_spec == expected_spec, (
        f"output structure differs:\n{actual_spec}\nexpected\n{expected_spec}"
    )
    worst = 0.0
    for ref, out in zip(expected_leaves, actual_leaves):
        assert out.shape == ref.shape and out.dtype == ref.dtype, (
            out.shape,
            out.dtype,
            ref.shape,
            ref.dtype,
        )
        ref, out = ref.detach().double(), out.detach().double()
        scale = ref.abs().max()
        assert scale > 0, (
            "a reference output is all zeros: the relative error means nothing"
        )
        worst = max(worst, float((ref - out).abs().max() / scale))
    return worst


def run_seeded(module: nn.Module, inputs: tuple[Any, ...], seed: int) -> Any:
    torch.manual_seed(seed)
    return module(*inputs)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_corpus_model(name: str, preset: str) -> None:
    model, inputs = build(name)
    model.train(preset == "training")
    reference = copy.deepcopy(
        model
    )  # the original's twin: forwards on it never touch `model`
    state_before = {key: value.clone() for key, value in model.state_dict().items()}

    optimized = graphopt.optimize(model, inputs)

    report = optimized.graphopt_report
    assert report.mode == preset
    assert report.verified
    assert report.frontend in ("fx", "export")
    if report.frontend == "export":
        assert "fx" in report.capture_attempts, (
            "the report must say why fx was not used"
        )

    expected = run_seeded(reference, inputs, seed=5)
    actual = run_seeded(optimized, inputs, seed=5)
    error = max_relative_error(expected, actual)
    assert error < TOLERANCE, (
        f"{name} ({preset}, frontend {report.frontend}): relative error {error:.2e}"
    )

    if preset == "training" and name in RANDOM_IN_TRAINING:
        other_seed = run_seeded(optimized, inputs, seed=6)
        assert max_relative_error(expected, other_seed) > TOLERANCE, (
            "training forward drew no random numbers"
        )

    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    changed = [
        key
        for key, value in state_after.items()
        if not torch.equal(value, state_before[key])
    ]
    assert not changed, f"optimize modified the original model: {changed}"
    assert model.training == (preset == "training")

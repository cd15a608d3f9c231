"""Tests for the full-size anchor models in graphopt.models.anchors.

Full-size models are slow on a small CPU: shapes and capture are checked at batch 1 and
64x64 (the ViT is built for 64x64 images there), bf16 optimize() runs at 112x112 against autocast's
own error; exports and optimize() runs are `slow`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphopt
from graphopt.models import ANCHOR_MODELS, anchors
from graphopt.verify import AUTOCAST_FACTOR, low_precision_floor
from tests.conftest import relative_error

PARAMETER_COUNTS = {  # torchvision's, for num_classes=1000
    "resnet50": 25_557_032,
    "mobilenet_v2": 3_504_872,
    "efficientnet_b0": 5_288_548,
    "convnext_tiny": 28_589_128,
    "vit_b_16": 86_567_656,
}
# a few of torchvision's state_dict keys per model: same module names, so weights load by name
TORCHVISION_KEYS = {
    "resnet50": ("conv1.weight", "layer1.0.downsample.0.weight", "layer4.2.bn3.running_var", "fc.bias"),
    "mobilenet_v2": ("features.0.0.weight", "features.1.conv.0.0.weight", "features.2.conv.3.weight", "features.18.1.bias", "classifier.1.weight"),
    "efficientnet_b0": ("features.0.1.weight", "features.1.0.block.1.fc1.weight", "features.2.1.block.3.1.running_mean", "features.8.0.weight", "classifier.1.bias"),
    "convnext_tiny": ("features.0.1.weight", "features.1.0.block.0.weight", "features.1.0.layer_scale", "features.2.1.weight", "features.5.8.block.5.bias", "classifier.0.weight", "classifier.2.weight"),
    "vit_b_16": (
        "class_token",
        "conv_proj.weight",
        "encoder.pos_embedding",
        "encoder.layers.encoder_layer_11.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_0.self_attention.out_proj.bias",
        "encoder.layers.encoder_layer_0.mlp.3.weight",
        "encoder.ln.weight",
        "heads.head.weight",
    ),
}
SMALL_SIZE = 64


def small(name: str) -> nn.Module:
    """The model in eval mode, built for SMALL_SIZE images (only the ViT's position embedding depends on it)."""
    torch.manual_seed(0)
    model = anchors.vit_b_16(image_size=SMALL_SIZE) if name == "vit_b_16" else ANCHOR_MODELS[name].factory()
    return model.eval()


def small_input(batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, SMALL_SIZE, SMALL_SIZE, generator=torch.Generator().manual_seed(1))


def test_anchor_models_are_the_five_torchvision_classifiers_at_batch_8() -> None:
    assert list(ANCHOR_MODELS) == list(PARAMETER_COUNTS)
    for name, reference in ANCHOR_MODELS.items():
        assert reference.name == name and reference.input_shape == (8, 3, 224, 224)
        (inputs,) = reference.example_inputs()
        assert inputs.shape == (8, 3, 224, 224)


@pytest.mark.parametrize("name", PARAMETER_COUNTS)
def test_parameter_counts_and_names_match_torchvision(name: str) -> None:
    model = ANCHOR_MODELS[name].build()
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]
    keys = model.state_dict().keys()
    assert set(TORCHVISION_KEYS[name]) <= keys


@pytest.mark.parametrize("name", PARAMETER_COUNTS)
def test_outputs_have_a_sane_scale_and_depend_on_the_input(name: str) -> None:
    model = small(name)
    with torch.no_grad():
        logits = model(small_input(batch=2))
    assert logits.shape == (2, 1000) and torch.isfinite(logits).all()
    scale = logits.abs().max()
    assert 0.1 < scale < 100, "random-weight logits should be of order 1, not 1e-9 or 1e3"
    assert relative_error(logits[0], logits[1]) > 0.1, "two different images should not give (almost) the same logits"


@pytest.mark.parametrize("name", PARAMETER_COUNTS)
def test_runs_in_training_mode(name: str) -> None:
    model = small(name).train()
    logits = model(small_input(batch=2))
    assert logits.shape == (2, 1000)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_batchnorm_statistics_are_calibrated() -> None:
    model = ANCHOR_MODELS["mobilenet_v2"].build()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert model.training, "calibration restores the training flag"
    assert all(not torch.equal(n.running_var, torch.ones_like(n.running_var)) for n in norms)
    assert all(n.momentum == 0.1 for n in norms)


def test_calibration_makes_each_batchnorm_normalise_its_input() -> None:
    model = anchors.calibrate_batch_norms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)))
    model.eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = model(torch.randn(anchors._CALIBRATION_SHAPE, generator=generator))
    torch.testing.assert_close(out.mean(dim=(0, 2, 3)), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(dim=(0, 2, 3), unbiased=False), torch.ones(4), atol=1e-3, rtol=0)


def test_stochastic_depth_drops_whole_samples_in_training_only() -> None:
    layer = anchors.StochasticDepth(0.5)
    x = torch.ones(64, 2, 3, 3)
    assert layer.eval()(x) is x
    out = layer.train()(x)
    per_sample = out.flatten(1)
    assert set(per_sample.unique().tolist()) == {0.0, 2.0}  # dropped, or kept and rescaled by 1 / (1 - p)
    assert (per_sample == per_sample[:, :1]).all()


def test_vit_uses_multihead_attention_and_rejects_other_sizes() -> None:
    model = small("vit_b_16")
    assert sum(isinstance(m, nn.MultiheadAttention) for m in model.modules()) == 12
    with pytest.raises(RuntimeError):
        model(torch.randn(1, 3, 2 * SMALL_SIZE, 2 * SMALL_SIZE))
    with pytest.raises(ValueError, match="divisible"):
        anchors.vit_b_16(image_size=100)


@pytest.mark.parametrize("name", PARAMETER_COUNTS)
def test_fx_capture_matches_eager(name: str) -> None:
    model, inputs = small(name), (small_input(),)
    gm = graphopt.capture(model, inputs, frontend="fx")
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs))


@pytest.mark.slow
@pytest.mark.parametrize("name", PARAMETER_COUNTS)
def test_export_capture_matches_eager(name: str) -> None:
    model, inputs = small(name), (small_input(),)
    gm = graphopt.capture(model, inputs, frontend="export")
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


# bf16 with one frontend only (the frontends' graphs are the same), at 112x112, to keep the suite short
PRECISION_FRONTENDS = [("fp32", "fx"), ("fp32", "export"), ("bf16", "fx")]
BF16_SIZE = 112


@pytest.mark.slow
@pytest.mark.parametrize("precision, frontend", PRECISION_FRONTENDS)
@pytest.mark.parametrize("name", PARAMETER_COUNTS)
def test_optimize_verifies_on_anchor_models(name: str, precision: str, frontend: str) -> None:
    size = BF16_SIZE if precision == "bf16" else SMALL_SIZE
    torch.manual_seed(0)
    model = (anchors.vit_b_16(image_size=size) if name == "vit_b_16" else ANCHOR_MODELS[name].factory()).eval()
    inputs = (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1)),)
    fast = graphopt.optimize(model, inputs, precision=precision, frontend=frontend, memory_format="channels_last")
    report = fast.graphopt_report
    assert report.frontend == frontend and all(p.max_error is not None for p in report.passes)
    with torch.no_grad():
        expected = model(*inputs)
        error = relative_error(expected, fast(*inputs))
        if precision == "fp32":
            assert error < 1e-4
            return
        # bf16 is judged as graphopt judges it: against torch.autocast's own error on the same input
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_error = relative_error(expected, model(*inputs).float())
    assert error <= max(AUTOCAST_FACTOR * autocast_error, low_precision_floor(torch.bfloat16)), (error, autocast_error)

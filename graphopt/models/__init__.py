"""Reference models written in plain torch: small ones for tests and demos, full-size anchors for benchmarks.

They are the workloads used by graphopt's demo, tests and benchmark: each
covers a different family of patterns that the graph passes rewrite
(Conv+BatchNorm, depthwise convolutions, LayerNorm/GELU, attention).
``REFERENCE_MODELS`` pairs every model with a default input shape so that
callers can build a model and matching inputs by name. ``ANCHOR_MODELS`` holds
the full-size ResNet-50, MobileNetV2, EfficientNet-B0, ConvNeXt-Tiny and ViT-B/16
(torchvision's layer structure, batch 8 at 224x224) that graphopt's speed goal is
measured on.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from graphopt.models.anchors import convnext_tiny, efficientnet_b0, mobilenet_v2, resnet50, vit_b_16
from graphopt.models.convnext import convnext_small
from graphopt.models.mobilenet import mobilenet_v2_small
from graphopt.models.resnet import resnet_small
from graphopt.models.transformer import transformer_small

__all__ = [
    "ANCHOR_MODELS",
    "REFERENCE_MODELS",
    "ReferenceModel",
    "convnext_small",
    "convnext_tiny",
    "efficientnet_b0",
    "get_reference_model",
    "mobilenet_v2",
    "mobilenet_v2_small",
    "resnet50",
    "resnet_small",
    "transformer_small",
    "vit_b_16",
]


@dataclass(frozen=True)
class ReferenceModel:
    """A named model factory together with the input shape it is meant for."""

    name: str
    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    description: str

    def build(self, seed: int = 0) -> nn.Module:
        """Build the model with parameters initialised from ``seed``."""
        torch.manual_seed(seed)
        return self.factory()

    def example_inputs(self, batch_size: int | None = None, seed: int = 0) -> tuple[torch.Tensor]:
        """Return deterministic random inputs of ``input_shape``, optionally with another batch size."""
        batch = self.input_shape[0] if batch_size is None else batch_size
        # A private generator keeps the inputs independent of, and from
        # disturbing, the global RNG state used for parameter init.
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn((batch, *self.input_shape[1:]), generator=generator),)


REFERENCE_MODELS: dict[str, ReferenceModel] = {
    model.name: model
    for model in (
        ReferenceModel(
            name="resnet",
            factory=resnet_small,
            input_shape=(8, 3, 64, 64),
            description="ResNet with BasicBlocks, biased convs before BatchNorm and mixed ReLU styles",
        ),
        ReferenceModel(
            name="mobilenet_v2",
            factory=mobilenet_v2_small,
            input_shape=(8, 3, 64, 64),
            description="MobileNetV2 with inverted residuals, depthwise convs, BatchNorm and Hardswish",
        ),
        ReferenceModel(
            name="convnext",
            factory=convnext_small,
            input_shape=(8, 3, 64, 64),
            description="ConvNeXt with 7x7 depthwise convs, LayerNorm, GELU and layer scale",
        ),
        ReferenceModel(
            name="transformer",
            factory=transformer_small,
            input_shape=(8, 3, 32, 32),
            description="ViT encoder with scaled_dot_product_attention, pre-norm LayerNorm and GELU MLPs",
        ),
    )
}


# The full-size models graphopt's performance goal is measured on (see graphopt.models.anchors).
ANCHOR_MODELS: dict[str, ReferenceModel] = {
    model.name: model
    for model in (
        ReferenceModel("resnet50", resnet50, (8, 3, 224, 224), "ResNet-50: Bottleneck blocks, Conv+BatchNorm+ReLU, residual adds"),
        ReferenceModel("mobilenet_v2", mobilenet_v2, (8, 3, 224, 224), "MobileNetV2: inverted residuals, depthwise convs, BatchNorm, ReLU6"),
        ReferenceModel(
            "efficientnet_b0", efficientnet_b0, (8, 3, 224, 224), "EfficientNet-B0: MBConv with squeeze-excitation, depthwise convs, SiLU"
        ),
        ReferenceModel(
            "convnext_tiny", convnext_tiny, (8, 3, 224, 224), "ConvNeXt-Tiny: 7x7 depthwise convs, LayerNorm, Linear MLPs, GELU, layer scale"
        ),
        ReferenceModel("vit_b_16", vit_b_16, (8, 3, 224, 224), "ViT-B/16: patch conv, 12 pre-norm blocks with nn.MultiheadAttention, GELU MLPs"),
    )
}


def get_reference_model(name: str) -> ReferenceModel:
    """Look up a reference model by name, raising ValueError for unknown names."""
    try:
        return REFERENCE_MODELS[name]
    except KeyError:
        valid_names = ", ".join(sorted(REFERENCE_MODELS))
        raise ValueError(f"Unknown reference model {name!r}; valid names are: {valid_names}") from None

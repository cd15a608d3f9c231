"""Full-size benchmark models: layer-for-layer equivalents of five torchvision classifiers.

ResNet-50, MobileNetV2, EfficientNet-B0, ConvNeXt-Tiny and ViT-B/16 are written here
in plain torch with torchvision's layer structure, module names and parameter counts
(``resnet50`` 25,557,032; ``mobilenet_v2`` 3,504,872; ``efficientnet_b0`` 5,288,548;
``convnext_tiny`` 28,589,128; ``vit_b_16`` 86,567,656), so the benchmark measures the
workloads people run without depending on torchvision. ViT-B/16 uses
``nn.MultiheadAttention`` exactly as torchvision does.

Differences from torchvision, all deliberate and none changing the layer structure:

- residual adds are written out of place (``x + y``, not ``x += y``) and activations are
  not in-place;
- initialisation is chosen so that outputs are not degenerate and numeric comparisons
  mean something. BatchNorm statistics are calibrated on random images (torchvision's
  mean 0 / variance 1 defaults give MobileNetV2/EfficientNet logits near 1e-9, and
  ResNet-50 logits that barely depend on the input); the last BatchNorm of each residual
  branch starts with weight 0.1 (trained networks keep residual branches small, and
  ``zero_init_residual`` starts them at 0: with weight 1 a random calibrated network
  is chaotic, 1e-3 input noise moving ResNet-50 logits by 3%); the ConvNeXt layer scale
  starts at 0.1 instead of 1e-6 (blocks would be identities) and the ViT head gets small
  random weights instead of zeros. At 224x224, bf16 autocast then changes the logits
  by 1e-2..2e-2 of their scale, as with trained weights.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# BatchNorm statistics are calibrated on this many random images of this size: enough for
# per-channel statistics, small enough to build a model in about a second.
_CALIBRATION_SHAPE = (4, 3, 96, 96)
_RESIDUAL_BRANCH_GAMMA = 0.1
_CONVNEXT_LAYER_SCALE = 0.1
_VIT_HEAD_STD = 0.02


def calibrate_batch_norms(model: nn.Module, shape: tuple[int, ...] = _CALIBRATION_SHAPE) -> nn.Module:
    """Set every BatchNorm's running statistics to those of ``model``'s activations on random images.

    A trained network's BatchNorms normalise its activations; random weights with the
    default statistics (mean 0, variance 1) let activations shrink or grow layer after
    layer. Returns ``model`` in the training mode it had.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return model
    was_training = model.training
    momenta = [norm.momentum for norm in norms]
    model.eval()  # dropout and stochastic depth off: only the BatchNorms collect statistics
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average: one batch sets the statistics exactly
        norm.train()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(torch.randn(shape, generator=generator))
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    return model.train(was_training)


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of ``divisor`` without going more than 10% below it (torchvision)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


class Conv2dNormActivation(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> optional activation, like ``torchvision.ops.Conv2dNormActivation``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        activation: Callable[[], nn.Module] | None = nn.ReLU,
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        if activation is not None:
            layers.append(activation())
        super().__init__(*layers)


class StochasticDepth(nn.Module):
    """Drop whole residual branches per sample while training (``torchvision.ops.StochasticDepth``, mode "row")."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        keep = x.new_empty((x.shape[0], 1, 1, 1)).bernoulli_(survival)  # 4-D inputs: one draw per sample
        return x * keep.div_(survival)


def _init_conv_linear(model: nn.Module, linear_init: Callable[[nn.Linear], None]) -> None:
    """torchvision's CNN initialisation: Kaiming (fan_out) convs, ``linear_init`` for linears."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            linear_init(module)


# --------------------------------------------------------------------------- ResNet-50


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (strided) -> 1x1 expand (x4), each with BatchNorm, plus the (projected) input."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        nn.init.constant_(self.bn3.weight, _RESIDUAL_BRANCH_GAMMA)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """torchvision's ``resnet50``: stem, four stages of 3/4/6/3 Bottlenecks, average pool, fc."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        in_channels = 64
        stages = []
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            out_channels = width * Bottleneck.expansion
            downsample = None
            if stride != 1 or in_channels != out_channels:
                downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))
            layers = [Bottleneck(in_channels, width, stride, downsample)]
            layers += [Bottleneck(out_channels, width) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*layers))
            in_channels = out_channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        _init_conv_linear(self, lambda linear: None)  # nn.Linear's own default, as torchvision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (torchvision ``resnet50`` layout) with calibrated BatchNorm statistics."""
    return calibrate_batch_norms(ResNet50(num_classes))


# --------------------------------------------------------------------------- MobileNetV2


class InvertedResidual(nn.Module):
    """Optional 1x1 expand -> 3x3 depthwise -> linear 1x1 project, with ReLU6, plus the input when shapes match."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = int(round(in_channels * expand_ratio))
        self.use_res_connect = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(in_channels, hidden, 1, activation=nn.ReLU6))
        layers += [
            Conv2dNormActivation(hidden, hidden, 3, stride, groups=hidden, activation=nn.ReLU6),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)
        if self.use_res_connect:
            nn.init.constant_(self.conv[-1].weight, _RESIDUAL_BRANCH_GAMMA)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


# (expand ratio t, output channels c, repeats n, first stride s), from the MobileNetV2 paper
_MOBILENET_V2_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class MobileNetV2(nn.Module):
    """torchvision's ``mobilenet_v2`` (width 1.0): 17 inverted residuals between a stem and a 1280-channel head."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        in_channels, last_channels = 32, 1280
        features: list[nn.Module] = [Conv2dNormActivation(3, in_channels, 3, 2, activation=nn.ReLU6)]
        for expand_ratio, channels, repeats, stride in _MOBILENET_V2_SETTINGS:
            out_channels = _make_divisible(channels)
            for index in range(repeats):
                features.append(InvertedResidual(in_channels, out_channels, stride if index == 0 else 1, expand_ratio))
                in_channels = out_channels
        features.append(Conv2dNormActivation(in_channels, last_channels, 1, activation=nn.ReLU6))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last_channels, num_classes))

        def normal_linear(linear: nn.Linear) -> None:
            nn.init.normal_(linear.weight, 0, 0.01)
            nn.init.zeros_(linear.bias)

        _init_conv_linear(self, normal_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 1000) -> nn.Module:
    """MobileNetV2 (torchvision ``mobilenet_v2`` layout) with calibrated BatchNorm statistics."""
    return calibrate_batch_norms(MobileNetV2(num_classes))


# --------------------------------------------------------------------------- EfficientNet-B0


class SqueezeExcitation(nn.Module):
    """Global average -> 1x1 conv -> SiLU -> 1x1 conv -> sigmoid, scaling the input's channels."""

    def __init__(self, channels: int, squeeze_channels: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, channels, 1)
        self.activation = nn.SiLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(self.activation(self.fc1(self.avgpool(x))))
        return x * self.scale_activation(scale)


class MBConv(nn.Module):
    """Optional 1x1 expand -> kxk depthwise -> squeeze-excitation -> 1x1 project, SiLU, stochastic-depth residual."""

    def __init__(self, expand_ratio: int, kernel: int, stride: int, in_channels: int, out_channels: int, stochastic_depth: float) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and in_channels == out_channels
        expanded = _make_divisible(in_channels * expand_ratio)
        layers: list[nn.Module] = []
        if expanded != in_channels:
            layers.append(Conv2dNormActivation(in_channels, expanded, 1, activation=nn.SiLU))
        layers += [
            Conv2dNormActivation(expanded, expanded, kernel, stride, groups=expanded, activation=nn.SiLU),
            SqueezeExcitation(expanded, max(1, in_channels // 4)),
            Conv2dNormActivation(expanded, out_channels, 1, activation=None),
        ]
        self.block = nn.Sequential(*layers)
        if self.use_res_connect:
            nn.init.constant_(self.block[-1][1].weight, _RESIDUAL_BRANCH_GAMMA)
        self.stochastic_depth = StochasticDepth(stochastic_depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result = self.stochastic_depth(result) + x
        return result


# (expand ratio, kernel, stride, input channels, output channels, layers): EfficientNet-B0
_EFFICIENTNET_B0_SETTINGS = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)


class EfficientNetB0(nn.Module):
    """torchvision's ``efficientnet_b0``: SiLU stem, 16 MBConv blocks in 7 stages, 1280-channel head."""

    def __init__(self, num_classes: int = 1000, stochastic_depth_prob: float = 0.2) -> None:
        super().__init__()
        features: list[nn.Module] = [Conv2dNormActivation(3, _EFFICIENTNET_B0_SETTINGS[0][3], 3, 2, activation=nn.SiLU)]
        total_blocks = sum(setting[-1] for setting in _EFFICIENTNET_B0_SETTINGS)
        block_index = 0
        for expand_ratio, kernel, stride, in_channels, out_channels, repeats in _EFFICIENTNET_B0_SETTINGS:
            stage = []
            for index in range(repeats):
                drop = stochastic_depth_prob * block_index / total_blocks
                stage.append(
                    MBConv(expand_ratio, kernel, stride if index == 0 else 1, in_channels if index == 0 else out_channels, out_channels, drop)
                )
                block_index += 1
            features.append(nn.Sequential(*stage))
        last_in = _EFFICIENTNET_B0_SETTINGS[-1][4]
        features.append(Conv2dNormActivation(last_in, 4 * last_in, 1, activation=nn.SiLU))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(4 * last_in, num_classes))

        def uniform_linear(linear: nn.Linear) -> None:
            init_range = 1.0 / math.sqrt(linear.out_features)
            nn.init.uniform_(linear.weight, -init_range, init_range)
            nn.init.zeros_(linear.bias)

        _init_conv_linear(self, uniform_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.avgpool(self.features(x)), 1)
        return self.classifier(x)


def efficientnet_b0(num_classes: int = 1000) -> nn.Module:
    """EfficientNet-B0 (torchvision ``efficientnet_b0`` layout) with calibrated BatchNorm statistics."""
    return calibrate_batch_norms(EfficientNetB0(num_classes))


# --------------------------------------------------------------------------- ConvNeXt-Tiny


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (permute, normalise, permute back), as torchvision's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Permute(nn.Module):
    """``torch.permute`` as a module, so it can sit in an ``nn.Sequential`` (torchvision.ops.Permute)."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    """7x7 depthwise conv -> LayerNorm -> Linear(4x) -> GELU -> Linear, scaled per channel, plus the input."""

    def __init__(self, dim: int, stochastic_depth: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Linear(4 * dim, dim),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), _CONVNEXT_LAYER_SCALE))
        self.stochastic_depth = StochasticDepth(stochastic_depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stochastic_depth(self.layer_scale * self.block(x)) + x


class ConvNeXtTiny(nn.Module):
    """torchvision's ``convnext_tiny``: 4x4 patchify stem, stages of 3/3/9/3 blocks (96..768 channels)."""

    def __init__(self, num_classes: int = 1000, stochastic_depth_prob: float = 0.1) -> None:
        super().__init__()
        stages = ((96, 3), (192, 3), (384, 9), (768, 3))
        features: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, 96, 4, 4), LayerNorm2d(96, eps=1e-6))]
        total_blocks = sum(depth for _, depth in stages)
        block_index = 0
        for stage_index, (dim, depth) in enumerate(stages):
            blocks = []
            for _ in range(depth):
                blocks.append(CNBlock(dim, stochastic_depth_prob * block_index / (total_blocks - 1.0)))
                block_index += 1
            features.append(nn.Sequential(*blocks))
            if stage_index + 1 < len(stages):
                next_dim = stages[stage_index + 1][0]
                features.append(nn.Sequential(LayerNorm2d(dim, eps=1e-6), nn.Conv2d(dim, next_dim, 2, 2)))
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(768, eps=1e-6), nn.Flatten(1), nn.Linear(768, num_classes))
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


def convnext_tiny(num_classes: int = 1000) -> nn.Module:
    """ConvNeXt-Tiny (torchvision ``convnext_tiny`` layout), layer scale 0.1."""
    return ConvNeXtTiny(num_classes)


# --------------------------------------------------------------------------- ViT-B/16


class MLPBlock(nn.Sequential):
    """Linear -> GELU -> Dropout -> Linear -> Dropout (torchvision's ViT MLP, module names 0..4)."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float) -> None:
        super().__init__(nn.Linear(dim, hidden_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden_dim, dim), nn.Dropout(dropout))
        for linear in (self[0], self[3]):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.normal_(linear.bias, std=1e-6)


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm -> nn.MultiheadAttention -> residual, LayerNorm -> MLP -> residual."""

    def __init__(self, num_heads: int, dim: int, mlp_dim: int, dropout: float = 0.0, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, num_heads, dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLPBlock(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    """Learned position embedding, ``encoder_layer_{i}`` blocks and a final LayerNorm."""

    def __init__(self, seq_length: int, num_layers: int, num_heads: int, dim: int, mlp_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", EncoderBlock(num_heads, dim, mlp_dim, dropout)) for i in range(num_layers)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    """torchvision's ``vit_b_16`` layout: 16x16 patch conv, class token, 12 encoder blocks, linear head.

    The position embedding fixes the input size: images must be ``image_size`` square.
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        num_layers: int = 12,
        num_heads: int = 12,
        dim: int = 768,
        mlp_dim: int = 3072,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        if image_size % patch_size != 0:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch_size ({patch_size})")
        self.patch_size, self.dim = patch_size, dim
        self.conv_proj = nn.Conv2d(3, dim, patch_size, patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = Encoder((image_size // patch_size) ** 2 + 1, num_layers, num_heads, dim, mlp_dim)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(dim, num_classes)))
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        # torchvision zero-initialises the head: every output would be 0 whatever the input
        nn.init.trunc_normal_(self.heads.head.weight, std=_VIT_HEAD_STD)
        nn.init.zeros_(self.heads.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x)
        x = x.reshape(x.shape[0], self.dim, -1).permute(0, 2, 1)
        class_token = self.class_token.expand(x.shape[0], -1, -1)
        x = self.encoder(torch.cat([class_token, x], dim=1))
        return self.heads(x[:, 0])


def vit_b_16(num_classes: int = 1000, image_size: int = 224) -> nn.Module:
    """ViT-B/16 (torchvision ``vit_b_16`` layout); inputs must be ``image_size`` x ``image_size``."""
    return VisionTransformer(image_size=image_size, num_classes=num_classes)

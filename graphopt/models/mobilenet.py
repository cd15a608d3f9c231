"""A small MobileNetV2-style classifier built from inverted residual blocks.

Every convolution is followed by BatchNorm and most by Hardswish, which
makes this the main workload for Conv+BatchNorm folding and for
depthwise convolutions.
"""

import torch
from torch import nn

# (expansion ratio, output channels before width scaling, stride)
_INVERTED_RESIDUAL_SETTINGS: tuple[tuple[int, int, int], ...] = (
    (4, 32, 1),
    (6, 48, 2),
    (6, 48, 1),
    (6, 64, 2),
    (6, 64, 1),
    (6, 96, 2),
)
_STEM_CHANNELS = 32
_LAST_CHANNELS = 192


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round ``value`` to the nearest multiple of ``divisor``, as torchvision does.

    Rounding never goes more than 10% below ``value``, so narrow widths
    keep enough capacity.
    """
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def _conv_bn(
    in_channels: int,
    out_channels: int,
    kernel_size: int,
    stride: int = 1,
    groups: int = 1,
    activation: bool = True,
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=kernel_size // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
    ]
    if activation:
        layers.append(nn.Hardswish())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """Expand with a 1x1 conv, filter depthwise, project back with a linear 1x1 conv."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden_channels = in_channels * expansion
        self.use_residual = stride == 1 and in_channels == out_channels
        self.block = nn.Sequential(
            _conv_bn(in_channels, hidden_channels, kernel_size=1),
            _conv_bn(hidden_channels, hidden_channels, kernel_size=3, stride=stride, groups=hidden_channels),
            # No activation after the projection: a non-linearity in the
            # narrow bottleneck destroys information (MobileNetV2 paper).
            _conv_bn(hidden_channels, out_channels, kernel_size=1, activation=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # use_residual is fixed at construction, so this branch is resolved
        # while tracing and leaves no control flow in the graph.
        if self.use_residual:
            return x + self.block(x)
        return self.block(x)


class MobileNetV2Small(nn.Module):
    """MobileNetV2 with six inverted residual blocks."""

    def __init__(self, num_classes: int = 10, width_mult: float = 0.5) -> None:
        super().__init__()
        in_channels = _make_divisible(_STEM_CHANNELS * width_mult)
        layers: list[nn.Module] = [_conv_bn(3, in_channels, kernel_size=3, stride=2)]
        for expansion, base_channels, stride in _INVERTED_RESIDUAL_SETTINGS:
            out_channels = _make_divisible(base_channels * width_mult)
            layers.append(InvertedResidual(in_channels, out_channels, stride, expansion))
            in_channels = out_channels
        last_channels = _make_divisible(_LAST_CHANNELS * width_mult)
        layers.append(_conv_bn(in_channels, last_channels, kernel_size=1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last_channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.classifier(x)


def mobilenet_v2_small(num_classes: int = 10, width_mult: float = 0.5) -> nn.Module:
    """Build a small MobileNetV2; ``width_mult`` scales every channel count."""
    return MobileNetV2Small(num_classes=num_classes, width_mult=width_mult)

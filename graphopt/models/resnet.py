"""A small ResNet-style image classifier built from BasicBlocks.

The layout deliberately mixes idioms found in real user code so that
graph passes are exercised on all of them: convolutions with a redundant
bias in front of BatchNorm, ReLU as an ``nn.ReLU`` module as well as the
``torch.relu`` and ``F.relu`` functions, and the residual add written as
``out + identity``.
"""

import torch
import torch.nn.functional as F
from torch import nn


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1, bias: bool = False) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=bias)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        # The bias is redundant because BatchNorm follows; it is kept on
        # purpose so that the bias-dropping pass has something to remove.
        self.conv1 = _conv3x3(in_channels, out_channels, stride, bias=True)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.downsample = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNetSmall(nn.Module):
    """ResNet with one BasicBlock per stage and four stages."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        stage_widths = [width * factor for factor in (1, 2, 4, 8)]
        self.stem_conv = _conv3x3(3, stage_widths[0], bias=True)
        self.stem_bn = nn.BatchNorm2d(stage_widths[0])
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = BasicBlock(stage_widths[0], stage_widths[0])
        self.layer2 = BasicBlock(stage_widths[0], stage_widths[1], stride=2)
        self.layer3 = BasicBlock(stage_widths[1], stage_widths[2], stride=2)
        self.layer4 = BasicBlock(stage_widths[2], stage_widths[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(stage_widths[3], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem_bn(self.stem_conv(x)))
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


def resnet_small(num_classes: int = 10, width: int = 16) -> nn.Module:
    """Build a small ResNet whose stage widths are ``width * (1, 2, 4, 8)``."""
    return ResNetSmall(num_classes=num_classes, width=width)

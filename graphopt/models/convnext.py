"""A small ConvNeXt-style classifier.

ConvNeXt blocks combine a 7x7 depthwise convolution with a channels-last
LayerNorm / Linear / GELU MLP, so the model exercises permutes, LayerNorm
in both memory layouts and GELU rather than BatchNorm and ReLU.
"""

import torch
import torch.nn.functional as F
from torch import nn

# ConvNeXt initialises the layer scale at 1e-6, which makes each block an
# almost exact identity at init; 0.1 keeps the blocks numerically visible
# so that comparisons between original and rewritten graphs mean something.
_LAYER_SCALE_INIT = 0.1


class LayerNorm2d(nn.Module):
    """LayerNorm over the channel dimension of an NCHW tensor."""

    def __init__(self, num_channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.normalized_shape = (num_channels,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_channels))
        self.bias = nn.Parameter(torch.zeros(num_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv followed by an inverted-bottleneck MLP, with layer scale."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), _LAYER_SCALE_INIT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        x = self.dwconv(x)
        x = x.permute(0, 2, 3, 1)
        x = self.pwconv2(self.act(self.pwconv1(self.norm(x))))
        x = self.gamma * x
        x = x.permute(0, 3, 1, 2)
        return identity + x


class ConvNeXtSmall(nn.Module):
    """ConvNeXt with four stages separated by LayerNorm + strided 2x2 conv downsampling."""

    def __init__(
        self,
        num_classes: int = 10,
        dims: tuple[int, ...] = (24, 48, 96, 192),
        depths: tuple[int, ...] = (1, 1, 2, 1),
    ) -> None:
        super().__init__()
        if len(dims) != len(depths):
            raise ValueError(f"dims and depths must have the same length, got {len(dims)} and {len(depths)}")
        self.downsample_layers = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dims[0], kernel_size=4, stride=4), LayerNorm2d(dims[0]))]
        )
        for in_dim, out_dim in zip(dims[:-1], dims[1:]):
            self.downsample_layers.append(
                nn.Sequential(LayerNorm2d(in_dim), nn.Conv2d(in_dim, out_dim, kernel_size=2, stride=2))
            )
        self.stages = nn.ModuleList(
            [nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)]) for dim, depth in zip(dims, depths)]
        )
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for downsample, stage in zip(self.downsample_layers, self.stages):
            x = stage(downsample(x))
        x = x.mean(dim=(-2, -1))
        return self.head(self.norm(x))


def convnext_small(
    num_classes: int = 10,
    dims: tuple[int, ...] = (24, 48, 96, 192),
    depths: tuple[int, ...] = (1, 1, 2, 1),
) -> nn.Module:
    """Build a small ConvNeXt with per-stage widths ``dims`` and block counts ``depths``."""
    return ConvNeXtSmall(num_classes=num_classes, dims=dims, depths=depths)

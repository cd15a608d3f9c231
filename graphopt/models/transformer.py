"""A small ViT-style transformer encoder for image classification.

The attention is written by hand around ``F.scaled_dot_product_attention``
(rather than using ``nn.MultiheadAttention``) so that the qkv projection,
head reshapes and the attention call all appear as separate graph nodes.
Shapes are read from ``x.shape`` and passed straight into ``reshape`` /
``expand``, which keeps the model traceable by torch.fx and exportable
with a dynamic batch dimension.
"""

import torch
import torch.nn.functional as F
from torch import nn

_DROPOUT = 0.1
_INIT_STD = 0.02


class Attention(nn.Module):
    """Multi-head self-attention over a (batch, tokens, dim) sequence."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.head_dim = dim // heads
        self.dim = dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(_DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size = x.shape[0]
        num_tokens = x.shape[1]
        qkv = self.qkv(x).reshape(batch_size, num_tokens, 3, self.heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(query, key, value)
        attended = attended.transpose(1, 2).reshape(batch_size, num_tokens, self.dim)
        return self.dropout(self.proj(attended))


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        hidden_dim = dim * mlp_ratio
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(_DROPOUT),
            nn.Linear(hidden_dim, dim),
            nn.Dropout(_DROPOUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformerSmall(nn.Module):
    """Patch embedding, CLS token, learned position embedding and encoder blocks.

    The position embedding has a fixed length, so inputs must be exactly
    ``image_size`` x ``image_size``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        image_size: int = 32,
        patch_size: int = 4,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
    ) -> None:
        super().__init__()
        if image_size % patch_size != 0:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch_size ({patch_size})")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        self.dropout = nn.Dropout(_DROPOUT)
        self.blocks = nn.Sequential(*[EncoderBlock(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.cls_token, std=_INIT_STD)
        nn.init.trunc_normal_(self.pos_embed, std=_INIT_STD)
        # Small but non-zero, so that logits differ between inputs and
        # numeric comparisons of the output are meaningful from the start.
        nn.init.trunc_normal_(self.head.weight, std=_INIT_STD)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls_tokens = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls_tokens, x], dim=1)
        x = self.dropout(x + self.pos_embed)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def transformer_small(
    num_classes: int = 10,
    image_size: int = 32,
    patch_size: int = 4,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
    mlp_ratio: int = 4,
) -> nn.Module:
    """Build a small ViT; inputs must be ``image_size`` x ``image_size`` RGB images."""
    return VisionTransformerSmall(
        num_classes=num_classes,
        image_size=image_size,
        patch_size=patch_size,
        dim=dim,
        depth=depth,
        heads=heads,
        mlp_ratio=mlp_ratio,
    )

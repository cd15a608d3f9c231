"""The small models the engine tests share (tests/test_engines.py, tests/backends/test_*_engine.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

VOCABULARY = 30


class ConvNet(nn.Module):
    """Conv, BatchNorm, ReLU, pooling and a head, returning a dict with a tuple inside."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        pooled = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return {"logits": self.head(pooled), "features": (pooled,)}


class TokenModel(nn.Module):
    """Embedding, masked self-attention, a head: token ids and an attention mask, batch and sequence dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        attended, _ = self.attention(x, x, x, key_padding_mask=attention_mask == 0, need_weights=False)
        return self.head(attended + x)


def conv_net() -> nn.Module:
    """A `ConvNet` in eval mode with BatchNorm statistics of its own (the defaults fold to nothing)."""
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model


def tokens(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask whose first row masks its second half."""
    mask = torch.ones(batch, length, dtype=torch.int64)
    mask[0, length // 2 :] = 0
    return torch.randint(0, VOCABULARY, (batch, length)), mask

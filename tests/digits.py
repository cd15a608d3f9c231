"""scikit-learn's 8x8 digits and a small CNN for them: the trained model the accuracy tests share."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


class DigitsNet(nn.Module):
    """A small CNN for scikit-learn's 8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(images, labels, training indices, test indices): 1,797 images scaled to [0, 1], 1,400 for training, a fixed split."""
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn ships the digits dataset (pip install -e '.[test]')")
    loaded = datasets.load_digits()
    images = torch.tensor(loaded.images, dtype=torch.float32).unsqueeze(1) / 16
    labels = torch.tensor(loaded.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    return images, labels, order[:1400], order[1400:]

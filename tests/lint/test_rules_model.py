"""Model-structure rules GO401-GO402, on small realistic training scripts; GO401's fix is executed on CPU."""

from __future__ import annotations

import ast
import textwrap
from typing import Any

import torch
from torch import nn

from graphopt import lint
from tests.lint.helpers import found, line


TRAINING = """
dataset = TensorDataset(torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,)))
loader = DataLoader(dataset, batch_size=32, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def train(epochs):
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
"""


def script(model: str, training: str = TRAINING) -> str:
    header = (
        "import collections\n\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
        "from torch.utils.data import DataLoader, TensorDataset\n\n"
    )
    return header + textwrap.dedent(model) + training


# --- GO401 conv-bias-before-bn ----------------------------------------------------------------

BIASED = script(
    """
    def block(cin, cout, **conv_options):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, **conv_options),  # kwargs
            nn.BatchNorm2d(cout),
        )


    model = torch.nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),  # default bias
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, 1, 1, 1, 1, True),  # positional bias
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(
            32, 32, 3, padding=1
        ),  # multi-line, no trailing comma
        nn.BatchNorm2d(32),
        nn.Sequential(collections.OrderedDict([
            ("conv", nn.Conv2d(32, 32, 1, bias=True)),  # OrderedDict
            ("bn", nn.BatchNorm2d(32)),
        ])),
        nn.ConvTranspose2d(32, 16, 2, stride=2),  # transposed
        nn.BatchNorm2d(16),
        nn.Conv2d(16, 16, 3, padding=1),  # followed by ReLU, not BatchNorm
        nn.ReLU(),
        nn.BatchNorm2d(16),
        nn.Conv2d(16, 16, 3, padding=1, bias=False),  # no bias already
        nn.BatchNorm2d(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    """
)

FIXED_LINES = ("# default bias", "# positional bias", "# multi-line", "# OrderedDict", "# transposed")


def expected_go401(source: str) -> list[tuple[str, int]]:
    # a finding is on the conv's first line: the multi-line conv starts two lines above its comment
    lines = [line(source, m) - (2 if m == "# multi-line" else 0) for m in FIXED_LINES]
    return [("GO401", n) for n in lines]


def test_go401_flags_a_biased_conv_right_before_a_batch_norm() -> None:
    assert found(BIASED, "GO401") == expected_go401(BIASED)
    findings = lint.check_source(BIASED, "train.py", select=["GO401"])
    assert all(f.fixable for f in findings)
    assert findings[-1].message.startswith("ConvTranspose2d with a bias feeds BatchNorm2d")
    assert "drop_conv_bias" in findings[0].why


def test_go401_ignores_convs_without_bias_not_before_batch_norm_or_outside_sequential() -> None:
    source = script(
        """
        class Net(nn.Module):
            def __init__(self, use_bias=False):
                super().__init__()
                self.conv = nn.Conv2d(3, 16, 3, padding=1)  # not in a Sequential: not checked
                self.bn = nn.BatchNorm2d(16)
                self.body = nn.Sequential(
                    nn.Conv2d(16, 16, 3, padding=1, bias=False),
                    nn.BatchNorm2d(16),
                    nn.Conv2d(16, 16, 3, padding=1, bias=use_bias),
                    nn.BatchNorm2d(16),
                    nn.Conv2d(16, 16, 3, padding=1),
                    nn.ReLU(),
                    nn.BatchNorm2d(16),
                    nn.Conv2d(16, 16, 3, padding=1),
                    nn.GroupNorm(4, 16),
                )

            def forward(self, x):
                return self.body(self.bn(self.conv(x))).mean((2, 3))


        model = Net()
        """
    )
    assert found(source, "GO401") == []


def run(source: str) -> dict[str, Any]:
    """The script's globals: it defines the model, train() is never called."""
    namespace: dict[str, Any] = {"__name__": "linted_script"}
    exec(compile(source, "train.py", "exec"), namespace)
    return namespace


def test_go401_fix_drops_the_biases_and_the_model_still_runs() -> None:
    fixed, remaining = lint.fix_source(BIASED, "train.py", select=["GO401"])
    assert remaining == []
    ast.parse(fixed)
    assert "nn.Conv2d(16, 32, 3, 1, 1, 1, 1, False)" in fixed
    assert "32, 32, 3, padding=1, bias=False\n" in fixed
    assert 'nn.Conv2d(32, 32, 1, bias=False)' in fixed

    original, model = run(BIASED)["model"], run(fixed)["model"]
    biased = [m for m in original.modules() if isinstance(m, nn.modules.conv._ConvNd) and m.bias is not None]
    left = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd) and m.bias is not None]
    assert len(biased) == 6 and len(left) == 1  # only the conv followed by a ReLU keeps its bias
    assert model[0].bias is None and model[3].bias is None and model[6].bias is None
    assert model[8].conv.bias is None and model[9].bias is None and model[11].bias is not None
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in original.parameters()) - (16 + 32 + 32 + 32 + 16)
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 10)

    again, still = lint.fix_source(fixed, "train.py", select=["GO401"])
    assert again == fixed and still == []


def test_go401_fix_keeps_odd_layouts_valid() -> None:
    source = script(
        """
        model = nn.Sequential(
            nn.Conv1d(
                8,
                8,
                3,  # a comment after the last argument
            ),
            nn.BatchNorm1d(8),
        )
        stages = {"étage": nn.Sequential(nn.Conv2d(8, 8, (3)), nn.BatchNorm2d(8))}  # non-ASCII, parenthesized
        """
    )
    assert found(source, "GO401") == [("GO401", line(source, "nn.Conv1d(")), ("GO401", line(source, "étage"))]
    fixed, remaining = lint.fix_source(source, "train.py", select=["GO401"])
    assert remaining == []
    assert "3, bias=False,  # a comment" in fixed
    assert 'nn.Conv2d(8, 8, (3), bias=False), nn.BatchNorm2d(8))}' in fixed
    namespace = run(fixed)
    assert namespace["model"][0].bias is None
    assert namespace["stages"]["étage"][0].bias is None


# --- GO402 channels-not-multiple-of-8 ---------------------------------------------------------

AMP_TRAINING = TRAINING.replace(
    "            F.cross_entropy(model(x), y).backward()",
    '            with torch.autocast("cuda", dtype=torch.bfloat16):\n'
    "                loss = F.cross_entropy(model(x), y)\n"
    "            loss.backward()",
)

ODD_MODEL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 30, 3, padding=1)  # stem
        self.body = nn.Conv2d(in_channels=30, out_channels=64, kernel_size=3)  # body
        self.mid = nn.Conv2d(64, 3, 1)  # to 3 channels
        self.back = nn.Conv2d(3, 64, 1)  # from 3 channels
        self.fc = nn.Linear(30 * 7 * 7, 100)  # fc
        self.head = nn.Linear(in_features=100, out_features=10)  # head
        self.ok = nn.Linear(64 * 4 * 4, 256)


class Grayscale(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(1, 32, 3)  # grayscale stem
        self.out = nn.Linear(32, 12)  # grayscale out


model = Net()
"""


def test_go402_names_the_sizes_that_are_not_multiples_of_8() -> None:
    source = script(ODD_MODEL, AMP_TRAINING.replace("batch_size=32", "batch_size=12"))
    assert found(source, "GO402") == [
        ("GO402", n) for n in sorted(line(source, marker) for marker in (
            "# stem", "# body", "# to 3 channels", "# from 3 channels", "# fc", "# head", "# grayscale out", "batch_size=12",
        ))
    ]
    messages = {f.line: f.message for f in lint.check_source(source, "train.py", select=["GO402"])}
    assert messages[line(source, "# stem")].startswith("Conv2d out_channels=30:")  # the image channels (3) are fine
    assert messages[line(source, "# body")].startswith("Conv2d in_channels=30:")
    assert messages[line(source, "# to 3 channels")].startswith("Conv2d out_channels=3:")
    assert messages[line(source, "# from 3 channels")].startswith("Conv2d in_channels=3:")  # not the first conv
    assert messages[line(source, "# fc")].startswith("Linear in_features=1470, out_features=100:")  # 30 * 7 * 7
    assert messages[line(source, "# head")].startswith("Linear in_features=100, out_features=10:")
    assert messages[line(source, "batch_size=12")].startswith("DataLoader batch_size=12 ")


def test_go402_needs_mixed_precision() -> None:
    source = script(ODD_MODEL, TRAINING.replace("batch_size=32", "batch_size=12"))
    assert found(source, "GO402") == []


def test_go402_accepts_multiples_of_8_and_sizes_it_cannot_know() -> None:
    source = script(
        """
        class Net(nn.Module):
            def __init__(self, width=30):
                super().__init__()
                self.stem = nn.Conv2d(3, 32, 3, padding=1)
                self.body = nn.Conv2d(32, width, 3)
                self.fc = nn.Linear(width * 7 * 7, 128)
                self.head = nn.Linear(128, 16)


        model = Net()
        """,
        AMP_TRAINING,
    )
    assert found(source, "GO402") == []

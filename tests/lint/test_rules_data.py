"""DataLoader rules (GO101-GO103): what they flag, what they leave alone, and their fixes."""

from __future__ import annotations

import textwrap
import warnings
from typing import Any

import pytest
import torch

from graphopt.lint import RULES, check_source, fix_source

DATA_CODES = ["GO101", "GO102", "GO103"]


def training_script(loader: str, device: str = 'torch.device("cuda" if torch.cuda.is_available() else "cpu")') -> str:
    """A small training script whose DataLoader (line 8) is ``loader``."""
    return textwrap.dedent(
        """\
        import torch
        from torch import nn
        from torch.utils import data
        from torch.utils.data import DataLoader, TensorDataset

        device = {device}
        dataset = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
        loader = {loader}
        model = nn.Linear(8, 2).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        for epoch in range(2):
            for inputs, targets in loader:
                inputs, targets = inputs.to(device), targets.to(device)
                loss = nn.functional.cross_entropy(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """
    ).format(loader=loader, device=device)


CPU = 'torch.device("cpu")'


def found(source: str, *codes: str) -> list[tuple[str, int]]:
    return [(f.code, f.line) for f in check_source(source, "train.py", select=list(codes))]


def fixable(source: str, *codes: str) -> list[bool]:
    return [f.fixable for f in check_source(source, "train.py", select=list(codes))]


# GO101 dataloader-workers


@pytest.mark.parametrize(
    "loader, line",
    [
        ("DataLoader(dataset, batch_size=16, shuffle=True)", 8),
        ("torch.utils.data.DataLoader(dataset, batch_size=16, num_workers=0)", 8),
        ("data.DataLoader(dataset, batch_size=16)", 8),
        ("DataLoader(dataset, 16, True, None, None, 0)", 8),  # num_workers passed by position
        ("DataLoader(\n    dataset,\n    batch_size=16,\n    num_workers=0,\n)", 11),  # reported at the 0
    ],
)
def test_go101_flags_loaders_that_load_in_the_training_process(loader: str, line: int) -> None:
    source = training_script(loader)
    assert found(source, "GO101") == [("GO101", line)]
    assert fixable(source, "GO101") == [False]


@pytest.mark.parametrize(
    "loader",
    [
        "DataLoader(dataset, batch_size=16, num_workers=4)",
        "DataLoader(dataset, batch_size=16, num_workers=os.cpu_count())",
        "DataLoader(dataset, 16, True, None, None, 8)",
        "DataLoader(dataset, **loader_options)",  # settings not visible: no guess
        "make_loader(dataset, batch_size=16)",
    ],
)
def test_go101_leaves_loaders_with_workers_alone(loader: str) -> None:
    assert found(training_script(loader), "GO101") == []


def test_go101_has_no_automatic_fix_and_points_to_the_tuner() -> None:
    source = training_script("DataLoader(dataset, batch_size=16)")
    fixed, remaining = fix_source(source, "train.py", select=["GO101"])
    assert fixed == source and [f.code for f in remaining] == ["GO101"]
    assert "tune_loader" in RULES["GO101"].fix and "4 per GPU" in RULES["GO101"].fix


# GO102 dataloader-pin-memory


@pytest.mark.parametrize(
    "loader, line",
    [
        ("DataLoader(dataset, batch_size=16, num_workers=4)", 8),
        ("DataLoader(dataset, batch_size=16, num_workers=4, pin_memory=False)", 8),
        ("DataLoader(\n    dataset,\n    batch_size=16,\n    pin_memory=False,\n)", 11),  # reported at the False
        ("DataLoader(dataset, 16, True, None, None, 4, None, False)", 8),
    ],
)
def test_go102_flags_unpinned_loaders_in_cuda_scripts(loader: str, line: int) -> None:
    source = training_script(loader)
    assert found(source, "GO102") == [("GO102", line)]
    assert fixable(source, "GO102") == [True]


@pytest.mark.parametrize(
    "loader, device",
    [
        ("DataLoader(dataset, batch_size=16, num_workers=4)", CPU),  # no CUDA anywhere: pinning buys nothing
        ("DataLoader(dataset, batch_size=16, num_workers=4, pin_memory=True)", "torch.device('cuda')"),
        ("DataLoader(dataset, batch_size=16, num_workers=4, pin_memory=args.pin_memory)", "torch.device('cuda')"),
        ("DataLoader(dataset, 16, True, None, None, 4, None, True)", "torch.device('cuda')"),
    ],
)
def test_go102_leaves_pinned_and_cpu_only_loaders_alone(loader: str, device: str) -> None:
    assert found(training_script(loader, device), "GO102") == []


@pytest.mark.parametrize(
    "loader, expected",
    [
        ("DataLoader(dataset, batch_size=16, num_workers=4)", "DataLoader(dataset, batch_size=16, num_workers=4, pin_memory=True)"),
        ("DataLoader(dataset, batch_size=16, num_workers=4,)", "DataLoader(dataset, batch_size=16, num_workers=4, pin_memory=True)"),
        ("DataLoader(dataset, batch_size=16, pin_memory=False)", "DataLoader(dataset, batch_size=16, pin_memory=True)"),
        ("DataLoader(dataset, 16, True, None, None, 4, None, False)", "DataLoader(dataset, 16, True, None, None, 4, None, True)"),
        ("DataLoader()", "DataLoader(pin_memory=True)"),
        (
            "DataLoader(\n    dataset,\n    batch_size=16,\n    num_workers=4,\n)",
            "DataLoader(\n    dataset,\n    batch_size=16,\n    num_workers=4,\n pin_memory=True)",
        ),
        (
            "DataLoader(dataset,\n           batch_size=16,\n           num_workers=4)",
            "DataLoader(dataset,\n           batch_size=16,\n           num_workers=4, pin_memory=True)",
        ),
    ],
)
def test_go102_fix_pins_memory_and_changes_nothing_else(loader: str, expected: str) -> None:
    source = training_script(loader)
    fixed, remaining = fix_source(source, "train.py", select=["GO102"])
    assert fixed == training_script(expected)
    compile(fixed, "train.py", "exec")
    assert remaining == []
    assert fix_source(fixed, "train.py", select=DATA_CODES)[0] == fixed  # a second run changes nothing


def test_go102_fixes_multi_line_calls_and_lines_with_non_ascii_text() -> None:
    # ")" on its own line without a trailing comma; ast columns in UTF-8 bytes after "î"
    for loader in [
        "DataLoader(\n    dataset,\n    batch_size=16\n)",
        'DataLoader(datasets["entraînement"], batch_size=16, num_workers=4)',
    ]:
        source = training_script(loader).replace("dataset = ", 'datasets = {"entraînement": None}\ndataset = ')
        fixed, remaining = fix_source(source, "train.py", select=["GO102"])
        compile(fixed, "train.py", "exec")
        assert [f.code for f in remaining] == [] and fixed.count("pin_memory=True") == 1
        assert fixed.replace(", pin_memory=True", "") == source


def _batches(source: str) -> list[list[torch.Tensor]]:
    namespace: dict[str, Any] = {}
    torch.manual_seed(0)
    loading = source.split("model = ")[0]  # the imports, the dataset and the loader
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory=True without an accelerator warns
        exec(compile(loading, "train.py", "exec"), namespace)
        return [list(batch) for batch in namespace["loader"]]


def test_go102_fix_keeps_the_batches() -> None:
    source = training_script("DataLoader(dataset, batch_size=16, shuffle=True)", "'cuda' if torch.cuda.is_available() else 'cpu'")
    fixed, _ = fix_source(source, "train.py", select=["GO102"])
    assert "pin_memory=True" in fixed
    before, after = _batches(source), _batches(fixed)
    assert len(before) == len(after) == 4
    for old, new in zip(before, after):
        assert all(torch.equal(a, b) for a, b in zip(old, new))


# GO103 dataloader-persistent-workers


@pytest.mark.parametrize(
    "loader, line",
    [
        ("DataLoader(dataset, batch_size=16, num_workers=4)", 8),
        ("DataLoader(dataset, batch_size=16, num_workers=os.cpu_count() // 2)", 8),
        ("DataLoader(dataset, 16, True, None, None, 2)", 8),
        ("DataLoader(\n    dataset,\n    num_workers=4,\n    persistent_workers=False,\n)", 11),  # at the False
    ],
)
def test_go103_flags_workers_restarted_every_epoch(loader: str, line: int) -> None:
    source = training_script(loader)
    assert found(source, "GO103") == [("GO103", line)]
    assert fixable(source, "GO103") == [False]  # persistent workers change what a seeded run draws
    assert fix_source(source, "train.py", select=["GO103"])[0] == source


@pytest.mark.parametrize(
    "loader",
    [
        "DataLoader(dataset, batch_size=16)",
        "DataLoader(dataset, batch_size=16, num_workers=0)",
        "DataLoader(dataset, batch_size=16, num_workers=4, persistent_workers=True)",
        "DataLoader(dataset, num_workers=workers, persistent_workers=workers > 0)",
        "DataLoader(dataset, num_workers=4, **options)",
    ],
)
def test_go103_leaves_persistent_or_worker_less_loaders_alone(loader: str) -> None:
    assert found(training_script(loader), "GO103") == []


def test_data_rules_together_on_train_and_validation_loaders() -> None:
    source = training_script(
        "DataLoader(dataset, batch_size=16, shuffle=True, num_workers=8)\n"
        "val_loader = torch.utils.data.DataLoader(dataset, batch_size=64)"
    )
    assert found(source, *DATA_CODES) == [("GO102", 8), ("GO103", 8), ("GO101", 9), ("GO102", 9)]
    fixed, remaining = fix_source(source, "train.py", select=DATA_CODES)
    assert fixed == training_script(
        "DataLoader(dataset, batch_size=16, shuffle=True, num_workers=8, pin_memory=True)\n"
        "val_loader = torch.utils.data.DataLoader(dataset, batch_size=64, pin_memory=True)"
    )
    assert [(f.code, f.line) for f in remaining] == [("GO103", 8), ("GO101", 9)]

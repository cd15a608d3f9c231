"""Progress: a status line on stderr while optimize works, when asked or on a terminal; silent otherwise."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt import cli, timing


def model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()


def test_progress_names_the_steps_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    graphopt.optimize(model(), torch.randn(2, 3, 8, 8), progress=True, memory_format="preserve")
    err = capsys.readouterr().err
    assert "graphopt capture" in err and "graphopt passes" in err and "fold_conv_bn" in err


def test_silent_when_not_a_terminal_or_when_told(capsys: pytest.CaptureFixture[str]) -> None:
    graphopt.optimize(model(), torch.randn(2, 3, 8, 8), memory_format="preserve")  # pytest's stderr is not a terminal
    graphopt.optimize(model(), torch.randn(2, 3, 8, 8), progress=False, memory_format="preserve")
    assert capsys.readouterr().err == ""


def test_tune_follows_the_setting(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        graphopt.tuning, "measure_latencies", lambda runs, budget_s: timing.Ranking.of({name: [1.0 + i] * timing.MIN_ROUNDS for i, name in enumerate(runs)})
    )
    graphopt.optimize(model(), torch.randn(2, 3, 8, 8), tune=True, progress=True)
    assert "graphopt tune: building" in capsys.readouterr().err


def test_a_progress_option_that_is_not_a_bool_is_refused() -> None:
    with pytest.raises(graphopt.InvalidOptionError, match="progress='yes': use True"):
        graphopt.optimize(model(), torch.randn(2, 3, 8, 8), progress="yes")


def test_on_a_terminal_by_default_and_the_command_line_can_turn_it_off(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    command = ["optimize", "graphopt.models:resnet_small", "--input", "2x3x32x32", "--memory-format", "preserve"]
    assert cli.main(command) == 0
    assert "graphopt passes" in capsys.readouterr().err
    assert cli.main([*command, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""

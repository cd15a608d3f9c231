"""The example scripts run as documented: examples/train_ddp.py under torchrun, two CPU processes (gloo)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphopt
from graphopt.models import resnet_small

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_ddp_runs_under_torchrun_on_cpu(tmp_path: Path) -> None:
    checkpoint = tmp_path / "resnet.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(REPO / "examples" / "train_ddp.py"),
        "--steps", "3", "--accumulation", "2", "--batch-size", "8", "--precision", "bf16", "--device", "cpu",
        "--checkpoint", str(checkpoint),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    output = run.stdout + run.stderr

    assert "mode: training" in output and "use_low_precision" in output and "to_channels_last" in output
    losses = [float(loss) for loss in re.findall(r"step +\d+ +epoch \d+ +loss (\S+)", run.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], run.stdout
    assert "Grad strides do not match bucket view strides" not in output
    assert "Traceback" not in output

    restored = resnet_small()
    restored.load_state_dict(torch.load(checkpoint))  # the original model's keys: a strict load


def test_train_ddp_follows_the_playbook() -> None:
    """graphopt's own training-script linter finds nothing to improve in the example."""
    path = REPO / "examples" / "train_ddp.py"
    assert graphopt.lint.check_source(path.read_text(), str(path)) == []

"""The notebooks in notebooks/ run top to bottom (they are saved without outputs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert [path.name for path in NOTEBOOKS] == ["01_quickstart.ipynb", "02_graph_diffs.ipynb", "03_onnx_export.ipynb", "04_save_and_deploy.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "save notebooks without outputs"
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    assert errors == []
    if path.stem == "01_quickstart":  # graphopt.diff(fast) shows the drawn graph, the folded BatchNorms marked removed
        pages = [output["data"]["text/html"] for cell in notebook.cells for output in cell.get("outputs", []) if "text/html" in output.get("data", {})]
        drawn = [page for page in pages if '<svg xmlns="http://www.w3.org/2000/svg" class="gd"' in page]
        assert drawn and '<g class="node removed" data-name="stem_bn">' in drawn[0] and "removed by fold_conv_bn" in drawn[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize(("uid", "root_option"), [("0", " --allow-root"), ("1000", "")])
def test_make_notebooks_allows_root_only_as_root(uid: str, root_option: str, tmp_path: Path) -> None:
    """Jupyter refuses to start as root without --allow-root; `make -n` prints the commands and runs none (nothing is
    installed), and a stand-in `id` first on PATH plays root or a user, whoever runs the tests."""
    fake_id = tmp_path / "id"
    fake_id.write_text(f"#!/bin/sh\necho {uid}\n")
    fake_id.chmod(0o755)
    environment = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    printed = subprocess.run(
        ["make", "-n", "notebooks", "JUPYTER_ARGS=--no-browser --ip=0.0.0.0"], cwd=ROOT, env=environment, capture_output=True, text=True, check=True
    ).stdout
    launch = [" ".join(line.split()) for line in printed.splitlines() if "jupyter lab" in line]
    assert launch == [f".venv/bin/jupyter lab notebooks/{root_option} --no-browser --ip=0.0.0.0"]

"""The notebooks in notebooks/ run top to bottom (they are saved without outputs)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


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

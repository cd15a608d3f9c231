"""The HTML diff of ResNet-50 in a real browser: headless Chromium renders it, a screenshot shows the drawing.

Skipped, with the reason, only where no Chromium is installed at all (``make test`` installs Debian's
Chromium where it runs as root with apt-get; elsewhere: apt-get install chromium, or set GRAPHOPT_BROWSER).
A Chromium that is installed but fails to start, or a missing Playwright (a test dependency), fails them
with the error: a broken browser must not pass for an absent one.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from PIL import Image

import graphopt
from graphopt import cli
from graphopt.browser import headless_page, installed_chromium
from graphopt.models import resnet50
from tests.conftest import measured_as

REMOVED_FILL, CHANGED_FILL = (0xF7, 0xC5, 0xC5), (0xFF, 0xF3, 0xB0)


def page_or_skip(stack: contextlib.ExitStack) -> Any:
    """A headless page held open by ``stack``; the test skipped only where no Chromium is installed at all.

    Where Playwright is missing, or an installed Chromium fails to start, the GraphoptError saying so fails the test.
    """
    if installed_chromium() is None:
        pytest.skip("no Chromium installed: apt-get install chromium (make test does, as root), `playwright install chromium`, or set GRAPHOPT_BROWSER")
    return stack.enter_context(headless_page(1400, 1000))


@pytest.mark.parametrize("breakage", ["playwright missing", "chromium exits 1"])
def test_a_browser_that_cannot_start_fails_the_screenshot_tests_rather_than_skipping(
    breakage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if breakage == "playwright missing":
        monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # import fails as if not installed
        expected = "need Playwright: pip install playwright"
    else:
        broken = tmp_path / "chromium"
        broken.write_text("#!/bin/sh\nexit 1\n")
        broken.chmod(0o755)
        monkeypatch.setenv("GRAPHOPT_BROWSER", str(broken))
        expected = f"the Chromium at {broken} could not start"
    with contextlib.ExitStack() as stack, pytest.raises(graphopt.GraphoptError, match=expected):
        try:
            page_or_skip(stack)
        except pytest.skip.Exception as skipped:
            pytest.fail(f"skipped where it must fail: {skipped.msg}")


def test_the_screenshot_tests_skip_where_no_chromium_is_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHOPT_BROWSER", raising=False)
    monkeypatch.setattr(graphopt.browser.shutil, "which", lambda name: None)  # no system Chromium
    monkeypatch.setenv("PLAYWRIGHT_BROWSERS_PATH", str(tmp_path))  # nor one Playwright downloaded
    with contextlib.ExitStack() as stack, pytest.raises(pytest.skip.Exception, match="no Chromium installed"):
        page_or_skip(stack)


@pytest.mark.slow
def test_resnet50_html_diff_renders_in_a_headless_browser(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        page = page_or_skip(stack)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)

        optimized = graphopt.optimize(resnet50().eval(), torch.randn(1, 3, 224, 224))
        whole = graphopt.diff(optimized)
        page.goto(whole.to_html(tmp_path / "resnet50.html").resolve().as_uri())

        drawings = page.locator("svg.gd")
        assert drawings.count() == 2  # folded, and every node (in a closed <details>)
        folded = drawings.nth(0)
        box = folded.bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 1000
        assert 20 <= folded.locator("g.node").count() <= graphopt.drawing.MAX_BOXES
        assert folded.locator("g.node.folded-changed").count() == 16  # the bottleneck blocks, each summed up
        assert folded.locator("g.node.removed").count() >= 1 and "removed by fold_conv_bn" in folded.text_content()

        page.locator("summary", has_text="every node").click()
        every = drawings.nth(1)
        drawn = len([n for n in whole.after if n.op != "get_attr"]) + len([n for n in whole.removed if n.op != "get_attr"])
        assert every.locator("g.node").count() == drawn and every.bounding_box()["height"] > 5000
        assert page.locator("details summary", has_text="layer1").count() == 1  # the side-by-side rows, by module

        picture = tmp_path / "resnet50.png"
        folded.screenshot(path=str(picture))
        assert errors == []
    colours = {colour for _, colour in Image.open(picture).convert("RGB").getcolors(maxcolors=1 << 20)}
    assert REMOVED_FILL in colours and CHANGED_FILL in colours  # drawn, not a blank page


@pytest.mark.slow
def test_the_docs_picture_is_what_make_docs_pictures_draws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README and notebook 02 show docs/graph-diff.png; the project's own command redraws it at the same size."""
    # the picture shows the measured passes kept (measured faster where it was drawn); timed here, a loaded machine
    # undoes some and draws another graph: every measured pass "measures" faster, as there (no test times anything)
    monkeypatch.setattr("graphopt.pipeline.compare_latency", lambda before, after, threshold, budget_s, asks: measured_as(2.0, 1.0, threshold))
    root = Path(__file__).resolve().parent.parent
    picture = root / "docs" / "graph-diff.png"
    assert "](docs/graph-diff.png)" in (root / "README.md").read_text()
    assert "](../docs/graph-diff.png)" in (root / "notebooks" / "02_graph_diffs.ipynb").read_text()
    recipe = next(line for line in (root / "Makefile").read_text().splitlines() if "--drawing docs/graph-diff.png" in line)
    argv = recipe.split("graphopt ", 1)[1].split(">")[0].split()
    redrawn = tmp_path / "graph-diff.png"
    argv[argv.index("docs/graph-diff.png")] = str(redrawn)
    with contextlib.ExitStack() as stack:
        page_or_skip(stack)  # the command would fail the same way without a browser
    assert cli.main(argv) == 0
    assert Image.open(redrawn).size == Image.open(picture).size  # the same layout: run `make docs-pictures` after a change


# JupyterLab 4.6's rules for HTML outputs that a diff must hold against (from its rendermime stylesheet)
JUPYTERLAB_RULES = """
.jp-RenderedHTMLCommon tbody tr:nth-child(odd) { background: #f5f5f5; }
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon th,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon tr { text-align: right; }
.jp-RenderedHTMLCommon img, .jp-RenderedHTMLCommon svg { max-width: 100%; height: auto; }
"""


@pytest.mark.slow
def test_the_html_diff_keeps_its_look_inside_jupyterlab_styles() -> None:
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.Conv2d(64, 64, 3), nn.BatchNorm2d(64)).eval()
    fold = graphopt.optimize(model, torch.randn(2, 3, 16, 16), memory_format="preserve").graphopt_report.diffs["fold_conv_bn"]
    with contextlib.ExitStack() as stack:
        page = page_or_skip(stack)
        page.set_viewport_size({"width": 400, "height": 800})  # narrower than the drawing
        page.set_content(f'<style>{JUPYTERLAB_RULES}</style><div class="jp-RenderedHTMLCommon">{fold._repr_html_()}</div>')
        removed_cell = page.locator("table.rows tr.removed td").first
        assert removed_cell.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(247, 197, 197)"
        assert removed_cell.evaluate("e => getComputedStyle(e).textAlign") == "left"
        drawing = page.locator("svg.gd").first
        assert drawing.bounding_box()["width"] == float(drawing.get_attribute("width")) > 400  # natural size, scrolled

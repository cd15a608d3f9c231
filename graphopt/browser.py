"""A headless browser for pictures of drawn diffs: Playwright driving Chromium.

The browser is the system's Chromium (Debian's ``chromium`` package, or ``GRAPHOPT_BROWSER``
naming an executable) or, failing that, the one ``playwright install chromium`` downloads.
Used to turn a drawing into a PNG (``Drawing.save("diff.png")``, ``graphopt diff --png``)
and by the screenshot test of the HTML diff.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from graphopt.errors import GraphoptError

_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# a closed network: no background connections, no component updates (see Chromium's --help)
_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_executable() -> str | None:
    """The system Chromium to drive, or None (Playwright then looks for its own)."""
    named = os.environ.get("GRAPHOPT_BROWSER")
    if named:
        return named
    return next((path for path in map(shutil.which, _CHROMIUM_NAMES) if path), None)


@contextmanager
def headless_page(width: int = 1280, height: int = 800) -> Iterator[Any]:
    """A page in headless Chromium; raises GraphoptError saying what to install where there is none."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError as error:
        raise GraphoptError("pictures of drawings need Playwright: pip install playwright (or graphopt[test])") from error
    executable = chromium_executable()
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=_FLAGS)
        except Error as error:
            raise GraphoptError(
                "no headless browser could start: install Chromium (apt-get install chromium, or `playwright install "
                f"chromium`), or set GRAPHOPT_BROWSER to a Chromium executable ({str(error).splitlines()[0]})"
            ) from error
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def screenshot_svg(page_html: str, destination: Path) -> Path:
    """Render a page in the browser and save its first SVG drawing as a PNG of the drawing's own size."""
    with headless_page() as page:
        page.set_content(page_html)
        page.locator("svg").first.screenshot(path=str(destination))
    return destination

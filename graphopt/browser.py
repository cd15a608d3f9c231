"""A headless browser for pictures of drawn diffs: Playwright driving Chromium.

The browser is the system's Chromium (Debian's ``chromium`` package, or ``GRAPHOPT_BROWSER``
naming an executable) or, failing that, the one ``playwright install chromium`` downloads.
Used to turn a drawing into a PNG (``Drawing.save("diff.png")``, ``graphopt diff --png``)
and by the screenshot test of the HTML diff, which `installed_chromium` tells whether there
is a browser to start at all.
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
    """The system Chromium to drive, or None (Playwright's own is then used, where it downloaded one)."""
    named = os.environ.get("GRAPHOPT_BROWSER")
    if named:
        return named
    return next((path for path in map(shutil.which, _CHROMIUM_NAMES) if path), None)


def _playwright() -> tuple[Any, type[Exception]]:
    """Playwright's ``sync_playwright`` and its ``Error``; raises GraphoptError saying what to install where it is missing."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError as error:
        raise GraphoptError("pictures of drawings need Playwright: pip install playwright (or graphopt[test])") from error
    return sync_playwright, Error


def _downloaded_chromium(playwright: Any) -> str | None:
    """The Chromium ``playwright install chromium`` downloaded, or None where it did not."""
    path = playwright.chromium.executable_path
    return path if os.path.exists(path) else None


def installed_chromium() -> str | None:
    """The Chromium `headless_page` starts (the system's, else Playwright's own), or None where neither is installed.

    Installed is not started: the screenshot tests skip only where this is None. Raises GraphoptError where Playwright
    is missing and there is no system Chromium."""
    system = chromium_executable()
    if system is not None:
        return system
    sync_playwright, _ = _playwright()
    with sync_playwright() as playwright:
        return _downloaded_chromium(playwright)


def _browser_output(error: Exception) -> str:
    """What the browser process wrote to stderr, from Playwright's launch error (its call log repeats each line)."""
    lines = [line.split("[err] ", 1)[1].strip() for line in str(error).splitlines() if "[err] " in line]
    return "; ".join(dict.fromkeys(line for line in lines if line))


@contextmanager
def headless_page(width: int = 1280, height: int = 800) -> Iterator[Any]:
    """A page in headless Chromium; raises GraphoptError saying what to install where there is none, and what went
    wrong where the installed one does not start."""
    sync_playwright, Error = _playwright()
    with sync_playwright() as playwright:
        executable = chromium_executable() or _downloaded_chromium(playwright)
        if executable is None:
            raise GraphoptError(
                "no Chromium installed: apt-get install chromium, or `playwright install chromium`, or set GRAPHOPT_BROWSER to a Chromium executable"
            )
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=_FLAGS)
        except Error as error:
            output = _browser_output(error)
            raise GraphoptError(
                f"the Chromium at {executable} could not start ({str(error).splitlines()[0]}"
                f"{f'; it wrote: {output}' if output else ''}): repair or reinstall it (apt-get install chromium, or "
                "`playwright install chromium`), or set GRAPHOPT_BROWSER to a Chromium executable that starts"
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

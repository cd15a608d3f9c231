"""Progress on a terminal for the steps of `optimize` that can take more than a few seconds.

Capture (each frontend tried), each pass with its verification, tune's candidates and
the compilation of fused regions show as one status line on stderr (tqdm), erased when
done. Silent when stderr is not a terminal (logs, CI, notebook cells) or with
``optimize(..., progress=False)``; ``progress=True`` shows it anyway.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

Item = TypeVar("Item")
_SHOWN: contextvars.ContextVar[bool | None] = contextvars.ContextVar("graphopt_progress", default=None)


@contextlib.contextmanager
def shown(progress: bool | None) -> Iterator[None]:
    """Within the block, show progress if ``progress`` (None: as an enclosing block says, else on a terminal only)."""
    if progress is None:
        yield
        return
    token = _SHOWN.set(progress)
    try:
        yield
    finally:
        _SHOWN.reset(token)


def steps(items: Iterable[Item], what: str, name: Callable[[Item], str] = str) -> Iterator[Item]:
    """``items``, with the status line ``graphopt <what>: <name(item)>`` while each one is worked on."""
    setting = _SHOWN.get()
    bar = tqdm(items, desc=f"graphopt {what}", disable=None if setting is None else not setting, leave=False, file=sys.stderr)
    try:
        for item in bar:
            bar.set_postfix_str(name(item))
            yield item
    finally:
        bar.close()

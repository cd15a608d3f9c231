"""Keep other libraries' internal notices, which users cannot act on, out of graphopt's output.

torch says some things from deep inside its own code while graphopt calls it: torch.fx deep-copies the
pytree specs of a torch.export graph, which builds torch's own deprecated ``LeafSpec`` (a ``FutureWarning``
on every capture and save), and the ONNX exporter logs that torchvision is missing each time it builds its
op registry; onnxruntime's quantizer advises its pre-processing (graph optimization, BatchNorm folding:
graphopt's passes have run) on every call; torch.export logs that it fixed a batch of 1 (graphopt's report
says so, with what to do). None names anything the user wrote, or says more than graphopt itself does. `foreign_notices_silenced` drops exactly
these notices, and only while graphopt's own public calls run (`graphopt.capture.one_at_a_time`): nothing
is filtered on import or process-wide, and every other warning or log record, graphopt's own included,
still reaches the user.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

# (category, pattern matching the start of the message) of warnings torch raises about its own code
FOREIGN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
)

# logger name -> pattern matching the start of the messages it logs about its own setup
FOREIGN_LOG_MESSAGES: dict[str, str] = {
    "torch.onnx._internal.exporter._registration": "torchvision is not installed",
    # onnxruntime's quantizer (the onnxruntime engine's int8), through the root logger, on every file it quantizes
    "root": "Please consider (to run )?pre-processing before quantization",
    # torch.export, on every capture of an example with a batch of 1: graphopt's report says so itself, with what to do
    "torch._export.non_strict_utils": r"dimension \S+ 0/1 specialized; Dim\.AUTO was specified along with a sample input with hint = 1",
}

# What the first import of torchao logs (transformers imports it while building a model, when it is installed):
# its extension modules built for another Python or for CUDA fail to load, and it registers enums torch now
# supports itself. graphopt's benchmarks drop these while they build Hugging Face models (`graphopt.bench.transformers`).
TORCHAO_IMPORT_MESSAGES: dict[str, str] = {
    "torchao": "Failed to load ",
    "torch.utils._pytree": r"<enum '\w+'> is an Enum subclass",
}


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with a match of ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


@contextlib.contextmanager
def log_messages_dropped(messages: dict[str, str]) -> Iterator[None]:
    """Inside, each logger named in ``messages`` drops the records whose message starts with a match of its
    pattern; other records pass. Filters on a logger see the records it logs itself, not its children's."""
    filters = [(logging.getLogger(name), _DropMessages(pattern)) for name, pattern in messages.items()]
    for logger, message_filter in filters:
        logger.addFilter(message_filter)
    try:
        yield
    finally:
        for logger, message_filter in filters:
            logger.removeFilter(message_filter)


@contextlib.contextmanager
def foreign_notices_silenced() -> Iterator[None]:
    """Inside, `FOREIGN_WARNINGS` and `FOREIGN_LOG_MESSAGES` are dropped; the filters are restored on exit.

    ``warnings.catch_warnings`` swaps process-wide state: graphopt's public calls already take turns
    (`graphopt.capture.one_at_a_time`), so two of them never interleave their filters."""
    with warnings.catch_warnings(), log_messages_dropped(FOREIGN_LOG_MESSAGES):
        for category, message in FOREIGN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield

"""Errors raised by graphopt.

Every error a user can provoke is a `GraphoptError` subclass whose message says what
was wrong and what to do about it. Subclasses also derive from the matching builtin
(`TypeError`, `ValueError`) so that generic handlers keep working.
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(__file__) + os.sep  # as the code objects of graphopt's modules name their files


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` pointing at the line outside graphopt that called it (the user's ``optimize(...)``), however
    deep in graphopt's stages the warning is raised."""
    frame, level = sys._getframe(1), 2  # level 1 is this function, 2 its caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def error_summary(error: BaseException) -> str:
    """An exception's type and the first line of its message, to quote in another message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


class GraphoptError(Exception):
    """Base class of every error graphopt raises on purpose."""


class InvalidModelError(GraphoptError, TypeError):
    """The object to optimize is not a usable `torch.nn.Module`."""


class InvalidInputsError(GraphoptError, ValueError):
    """The example inputs are of the wrong kind, or the model rejects them."""


class InputMismatchError(GraphoptError, ValueError):
    """An optimized module was called with inputs outside those it was captured and verified for."""


class InvalidOptionError(GraphoptError, ValueError):
    """An option has a value graphopt does not know (frontend, mode, ...)."""


class UnknownOptionError(InvalidOptionError, TypeError):
    """A function of graphopt's API was called with a keyword it does not take (a `TypeError`, as Python's own would be)."""


class UnknownPassError(InvalidOptionError):
    """A pass name given in `passes=` or `disable=` is not registered."""


class PassModeError(InvalidOptionError):
    """A pass was asked for in a mode it does not apply to (e.g. folding for training)."""


class CaptureError(GraphoptError):
    """No frontend could turn the model into a graph that matches eager execution."""

    def __init__(self, message: str, attempts: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.attempts = dict(attempts or {})


class VerificationError(GraphoptError):
    """A pass changed the model's outputs beyond the tolerance for their dtype."""

    def __init__(self, message: str, *, pass_name: str | None = None, max_error: float | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.pass_name = pass_name
        self.max_error = max_error
        self.reason = reason or message  # what failed, without the advice


class VerificationWarning(UserWarning):
    """A pass failed verification and was rolled back; the rest of the optimization stands."""


class CompileWarning(UserWarning):
    """What ran compiled where it was built cannot be compiled here (graphopt.load without a C++ compiler): it runs as ops."""


class SideEffectWarning(UserWarning):
    """forward() has Python side effects (print, writes to objects) that the optimized graph does not run."""


class ModeSwitchError(GraphoptError, RuntimeError):
    """An optimized module was switched to a mode (train/eval) or a dtype (``.double()``) its rewrites do not support."""


class CheckpointError(GraphoptError, ValueError):
    """A state dict does not fit the model it is loaded into or converted for."""


class ExportError(GraphoptError):
    """The model could not be exported to ONNX, or the file failed its checks."""


class SaveError(GraphoptError, ValueError):
    """An optimized module could not be written to a file (`graphopt.save`, `graphopt.package`)."""


class LoadError(GraphoptError, ValueError):
    """A file is missing, damaged, or not one `graphopt.load` reads."""


class ImportNotAllowedError(LoadError):
    """A saved module's inputs or outputs are classes of a module not imported yet, which `graphopt.load` imports only
    when allowed (``allow_import=True``): importing a module runs its code."""

    def __init__(self, message: str, *, modules: list[str], reason: str) -> None:
        super().__init__(message)
        self.modules = list(modules)
        self.reason = reason  # what is missing, without the advice (the command line gives its own)


class EngineError(GraphoptError, RuntimeError):
    """An engine (OpenVINO, onnxruntime, Inductor) is not installed, or could not take or run the graph."""

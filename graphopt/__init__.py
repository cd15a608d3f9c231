"""graphopt: make PyTorch models faster by rewriting their torch.fx graphs, verified.

    import graphopt
    fast = graphopt.optimize(model.eval(), (torch.randn(8, 3, 224, 224),))
    print(fast.graphopt_report)
"""

from graphopt import data, lint
from graphopt.api import optimize
from graphopt.backends.onnx_export import ExportReport
from graphopt.capture import capture
from graphopt.diff import GraphDiff, diff
from graphopt.errors import (
    CaptureError,
    CheckpointError,
    CompileWarning,
    ExportError,
    GraphoptError,
    InputMismatchError,
    InvalidInputsError,
    InvalidModelError,
    InvalidOptionError,
    LoadError,
    ModeSwitchError,
    PassModeError,
    SaveError,
    SideEffectWarning,
    UnknownPassError,
    VerificationError,
    VerificationWarning,
)
from graphopt.export import export_onnx
from graphopt.pipeline import list_passes
from graphopt.report import PassReport, Report
from graphopt.runtime import OptimizedModule
from graphopt.saving import load, package, save

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CheckpointError",
    "CompileWarning",
    "ExportError",
    "ExportReport",
    "GraphDiff",
    "GraphoptError",
    "InputMismatchError",
    "InvalidInputsError",
    "InvalidModelError",
    "InvalidOptionError",
    "LoadError",
    "ModeSwitchError",
    "OptimizedModule",
    "PassModeError",
    "PassReport",
    "Report",
    "SaveError",
    "SideEffectWarning",
    "UnknownPassError",
    "VerificationError",
    "VerificationWarning",
    "capture",
    "data",
    "diff",
    "export_onnx",
    "lint",
    "list_passes",
    "load",
    "optimize",
    "package",
    "save",
]

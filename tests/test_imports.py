"""`import graphopt` and the `graphopt` command's module leave the heavy optional packages unimported:
ONNX, onnxruntime and transformers load where they are used (an export, a Hugging Face model), not at startup; nor
does torch._dynamo (a second of startup), which torch.export's file reader pulls in only when a file is read."""

import subprocess
import sys

OPTIONAL = ("onnx", "onnxruntime", "onnxscript", "onnx_ir", "transformers", "matplotlib", "torch._dynamo")


def test_importing_graphopt_and_its_command_loads_no_optional_package() -> None:
    probe = f"import sys, graphopt, graphopt.cli; print(' '.join(name for name in {OPTIONAL!r} if name in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []

"""Final stages that turn the optimized graph into something other than a graph, and the engines it runs on.

- `graphopt.backends.fuse_compile`: compile pointwise regions, or the whole graph (``fuse=``);
- `graphopt.backends.onnx_export`: write and check an ONNX file (`graphopt.export_onnx`);
- the engines (``optimize(engine=...)``): one module each behind the interface of
  `graphopt.backends.engine`, registered here in `ENGINES`. Nothing else names an engine:
  the API, the tuner, saving and the CLI read this registry.
"""

from __future__ import annotations

import difflib

from graphopt.backends import inductor_engine, onnxruntime_engine, openvino_engine
from graphopt.backends.engine import EngineInfo, EngineInput, EngineRunner
from graphopt.errors import InvalidOptionError

PYTORCH = EngineInfo(
    "pytorch",
    "graphopt's own PyTorch runtime: the optimized graph with oneDNN kernels, layouts and precisions chosen by measurement",
    precisions=("fp32", "bf16", "fp16", "int8"),
    costs="no build beyond the passes; trains and runs on any device; saved as a torch.export archive",
)

# In the order tune tries them after the PyTorch engine (the default, and tune's reference).
ENGINES: dict[str, EngineInfo] = {info.name: info for info in (PYTORCH, openvino_engine.ENGINE, onnxruntime_engine.ENGINE, inductor_engine.ENGINE)}
DEFAULT_ENGINE = PYTORCH.name


def engine_info(name: object) -> EngineInfo:
    """The registry entry of ``name``; an unknown name raises `InvalidOptionError` with the close ones."""
    if isinstance(name, str) and name in ENGINES:
        return ENGINES[name]
    close = difflib.get_close_matches(str(name), ENGINES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise InvalidOptionError(f"unknown engine {name!r}{hint}: use one of {', '.join(map(repr, ENGINES))}")


__all__ = ["DEFAULT_ENGINE", "ENGINES", "EngineInfo", "EngineInput", "EngineRunner", "engine_info"]

"""The benchmark suite behind ``graphopt bench``: variants measured side by side, as ratios.

- `variants`: the ways of running a model (eager, graphopt presets, torch.compile,
  fx/jit optimize_for_inference, onnxruntime), one line each.
- `harness`: builds each variant, then times them interleaved in one process.
- `results`: the measurements, as JSON, markdown and a PNG plot.
- `models`: which models to run (reference, anchors, names, MODULE:FACTORY).
- `suite`: settings and the end-to-end run the command line calls.
- `generate` (``graphopt bench --generate``): language models' ``generate()``, time to first token and per new
  token, with its own rows (`generate_results`).
"""

from graphopt.bench.harness import BenchModel, Harness
from graphopt.bench.results import BenchResult, ModelResult, VariantResult
from graphopt.bench.suite import Settings, run_suite
from graphopt.bench.variants import Variant, VariantSkipped

__all__ = [
    "BenchModel",
    "BenchResult",
    "Harness",
    "ModelResult",
    "Settings",
    "Variant",
    "VariantResult",
    "VariantSkipped",
    "run_suite",
]

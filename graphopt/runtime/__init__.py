"""What an optimized model runs after `graphopt.optimize` returns.

- `graphopt.runtime.module`: `OptimizedModule`, the module handed back (input guard,
  autograd mode, mode switches, checkpoints in the original model's keys);
- `graphopt.runtime.onednn`: the oneDNN conv/linear modules with prepacked weights that
  `use_onednn_kernels` puts in the graph;
- `graphopt.runtime.portable`: the form those kernels take in a file (`graphopt.save`).

Nothing here imports a pass, the pipeline or the API: passes and backends build these
objects; these objects never plan anything.
"""

from graphopt.runtime.module import OptimizedModule, updates_state
from graphopt.runtime.int8 import int8_modules
from graphopt.runtime.onednn import OneDNNConv, OneDNNLinear, prepacked_modules

__all__ = ["OneDNNConv", "OneDNNLinear", "OptimizedModule", "int8_modules", "prepacked_modules", "updates_state"]

"""The pass contract: what a pass receives, what it returns, and how it ends.

A pass is a plain function ``(gm, ctx) -> PassResult``. It rewrites ``gm`` in place
(the pipeline owns a deep copy of the user's model), records every rewrite and every
rejected candidate with its reason in a `PassReport`, and calls `finish` once.
``PassResult`` keeps torch.fx.passes.infra's first two fields (graph_module, modified).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

import torch
import torch.fx as fx

from graphopt.ops import delete_attr, remove_dead_code
from graphopt.report import PassReport

Mode = Literal["inference", "training"]
MODES: tuple[Mode, ...] = ("inference", "training")
MIN_MEASURED_GAIN = 1.02  # a measured pass this much faster beyond the noise is clearly faster (settled, remembered)


@dataclass
class PassContext:
    """What a pass may know beyond the graph."""

    mode: Mode = "inference"
    example_inputs: tuple[Any, ...] = field(default_factory=tuple)
    keep_channels_last_outputs: bool = False  # to_channels_last: leave 4-D outputs in channels_last
    measure: bool = False  # undo a `measured` pass if the graph runs clearly slower with it
    remeasure: bool = False  # measure again instead of reusing a decision remembered on this machine (also GRAPHOPT_REMEASURE=1)
    precision: torch.dtype | None = None  # use_low_precision: the low dtype (bf16/fp16)
    low_precision_ops: frozenset[str] = frozenset()  # use_low_precision: op families run in `precision`
    fp32_ops: frozenset[str] = frozenset()  # use_low_precision: op families kept in fp32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the model runs: optimize(device=...)
    calibration: tuple[tuple[Any, ...], ...] = ()  # quantize_int8: forward()'s arguments for each calibration batch
    accuracy: float | None = None  # quantize_int8: the largest output error allowed, relative to the output's scale


class PassResult(NamedTuple):
    graph_module: fx.GraphModule
    modified: bool
    report: PassReport


PassFunction = Callable[[fx.GraphModule, PassContext], PassResult]


def finish(gm: fx.GraphModule, modified: bool, report: PassReport, dropped_attrs: Iterable[str] = ()) -> PassResult:
    """The one cleanup at the end of a pass: dead code, unused submodules and attributes, lint, recompile.

    ``dropped_attrs`` names stored tensors the pass stopped reading (e.g. a folded
    BatchNorm's statistics); each is deleted unless some node still reads it.
    """
    if modified:
        remove_dead_code(gm)
        still_read = {str(node.target) for node in gm.graph.nodes if node.op in ("get_attr", "call_module")}
        for target in dropped_attrs:
            owners = {target.rsplit(".", i)[0] for i in range(target.count(".") + 1)}
            if owners.isdisjoint(still_read):
                delete_attr(gm, target)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    report.modified = modified
    return PassResult(gm, modified, report)

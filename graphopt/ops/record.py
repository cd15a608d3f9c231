"""Running a graph on the example inputs to see what its nodes compute: `record`, `Recorder`, `interpreter_inputs`.

Passes that decide from real values (layouts, dtypes, what a fused kernel returns) run
the graph once, node by node. The run is isolated (`verify.isolated`: fixed RNG seed,
buffers restored, autograd off unless ``context`` turns it on) and reads the inputs as
``gm(*args)`` would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt import verify

# called after each node with the node, its result, and the values computed so far (the node's inputs among them)
NodeHook = Callable[[fx.Node, Any, Mapping[fx.Node, Any]], None]
RunContext = Callable[[], AbstractContextManager[Any]]  # the autograd mode of the run: torch.inference_mode, ...


def interpreter_inputs(gm: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The values of ``gm``'s placeholders for ``gm(*args)``: a torch.export module flattens its inputs."""
    return tuple(pytree.tree_leaves(args)) if getattr(gm, "_in_spec", None) is not None else args


class Recorder(fx.Interpreter):
    """Runs a graph on example inputs, calling ``on_node`` after each node.

    A pass that must change what a node computes (run it on converted inputs) subclasses
    this and overrides ``run_node``.
    """

    def __init__(self, gm: fx.GraphModule, on_node: NodeHook | None = None) -> None:
        super().__init__(gm)
        self.on_node = on_node

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if self.on_node is not None:
            self.on_node(n, result, self.env)
        return result

    def run_on(self, args: tuple[Any, ...], context: RunContext = contextlib.nullcontext) -> Any:
        """Run on ``args`` as ``gm(*args)`` would receive them, isolated, inside ``context()``; return the outputs."""
        with verify.isolated(self.module), context():
            return self.run(*interpreter_inputs(self.module, args))


def record(gm: fx.GraphModule, args: tuple[Any, ...], on_node: NodeHook | None = None, context: RunContext = contextlib.nullcontext) -> Any:
    """Run ``gm`` on ``args``, calling ``on_node(node, result, values)`` after each node; return the outputs."""
    return Recorder(gm, on_node).run_on(args, context)

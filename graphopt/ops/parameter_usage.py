"""`ParameterUsage`: who reads each stored tensor, so that a pass rewrites a parameter in place only when no other op reads it."""

from __future__ import annotations

import torch
import torch.fx as fx

from graphopt.ops.weighted import WeightedOpView

class ParameterUsage:
    """Who reads each stored tensor: tied parameters and reused modules block in-place rewrites."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self._names: dict[int, list[str]] = {}
        for name, tensor in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
            self._names.setdefault(id(tensor), []).append(name)
        self._reads: dict[str, int] = {}
        for node in gm.graph.nodes:
            # a stored tensor is read once per user of its get_attr nodes; a module once per call
            reads = len(node.users) if node.op == "get_attr" else 1 if node.op == "call_module" else 0
            if reads:
                self._reads[str(node.target)] = self._reads.get(str(node.target), 0) + reads

    def sharing(self, view: WeightedOpView) -> str | None:
        """Why ``view``'s parameters cannot be rewritten in place without affecting another op, or None."""
        if view.module is not None:
            calls = self._reads.get(str(view.node.target), 0)
            if calls > 1:
                return f"module '{view.node.target}' is called at {calls} places"
        for label, tensor, target in (("weight", view.weight, view.weight_target), ("bias", view.bias, view.bias_target)):
            if tensor is None or target is None:
                continue
            names = self._names.get(id(tensor), [])
            if len(names) > 1:
                others = ", ".join(n for n in names if n != target)
                return f"{label} '{target}' is tied to {others}"
            if view.module is None and self._reads.get(target, 0) > 1:
                return f"{label} '{target}' is also read by another op"
        return None

    def is_shared(self, tensor: torch.Tensor) -> bool:
        return len(self._names.get(id(tensor), [])) > 1

    def reads(self, target: str) -> int:
        """How many times the graph reads the stored tensor (or calls the module) at ``target``."""
        return self._reads.get(target, 0)

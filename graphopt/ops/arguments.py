"""A call's arguments by name, with the names read from the op itself rather than written out by hand.

An ATen overload names its arguments in its schema; a Python function (``F.relu``,
``F.batch_norm``) in its signature. Functions written in C (``torch.relu``,
``F.conv2d``) have no Python signature: the views name the ATen overload such a
function calls and read that schema.

An argument that is a constant in the op's signature (``eps``, ``p``, ``stride``,
``groups``, ``dim``...) may still be a graph value: fx keeps a number passed to
forward() as a placeholder, and a value computed from a shape is a node. Views read
such constants with `Arguments.not_constant` first: a graph value makes the view
unsupported, with the reason a pass records (``report.skip``), never a crash or a
guess from the example.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx


class Arguments:
    """Read and write a call's arguments by name, whether passed positionally or by keyword."""

    def __init__(self, node: fx.Node, names: tuple[str, ...], defaults: dict[str, Any]) -> None:
        self.node = node
        self.names = names
        self.defaults = defaults

    def get(self, name: str) -> Any:
        index = self.names.index(name)
        if index < len(self.node.args):
            return self.node.args[index]
        return self.node.kwargs.get(name, self.defaults.get(name))

    def not_constant(self, *names: str) -> str | None:
        """Why the op's constant arguments ``names`` cannot be read when optimizing: the first holding a graph value, else None.

        Names the op does not take are ignored (one list serves every overload of a family).
        """
        for name in names:
            if name in self.names:
                reason = not_constant(self.node, name, self.get(name))
                if reason is not None:
                    return reason
        return None

    def set(self, name: str, value: Any) -> None:
        index = self.names.index(name)
        if index < len(self.node.args):
            args = list(self.node.args)
            args[index] = value
            self.node.args = tuple(args)
        else:
            self.node.kwargs = {**self.node.kwargs, name: value}


def graph_values(value: Any) -> list[fx.Node]:
    """The graph values (fx nodes) in an argument: the argument itself, or items of its lists, tuples and dicts."""
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def not_constant(node: fx.Node, name: str, value: Any) -> str | None:
    """Why argument ``name`` (``value``) of ``node`` cannot be read when optimizing (it holds a graph value), else None."""
    sources = graph_values(value)
    if not sources:
        return None
    source = sources[0]
    origin = f"forward() argument '{source.target}'" if source.op == "placeholder" else f"computed in the graph ('{source.name}')"
    return f"the {name} argument of '{node.name}' is {origin}, not a constant: graphopt cannot read it when optimizing"


def argument_names(target: Any) -> tuple[str, ...]:
    """The names of ``target``'s arguments in order: an ATen overload's schema, a function's signature, else ()."""
    if isinstance(target, torch._ops.OpOverload):
        return tuple(argument.name for argument in target._schema.arguments)
    try:
        return tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # builtins such as torch.add have no Python signature
        return ()


def call_arguments(node: fx.Node, source: Any = None) -> Arguments:
    """Named access to ``node``'s arguments, named and defaulted as ``source`` declares them.

    ``source`` is an ATen overload (its schema) or a Python function (its signature); by
    default the node's own target.
    """
    source = node.target if source is None else source
    if isinstance(source, torch._ops.OpOverload):
        defaults = {a.name: a.default_value for a in source._schema.arguments if a.has_default_value()}
    else:
        parameters = inspect.signature(source).parameters.values()
        defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return Arguments(node, argument_names(source), defaults)

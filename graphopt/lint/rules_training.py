"""Lint rules on the training loop (GO3xx)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from graphopt.lint.core import Facts, Match, call_name, calls, is_constant, keyword, replace_node, rule


@rule(
    "GO301",
    "zero-grad-to-zero",
    "zero_grad(set_to_none=False) writes zeros into every gradient",
    "Setting gradients to None instead skips a memset per parameter and lets the next backward write "
    "instead of accumulate (the default since PyTorch 2.0).",
    "zero_grad() or zero_grad(set_to_none=True)",
)
def zero_grad_to_zero(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    for call in calls(tree):
        value = keyword(call, "set_to_none")
        if call_name(call).endswith("zero_grad") and is_constant(value, False):
            assert value is not None
            yield Match(call, edit=replace_node(value, "True"))

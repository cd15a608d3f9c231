"""Pytree leaves with their paths, for every type torch's pytree flattens.

``torch.utils._pytree.tree_flatten_with_path`` needs each container type registered with a
``flatten_with_keys_fn``. Libraries register their output classes with ``flatten_fn`` only
(transformers 5.5's ``ModelOutput`` classes, e.g. ``CausalLMOutputWithPast``), and then
``tree_flatten_with_path`` raises a raw ``ValueError`` ("Did not find a flatten_with_keys_fn")
although ``tree_flatten`` works. graphopt names outputs and inputs by their paths in reports,
errors and ONNX files; `leaves_with_paths` gives those paths for such types too: the
container's field names where its flatten context lists them, else positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils import _pytree as pytree

KeyPath = tuple[Any, ...]


def leaves_with_paths(tree: Any) -> list[tuple[KeyPath, Any]]:
    """``tree``'s pytree leaves, each with its key path (as ``tree_flatten_with_path`` gives them where it can)."""
    try:
        return pytree.tree_flatten_with_path(tree)[0]
    except ValueError:  # a container type registered without a flatten_with_keys_fn
        leaves, spec = pytree.tree_flatten(tree)
        return list(zip(_paths(spec, ()), leaves, strict=True))


def _paths(spec: pytree.TreeSpec, prefix: KeyPath) -> Iterator[KeyPath]:
    if spec.is_leaf():
        yield prefix
        return
    context = spec.context
    named = isinstance(context, (list, tuple)) and len(context) == spec.num_children and all(isinstance(key, str) for key in context)
    keys = [pytree.MappingKey(key) for key in context] if named else [pytree.SequenceKey(index) for index in range(spec.num_children)]
    children = spec.children() if hasattr(spec, "children") else spec.children_specs  # children_specs: torch < 2.9
    for key, child in zip(keys, children, strict=True):
        yield from _paths(child, (*prefix, key))

"""Dynamic dimensions: which input sizes an optimized graph may be called with other values of.

`graphopt.optimize`'s ``dynamic_shapes`` option, in torch.export's vocabulary:

- ``"batch+sequence"`` (the default): the batch dimension (dim 0 of the tensors whose first
  size is the example's batch size) and the sequence dimensions: every dimension after the
  first of integer and boolean inputs (token ids, attention masks, positions), and the
  dimensions of other inputs that have one of those sizes (a float attention mask). Image
  sizes stay fixed: a vision model usually serves one resolution, and layout and kernel
  choices are measured on it.
- ``"batch"``: the batch dimension only.
- ``"auto"``: every dimension of every tensor input, where the model allows it
  (``torch.export.Dim.AUTO`` on each).
- ``None``: every size fixed, as ``torch.export.export(..., dynamic_shapes=None)``.
- a dict by forward()'s parameter names, or a tuple by position, in torch.export's format
  (``{"input_ids": {1: torch.export.Dim("seq", max=512)}}``): handed to torch.export as it is.

That is a request (`requested`). A dimension becomes free in calls only when the captured
graph keeps it symbolic (`graph_dims`: torch.export specialises sizes the model's code ties
to a constant) and verification ran at a second size of it (`varied`): every other size
stays the example's, and a call at another size raises `InputMismatchError` naming the
option to use. Sizes of 0 and 1 other than the batch never vary (torch.export specialises them).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from graphopt.errors import InvalidOptionError
from graphopt.trees import leaves_with_paths

POLICIES = ("batch+sequence", "batch", "auto")
DEFAULT = "batch+sequence"

# For each pytree leaf of forward()'s positional arguments, in order: the dimensions that may vary.
Dims = tuple[frozenset[int], ...]


@dataclass(frozen=True)
class Request:
    """The dimensions asked to vary, and how torch.export is told."""

    dims: Dims
    export: tuple[Any, ...] | None  # torch.export's dynamic_shapes, one entry per positional argument
    names: tuple[str, ...]  # a name per leaf, e.g. "input_ids", "pair[0]"


def resolve(value: Any, dynamic_batch: bool) -> Any:
    """``dynamic_shapes`` given the older ``dynamic_batch`` switch (False is None); both given raises `InvalidOptionError`."""
    if dynamic_batch:
        return value
    if value != DEFAULT:
        raise InvalidOptionError("dynamic_batch=False contradicts dynamic_shapes: give dynamic_shapes only (None fixes every size)")
    return None


def request(value: Any, args: tuple[Any, ...], names: Sequence[str]) -> Request:
    """What ``dynamic_shapes=value`` asks for, for example inputs ``args`` (forward()'s ``names`` for them), checked."""
    check_dynamic_shapes(value, names)
    dims = requested(value, args, names)
    return Request(dims, export_spec(value, args, names, dims), tuple(leaf_names(args, names)))


def leaf_names(args: tuple[Any, ...], names: Sequence[str]) -> list[str]:
    """A name for each pytree leaf of ``args``: its argument's name (``names``), then its path, e.g. ``pair[0]``."""
    return [names[path[0].idx] + pytree.keystr(path[1:]) for path, _ in leaves_with_paths(args)]


def batch_size(args: tuple[Any, ...]) -> int | None:
    """The example's batch size: the first dimension of its first tensor of rank >= 1."""
    return next((leaf.shape[0] for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0), None)


def check_dynamic_shapes(value: Any, names: Sequence[str]) -> None:
    """Raise `InvalidOptionError` unless ``value`` is a policy, None or a torch.export spec for parameters in ``names``."""
    example = "{'input_ids': {1: torch.export.Dim.AUTO}}"
    if value is None or isinstance(value, (tuple, list)) or (isinstance(value, str) and value in POLICIES):
        return
    if isinstance(value, Mapping):
        unknown = [key for key in value if key not in names]
        if unknown:
            close = [difflib.get_close_matches(str(key), names, n=1, cutoff=0.5) for key in unknown]
            hint = "".join(f"; {key!r}: did you mean {match[0]!r}?" for key, match in zip(unknown, close, strict=True) if match)
            raise InvalidOptionError(
                f"dynamic_shapes names {', '.join(map(repr, unknown))}, which are not among the example inputs "
                f"({', '.join(names)}){hint}"
            )
        return
    raise InvalidOptionError(
        f"dynamic_shapes={value!r}: use {', '.join(map(repr, POLICIES))}, None (every size fixed) or torch.export's "
        f"format, e.g. {example}"
    )


def _is_dynamic(entry: Any) -> bool:
    """Whether one dimension's entry of a torch.export spec lets it vary (a ``Dim``, ``Dim.AUTO`` or ``Dim.DYNAMIC``)."""
    return entry is not None and not isinstance(entry, int) and entry is not torch.export.Dim.STATIC


def _spec_dims(spec: Any, arg: Any, where: str) -> list[frozenset[int]]:
    """The requested dimensions of each leaf of ``arg`` under its torch.export ``spec``."""
    if isinstance(arg, torch.Tensor):
        if spec is None:
            return [frozenset()]
        entries = spec.items() if isinstance(spec, Mapping) else enumerate(spec) if isinstance(spec, (tuple, list)) else None
        if entries is None:
            raise InvalidOptionError(f"dynamic_shapes for {where} is {spec!r}: give a dict {{dim: torch.export.Dim...}} or a list per dimension")
        dims = [dim for dim, entry in entries if _is_dynamic(entry)]
        if any(not -arg.dim() <= dim < arg.dim() for dim in dims):
            raise InvalidOptionError(f"dynamic_shapes for {where} names dimension {dims} of a tensor of shape {list(arg.shape)}")
        return [frozenset(dim % arg.dim() for dim in dims)]
    if isinstance(arg, (tuple, list)) and spec is not None:
        if not isinstance(spec, (tuple, list)) or len(spec) != len(arg):
            raise InvalidOptionError(f"dynamic_shapes for {where} must be a list of {len(arg)} entries, like the input")
        return [dims for index, (one, value) in enumerate(zip(spec, arg)) for dims in _spec_dims(one, value, f"{where}[{index}]")]
    if isinstance(arg, dict) and spec is not None:
        if not isinstance(spec, Mapping) or set(spec) != set(arg):
            raise InvalidOptionError(f"dynamic_shapes for {where} must be a dict with the input's keys {sorted(arg)}")
        return [dims for key, value in arg.items() for dims in _spec_dims(spec[key], value, f"{where}[{key!r}]")]
    return [frozenset() for _ in pytree.tree_leaves(arg)]


def _per_argument(value: Mapping[str, Any] | Sequence[Any], names: Sequence[str]) -> tuple[Any, ...]:
    """A user's torch.export spec as one entry per positional argument."""
    if isinstance(value, Mapping):
        return tuple(value.get(name) for name in names)
    if len(value) > len(names):
        raise InvalidOptionError(f"dynamic_shapes has {len(value)} entries for {len(names)} example inputs: give one per input")
    return (*value, *[None] * (len(names) - len(value)))


def requested(value: Any, args: tuple[Any, ...], names: Sequence[str]) -> Dims:
    """The dimensions ``dynamic_shapes=value`` asks to vary, per leaf of ``args`` (``names``: forward()'s names for them)."""
    leaves = pytree.tree_leaves(args)
    if value is None:
        return tuple(frozenset() for _ in leaves)
    if not isinstance(value, str):
        spec = _per_argument(value, names)
        return tuple(dims for name, one, arg in zip(names, spec, args) for dims in _spec_dims(one, arg, name))
    batch = batch_size(args)
    tokens = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and not leaf.is_complex()]
    sequence = {size for leaf in tokens for size in leaf.shape[1:] if size > 1}

    def dims(leaf: Any) -> frozenset[int]:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return frozenset()
        found = {0} if leaf.shape[0] == batch else set()
        if value == "auto":
            found |= {dim for dim, size in enumerate(leaf.shape) if size > 1}
        elif value == "batch+sequence":
            found |= {dim for dim, size in enumerate(leaf.shape) if dim > 0 and size in sequence}
        return frozenset(found)

    return tuple(dims(leaf) for leaf in leaves)


def export_spec(value: Any, args: tuple[Any, ...], names: Sequence[str], wanted: Dims) -> tuple[Any, ...] | None:
    """The ``dynamic_shapes`` to hand torch.export: the user's own spec, or ``Dim.AUTO`` on each ``wanted`` dimension."""
    if value is not None and not isinstance(value, str):
        return _per_argument(value, names)
    return auto_spec(args, wanted)


def auto_spec(args: tuple[Any, ...], dims: Dims) -> tuple[Any, ...] | None:
    """torch.export's ``dynamic_shapes`` with ``Dim.AUTO`` on each dimension of ``dims`` (None: all static)."""
    if not any(dims):
        return None
    leaf_dims = iter(dims)

    def spec(leaf: Any) -> Any:
        mine = next(leaf_dims)
        return {dim: torch.export.Dim.AUTO for dim in sorted(mine)} if isinstance(leaf, torch.Tensor) and mine else None

    return tuple(pytree.tree_map(spec, arg) for arg in args)


def graph_dims(gm: fx.GraphModule, args: tuple[Any, ...], wanted: Dims) -> Dims:
    """The ``wanted`` dimensions an exported graph keeps symbolic (the others it specialised); ``wanted`` for other graphs."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    leaves = pytree.tree_leaves(args)
    if len(placeholders) != len(leaves) or not any(isinstance(node.meta.get("val"), torch.Tensor) for node in placeholders):
        return wanted
    kept = []
    for node, dims in zip(placeholders, wanted, strict=True):
        value = node.meta.get("val")
        kept.append(frozenset(dim for dim in dims if isinstance(value, torch.Tensor) and not is_concrete_int(value.shape[dim])))
    return tuple(kept)


def varied(example: tuple[Any, ...], other: tuple[Any, ...]) -> Dims:
    """The dimensions where ``other`` (a verified second input) has another size than ``example``, per leaf."""
    return tuple(
        frozenset(dim for dim, (a, b) in enumerate(zip(one.shape, two.shape)) if a != b)
        if isinstance(one, torch.Tensor) and isinstance(two, torch.Tensor)
        else frozenset()
        for one, two in zip(pytree.tree_leaves(example), pytree.tree_leaves(other), strict=True)
    )


def other_size(size: int, batch: bool) -> int:
    """The size a second input takes instead of ``size``: the batch grows by one; other sizes keep their larger
    power-of-two factors (a patch or window size divides them still) and shrink, staying within a maximum length."""
    if batch:
        return size + 1 if size > 1 else 2
    step = min(size & -size, size // 2) or 1
    return size - step if size - step >= 2 else size + step


def second_sizes(args: tuple[Any, ...], dims: Dims) -> dict[int, int]:
    """Example size -> the second input's size, for the sizes of ``dims`` (dims of one size vary together: a
    sequence length shared by ids and mask stays shared)."""
    batch = batch_size(args)
    groups: dict[int, bool] = {}  # size -> whether only batch dimensions have it
    for leaf, mine in zip(pytree.tree_leaves(args), dims, strict=True):
        for dim in mine:
            size = leaf.shape[dim]
            groups[size] = groups.get(size, True) and dim == 0 and size == batch
    return {size: other_size(size, only_batch) for size, only_batch in groups.items()}


def describe(dims: Dims, names: Sequence[str]) -> str:
    """``dims`` in words, e.g. ``input_ids dims 0, 1; attention_mask dims 0, 1`` (``names`` per leaf)."""
    parts = [f"{name} dim{'s' if len(mine) > 1 else ''} {', '.join(map(str, sorted(mine)))}" for name, mine in zip(names, dims) if mine]
    return "; ".join(parts) or "none"

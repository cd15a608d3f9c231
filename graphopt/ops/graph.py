"""Editing a graph module: stored tensors by dotted path, dead code, in-place writes, inserted readers.

Also what every op view needs to read a node: the module it calls, its output's shape and
dtype, which of the three spellings it uses (`Form`, `form_of`) and whether it calls one
of a set of targets (`is_call_to`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn

aten = torch.ops.aten

Form = Literal["module", "function", "aten"]


# --------------------------------------------------------------------------- stored tensors


def get_attr(root: nn.Module, target: str) -> Any:
    """The object at dotted path ``target`` under ``root`` (a parameter, buffer or module)."""
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def set_attr(root: nn.Module, target: str, value: Any) -> None:
    """Store ``value`` at dotted path ``target`` (``nn.Module`` keeps a plain tensor stored as a buffer a buffer)."""
    owner_path, _, name = target.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    setattr(owner, name, value)


def delete_attr(root: nn.Module, target: str) -> None:
    """Remove the parameter or buffer at dotted path ``target``."""
    owner_path, _, name = target.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    delattr(owner, name)


def add_tensor(gm: fx.GraphModule, near: str, base_name: str, value: torch.Tensor, like: torch.Tensor) -> str:
    """Register ``value`` on the module owning ``near`` under a free name, in the role of ``like``.

    A parameter ``like`` makes a parameter (requiring grad as ``like`` does), otherwise a
    buffer. Returns the new attribute's dotted path.
    """
    owner_path, _, _ = near.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    name, suffix = base_name, 0
    while hasattr(owner, name):
        suffix += 1
        name = f"{base_name}_{suffix}"
    if isinstance(like, nn.Parameter):
        owner.register_parameter(name, nn.Parameter(value, requires_grad=like.requires_grad))
    else:
        owner.register_buffer(name, value)
    return f"{owner_path}.{name}" if owner_path else name


def replace_tensor(root: nn.Module, target: str, value: torch.Tensor) -> torch.Tensor:
    """Store ``value`` at ``target`` in the same role as the tensor it replaces; return what is stored.

    A parameter stays a parameter (requiring grad as before), a buffer stays a buffer.
    """
    current = get_attr(root, target)
    if isinstance(current, nn.Parameter):
        stored: torch.Tensor = nn.Parameter(value.detach().clone(), requires_grad=current.requires_grad)
    else:
        stored = value.detach().clone()
    set_attr(root, target, stored)
    return stored


def stored_tensor(gm: fx.GraphModule, arg: Any) -> tuple[torch.Tensor | None, str | None]:
    """A tensor argument's value and attribute path when it is a constant (get_attr), else (None, None)."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = get_attr(gm, str(arg.target))
        if isinstance(value, torch.Tensor):
            return value, str(arg.target)
    return None, None


# --------------------------------------------------------------------------- graph edits


def remove_dead_code(gm: fx.GraphModule) -> None:
    """Erase nodes whose results nothing uses, keeping side effects.

    ``call_module`` nodes stay even without users: a module may act through side
    effects (export's guard checks do), which fx's own purity test does not see; so do
    in-place calls such as ``y.mul_(2)`` (symbolic_trace records them as plain methods).
    """
    gm.graph.eliminate_dead_code(is_impure_node=lambda node: node.op == "call_module" or node.is_impure() or writes_in_place(gm, node))


# in-place in name only: they change autograd flags, not the data
_METADATA_ONLY = {"detach_", "requires_grad_", aten.detach_.default}


def writes_in_place(gm: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` overwrites the data of its first argument (``x.add_(1)``, ``nn.ReLU(inplace=True)``, ATen ``mul_``)."""
    if node.target in _METADATA_ONLY:
        return False
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")  # type: ignore[union-attr]
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target._schema.is_mutable
        name = getattr(node.target, "__name__", "")
        return bool(node.kwargs.get("inplace")) or (name.endswith("_") and not name.startswith("_"))
    return False


def insert_reader(gm: fx.GraphModule, value: fx.Node, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], readers: list[fx.Node], marker: str) -> fx.Node:
    """Insert ``value.<method>(*args, **kwargs)`` right after ``value`` and have ``readers`` read it instead.

    The new node copies ``value``'s metadata and is marked with ``node.meta[marker] = True``.
    """
    with gm.graph.inserting_after(value):
        node = gm.graph.call_method(method, (value, *args), kwargs)
    node.meta.update(value.meta)
    node.meta[marker] = True
    for reader in readers:
        reader.replace_input_with(value, node)
    return node


# --------------------------------------------------------------------------- reading nodes


def called_module(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The submodule a ``call_module`` node calls, else ``None``."""
    if node.op != "call_module":
        return None
    return gm.get_submodule(str(node.target))


def tensor_meta(node: fx.Node) -> tuple[torch.Size, torch.dtype] | None:
    """Shape and dtype of a node's output, from export's ``val`` or ShapeProp's ``tensor_meta``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.shape, val.dtype
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return meta.shape, meta.dtype
    return None


def form_of(node: fx.Node) -> Form:
    """The spelling a node uses: "aten" for torch.export's ATen ops, else "module"/"function"."""
    if node.op == "call_module":
        return "module"
    return "aten" if isinstance(node.target, torch._ops.OpOverload) else "function"


def is_call_to(gm: nn.Module, node: fx.Node, methods: Collection[str], targets: Collection[Any], modules: tuple[type, ...] = ()) -> bool:
    """Whether ``node`` calls one of ``methods``, one of ``targets`` (functions, ATen overloads) or an instance of ``modules``."""
    if node.op == "call_method":
        return node.target in methods
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_module" and modules:
        return isinstance(gm.get_submodule(str(node.target)), modules)
    return False

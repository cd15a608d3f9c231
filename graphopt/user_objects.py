"""The objects forward() of a model can reach from outside the call: a snapshot of them, to compare and to put back.

"Outside the call" means: each submodule's attributes that are not torch's own state
(parameters, buffers, submodules, hooks and ``training`` are left out), the globals and
closure variables that the methods of the model's classes refer to (and the functions of
the same file those refer to by name), and the lists, dicts, sets and deques these hold,
nested at any depth (followed breadth first, each once, until `_MAX_COPIED_ITEMS` items are
copied: cycles and huge containers end the walk, not Python's recursion limit).

`Snapshot` records them, says which changed and puts them back; `graphopt.side_effects` reports
the changes of a call with the user's lines (`watch_side_effects`) and puts them back
(`preserved_user_objects`). `is_user_file` says which code is the user's: the methods looked at
are those written there.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import reprlib
from dataclasses import dataclass, field
from types import CellType, CodeType, FunctionType
from typing import Any

import torch
import torch.nn as nn


# --- What counts as the user's code -------------------------------------------------------

_TORCH_DIRECTORY = os.path.dirname(torch.__file__) + os.sep
_GRAPHOPT_DIRECTORY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STANDARD_LIBRARY = os.path.dirname(os.__file__) + os.sep


@functools.lru_cache(maxsize=None)
def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's (third-party model code included), not torch's, graphopt's or Python's."""
    if filename.startswith(("<frozen ", "<eval_with_key>")):  # Python's frozen modules; the code fx generates
        return False
    if filename.startswith((_TORCH_DIRECTORY, _GRAPHOPT_DIRECTORY)):
        return False
    # Outside a virtual environment, site-packages lies inside the standard library's directory.
    parts = filename.split(os.sep)
    return not filename.startswith(_STANDARD_LIBRARY) or "site-packages" in parts or "dist-packages" in parts


# --- Objects outside the call: snapshot, compare, restore ---------------------------------

_TORCH_MODULE_KEYS = frozenset(vars(nn.Module()))  # parameters, buffers, submodules, hooks, training
# Exact types only: restoring goes through their own methods, which a subclass may forbid or change.
_CONTAINER_TYPES = frozenset({list, dict, set, collections.deque, collections.OrderedDict, collections.defaultdict, collections.Counter})
_MAX_COPIED_ITEMS = 100_000  # past this, nested containers are not looked into (the snapshot stays quick)


class _Missing:
    """The value of a name that is not bound."""


_MISSING = _Missing()


@dataclass(frozen=True)
class Origin:
    """A name outside the call: how to call it, and the functions that may change it (to find the line)."""

    kind: str  # "attribute" (of a module, reached as self.<name>), "global" or "closure variable"
    name: str
    owner: str  # for attributes: the module, e.g. "Counter" or "submodule 'blocks.0' (Block)"
    functions: tuple[FunctionType, ...]

    @property
    def expression(self) -> str:
        return f"self.{self.name}" if self.kind == "attribute" else self.name

    @property
    def suffix(self) -> str:
        return f" of {self.owner}" if self.kind == "attribute" else f" (a {self.kind})"


@dataclass
class _Binding:
    """A module attribute, global or closure variable, and its value when the snapshot was taken."""

    namespace: dict[str, Any] | CellType  # the module's __dict__, the globals, or the closure cell
    origin: Origin
    before: Any

    def now(self) -> Any:
        if isinstance(self.namespace, dict):
            return self.namespace.get(self.origin.name, _MISSING)
        try:
            return self.namespace.cell_contents
        except ValueError:  # an empty cell: the enclosing function has not assigned the variable yet
            return _MISSING

    def restore(self) -> None:
        if isinstance(self.namespace, dict):
            if self.before is _MISSING:
                self.namespace.pop(self.origin.name, None)
            else:
                self.namespace[self.origin.name] = self.before
        elif self.before is _MISSING:
            del self.namespace.cell_contents
        else:
            self.namespace.cell_contents = self.before

    def describe(self, now: Any) -> str:
        label = f"`{self.origin.expression}`{self.origin.suffix}"
        if self.before is _MISSING:
            return f"sets {label} (to {_short(now)})"
        if now is _MISSING:
            return f"deletes {label}"
        return f"changes {label} ({_short(self.before)} -> {_short(now)})"


@dataclass
class _Container:
    """A list, dict, set or deque outside the call, and its items when the snapshot was taken."""

    value: Any
    origin: Origin
    parent: _Container | None = None  # the container holding it, at ``key``; None: the value of ``origin``
    key: Any = None
    before: list[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.before = _items(self.value)

    @property
    def expression(self) -> str:
        """How forward() reaches it, e.g. "self.stats['calls']" (built on demand: nesting may be deep)."""
        keys = []
        container = self
        while container.parent is not None:
            keys.append(f"[{container.key!r}]")
            container = container.parent
        return container.origin.expression + "".join(reversed(keys))

    def changed(self) -> bool:
        now = _items(self.value)
        if isinstance(self.value, set):  # iteration order may change without any change of the set
            return {id(item) for item in now} != {id(item) for item in self.before}
        return not _identical(self.before, now)

    def restore(self) -> None:
        if isinstance(self.value, list):
            self.value[:] = self.before
            return
        self.value.clear()
        if isinstance(self.value, dict):
            for key, item in zip(self.before[::2], self.before[1::2]):  # one by one: Counter.update would add counts
                self.value[key] = item
        elif isinstance(self.value, set):
            self.value.update(self.before)
        else:
            self.value.extend(self.before)

    def describe(self) -> str:
        now = _items(self.value)
        if isinstance(self.value, set):
            verb = "adds to" if {id(item) for item in self.before} <= {id(item) for item in now} else "changes"
        elif isinstance(self.value, dict):
            verb = "writes into" if {id(key) for key in self.before[::2]} <= {id(key) for key in now[::2]} else "changes"
        else:
            verb = "appends to" if len(now) > len(self.before) and _identical(self.before, now[: len(self.before)]) else "changes"
        return f"{verb} the {type(self.value).__name__} `{self.expression}`{self.origin.suffix}"


def _items(container: Any) -> list[Any]:
    """The items of a container; a dict's as key, value, key, value, ..."""
    if isinstance(container, dict):
        return [part for pair in container.items() for part in pair]
    return list(container)


def _identical(before: list[Any], now: list[Any]) -> bool:
    # By identity: == on tensors is elementwise, and writing a new equal value is still a write.
    return len(before) == len(now) and all(old is new for old, new in zip(before, now))


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    return reprlib.repr(value)


class Snapshot:
    """Everything forward() of a model can reach from outside the call, as it is now."""

    def __init__(self, model: nn.Module, module_attributes: bool = True) -> None:
        self.bindings: list[_Binding] = []
        self.containers: list[_Container] = []
        self._modules: list[tuple[nn.Module, str, tuple[FunctionType, ...]]] = []
        self._watched_ids: set[int] = set()
        self._copied_items = 0
        functions_by_class: dict[type, tuple[FunctionType, ...]] = {}
        for path, module in model.named_modules():
            if type(module) not in functions_by_class:
                functions_by_class[type(module)] = _functions_of(type(module))
            functions = functions_by_class[type(module)]
            if not module_attributes:
                continue
            owner = f"submodule '{path}' ({type(module).__name__})" if path else type(module).__name__
            self._modules.append((module, owner, functions))
            for name in _user_attribute_names(module):
                self._watch_binding(vars(module), Origin("attribute", name, owner, functions))
        self.functions = _with_helpers([function for functions in functions_by_class.values() for function in functions])
        self._watch_globals(self.functions)
        self._watch_closures(self.functions)

    def container_ids(self) -> frozenset[int]:
        return frozenset(id(container.value) for container in self.containers)

    def restore(self) -> None:
        for container in self.containers:
            if container.changed():
                container.restore()
        for binding in self.all_bindings():
            if binding.now() is not binding.before:
                binding.restore()

    def all_bindings(self) -> list[_Binding]:
        """The bindings of the snapshot, and the module attributes set since (which were unset before)."""
        known = {(id(binding.namespace), binding.origin.name) for binding in self.bindings}
        new = [
            _Binding(vars(module), Origin("attribute", name, owner, functions), _MISSING)
            for module, owner, functions in self._modules
            for name in _user_attribute_names(module)
            if (id(vars(module)), name) not in known
        ]
        return self.bindings + new

    def _watch_binding(self, namespace: dict[str, Any] | CellType, origin: Origin) -> None:
        binding = _Binding(namespace, origin, _MISSING)
        binding.before = binding.now()
        self.bindings.append(binding)
        self._watch_containers(binding.before, origin)

    def _watch_containers(self, value: Any, origin: Origin) -> None:
        """Watch ``value`` if it is a container, and the containers nested in it, breadth first.

        A loop, not recursion: nesting deeper than Python's recursion limit is followed too.
        Each container is watched once (cycles end there), and once `_MAX_COPIED_ITEMS` items
        are copied, nested containers are no longer looked into.
        """
        if type(value) not in _CONTAINER_TYPES:
            return
        pending: collections.deque[tuple[Any, _Container | None, Any]] = collections.deque([(value, None, None)])
        while pending:
            value, parent, key = pending.popleft()
            if id(value) in self._watched_ids or (parent is not None and self._copied_items >= _MAX_COPIED_ITEMS):
                continue
            self._watched_ids.add(id(value))
            container = _Container(value, origin, parent, key)
            self.containers.append(container)
            self._copied_items += len(container.before)
            if self._copied_items < _MAX_COPIED_ITEMS and not isinstance(value, set):
                items = value.items() if isinstance(value, dict) else enumerate(value)
                pending.extend((item, container, key) for key, item in items if type(item) in _CONTAINER_TYPES)

    def _watch_globals(self, functions: list[FunctionType]) -> None:
        readers: dict[tuple[int, str], list[FunctionType]] = {}
        for function in functions:
            for name in _names_used(function.__code__):
                readers.setdefault((id(function.__globals__), name), []).append(function)
        for (_, name), functions_using in readers.items():
            self._watch_binding(functions_using[0].__globals__, Origin("global", name, "", tuple(functions_using)))

    def _watch_closures(self, functions: list[FunctionType]) -> None:
        readers: dict[int, tuple[CellType, str, list[FunctionType]]] = {}
        for function in functions:
            for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
                if name != "__class__":  # the cell behind super(): the class itself
                    readers.setdefault(id(cell), (cell, name, []))[2].append(function)
        for cell, name, functions_using in readers.values():
            self._watch_binding(cell, Origin("closure variable", name, "", tuple(functions_using)))


def _user_attribute_names(module: nn.Module) -> list[str]:
    return [name for name in vars(module) if name not in _TORCH_MODULE_KEYS]


def _plain_function(value: Any) -> FunctionType | None:
    """The Python function behind a method, static or class method, or a functools.wraps decorator."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if not isinstance(value, FunctionType):
        return None
    unwrapped = inspect.unwrap(value)  # e.g. forward decorated with @torch.no_grad()
    return unwrapped if isinstance(unwrapped, FunctionType) else value


def _functions_of(cls: type) -> tuple[FunctionType, ...]:
    """The methods of ``cls`` and its bases written in the user's code (torch's own are left out).

    ``__init__`` is left out: it ran before the call, and its ``self.calls = 0`` is not the line to report.
    """
    functions = []
    for klass in cls.__mro__:
        for attribute, value in vars(klass).items():
            function = _plain_function(value)
            if function is not None and attribute != "__init__" and is_user_file(function.__code__.co_filename):
                functions.append(function)
    return tuple(functions)


def _with_helpers(functions: list[FunctionType]) -> list[FunctionType]:
    """``functions`` and the functions of their own files that they refer to by name, transitively."""
    found = list(functions)
    codes = {function.__code__ for function in found}
    for function in found:  # grows while iterating: helpers of helpers
        for name in _names_used(function.__code__):
            helper = function.__globals__.get(name)
            if isinstance(helper, FunctionType) and helper.__globals__ is function.__globals__ and helper.__code__ not in codes:
                codes.add(helper.__code__)
                found.append(helper)
    return found


def _names_used(code: CodeType) -> set[str]:
    """Global and attribute names used by ``code`` and the functions, lambdas and comprehensions inside it."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            names |= _names_used(constant)
    return names

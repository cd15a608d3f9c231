"""Python side effects of forward(): find them in an eager call, and keep tracing from leaking into user objects.

A captured graph keeps only tensor operations. What else forward() does in Python (print,
logging, warnings, appending to a list that outlives the call, ``self.calls += 1``) runs
while graphopt calls forward() to capture it, and never when the optimized module runs.
`watch_side_effects` finds these in one eager call, each with the line of the user's code,
and `side_effects_message` tells the user what to do about them.

While fx or torch.export trace forward(), its values are symbolic (fx Proxies, SymInts,
FakeTensors): appended to the user's own list they would outlive the trace.
`preserved_user_objects` puts back everything forward() can reach from outside the call
(`graphopt.user_objects` says what that is: its `Snapshot` is what both context managers start from).

A container created during the call is never outside it: a local ``outs = []`` filled and then
concatenated is not a side effect. In-place updates of registered buffers are not side
effects either: the graph keeps them. A changed module attribute counts only when a line
of the user's code that ran sets it: torch's own hooks (pruning, spectral norm) set
``weight`` before each call.

The stored tensors forward() writes (`state_writes`) are no Python side effect, but they
are state that an engine holding its own copy of the weights cannot update.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import linecache
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch
import torch.nn as nn

from graphopt import verify
from graphopt.user_objects import Origin, Snapshot, is_user_file


@dataclass(frozen=True)
class SideEffect:
    """One thing forward() did in Python besides computing tensors."""

    what: str  # e.g. "appends to the list `history` (a global)"
    where: str = ""  # "path/file.py:12", the user's line; "" when no line could be found

    def __str__(self) -> str:
        return f"{self.where}: {self.what}" if self.where else self.what


@dataclass
class SideEffectWatch:
    """What `watch_side_effects` found: ``effects`` is filled when the ``with`` block ends."""

    effects: list[SideEffect] = field(default_factory=list)


@contextlib.contextmanager
def watch_side_effects(model: nn.Module) -> Iterator[SideEffectWatch]:
    """Watch the calls of ``model`` inside the block for Python side effects.

    ``with watch_side_effects(model) as watch: model(*args)``, then ``watch.effects``
    lists them in source order. Calls of print, ``sys.stdout/stderr`` writes, logging,
    ``warnings.warn`` and ``open`` count when made from the user's code, not from torch,
    graphopt or the standard library. A profile function set with ``sys.setprofile`` is
    suspended inside the block and put back afterwards; a profiler written in C (cProfile
    before Python 3.12) is left running, and then only changed objects are found, not calls.
    Nothing is undone: combine with `preserved_user_objects` (outside this block) for that.
    """
    snapshot = Snapshot(model)
    watch = SideEffectWatch()
    previous = sys.getprofile()
    # A C profiler shows up as an object that sys.setprofile could not reinstall.
    profiler = _Profiler(snapshot.container_ids()) if previous is None or callable(previous) else None
    if profiler is not None:
        sys.setprofile(profiler.on_event)
    try:
        yield watch
    finally:
        if profiler is not None:
            sys.setprofile(previous)
        effects = _changes(snapshot, profiler)
        if profiler is not None:
            effects += profiler.effects
        watch.effects = _in_source_order(effects)


@contextlib.contextmanager
def preserved_user_objects(model: nn.Module, module_attributes: bool = True) -> Iterator[None]:
    """Put back, when the block ends, whatever forward() of ``model`` changed outside the call.

    Lists, dicts, sets and deques get their items back in place (the same objects), and
    module attributes, globals and closure variables their values, so no fx Proxy, SymInt,
    FakeTensor or value appended while graphopt ran forward() stays in the user's objects.
    Tensors changed in place and objects reached only through other modules are not covered.
    ``module_attributes=False`` leaves ``model``'s own attributes alone: for graphopt's copy
    of a model, whose attributes are not the user's and which passes may change on purpose.
    """
    snapshot = Snapshot(model, module_attributes)
    try:
        yield
    finally:
        snapshot.restore()


_MAX_LISTED = 10


def side_effects_message(effects: Sequence[SideEffect], model_name: str = "The model") -> str:
    """A warning for the user about ``effects`` found in ``model_name``'s forward(); "" when there are none."""
    if not effects:
        return ""
    listed = [f"  - {effect}" for effect in effects[:_MAX_LISTED]]
    if len(effects) > _MAX_LISTED:
        listed.append(f"  - ... and {len(effects) - _MAX_LISTED} more")
    return (
        f"{model_name}'s forward() has Python side effects that the optimized module will not have:\n"
        + "\n".join(listed)
        + "\nThe optimized module runs only the tensor operations of the captured graph, so calling it will not "
        "print, log or change these objects. Move this code out of forward(), e.g. into a forward hook on the "
        "optimized module (optimized.register_forward_hook(...)) or into the loop that calls the model; or keep "
        "the original model where these effects matter."
    )


def state_writes(module: nn.Module, args: tuple[Any, ...]) -> list[str]:
    """The parameters and buffers that ``module(*args)`` writes, by name: in place, through a view, by ``copy_``
    (torch.export's form of ``self.steps += 1``) or by binding a new tensor; the buffers are put back afterwards.

    Found by the tensors' version counters, which every write bumps, so a write that leaves the values as they were
    (``self.mean.mul_(0.9)`` on zeros) counts too. Inference tensors have no version counter: nothing writes them
    outside inference mode.
    """
    stored = [(name, tensor) for name, tensor in [*module.named_parameters(), *module.named_buffers()] if not torch.is_inference(tensor)]
    versions = [tensor._version for _, tensor in stored]
    with verify.isolated(module), torch.no_grad():  # no_grad: a write to a parameter in place is allowed there, as in the engines' calls
        module(*args)
        now = dict([*module.named_parameters(), *module.named_buffers()])
        return [name for (name, tensor), version in zip(stored, versions, strict=True) if now.get(name) is not tensor or tensor._version != version]


# --- Calls that announce something: seen by a profile function ------------------------------

_ANNOUNCING_BUILTINS = {id(print): "calls print", id(warnings.warn): "calls warnings.warn", id(open): "opens a file"}


def _logging_functions() -> dict[CodeType, str]:
    """The code of each logging call (``logging.info``, ``Logger.info``, ``LoggerAdapter.info``, ...) -> its name."""
    functions = {}
    for owner in (logging, logging.Logger, logging.LoggerAdapter):
        # The aliases come first: in Python versions where they are the same function, the main name wins.
        for name in ("warn", "fatal", "debug", "info", "warning", "error", "exception", "critical", "log"):
            function = getattr(owner, name, None)  # warn and fatal are deprecated, maybe gone
            if isinstance(function, FunctionType):
                functions[function.__code__] = f"logging.{name}" if owner is logging else name
    return functions


_LOGGING_FUNCTIONS = _logging_functions()

_MUTATING_METHODS = frozenset(
    {
        *("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__", "__iadd__"),
        *("update", "setdefault", "popitem", "move_to_end", "subtract"),
        *("add", "discard", "difference_update", "intersection_update", "symmetric_difference_update"),
        *("appendleft", "extendleft", "popleft", "rotate"),
    }
)


class _Profiler:
    """The ``sys.setprofile`` function of `watch_side_effects`, `on_event`.

    It runs for every call and return, torch's ops included: most events cost two set
    lookups, and only calls that can matter are looked at further.
    """

    def __init__(self, container_ids: frozenset[int]) -> None:
        self.owner_ids = container_ids | {id(sys.stdout), id(sys.stderr)}  # whose methods matter
        self.effects: list[SideEffect] = []
        self.mutation_lines: dict[int, str] = {}  # id of a watched container -> first line that mutated it
        self.ran: set[CodeType] = set()  # the Python code that ran: where to look for lines

    def on_event(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            if id(arg) in _ANNOUNCING_BUILTINS or id(getattr(arg, "__self__", None)) in self.owner_ids:
                self._c_call(frame, arg)
        elif event == "call":
            self.ran.add(frame.f_code)
            if frame.f_code in _LOGGING_FUNCTIONS:
                self._logging_call(frame)

    def _c_call(self, frame: FrameType, function: Any) -> None:
        if not is_user_file(frame.f_code.co_filename):
            return
        where = _location(frame.f_code.co_filename, frame.f_lineno)
        owner = getattr(function, "__self__", None)  # a bound method such as history.append
        name = getattr(function, "__name__", "")
        if id(function) in _ANNOUNCING_BUILTINS:
            self.effects.append(SideEffect(_ANNOUNCING_BUILTINS[id(function)], where))
        elif owner is sys.stdout or owner is sys.stderr:
            if name in ("write", "writelines"):
                self.effects.append(SideEffect(f"writes to sys.{'stdout' if owner is sys.stdout else 'stderr'}", where))
        elif name in _MUTATING_METHODS:  # the owner is a watched container
            self.mutation_lines.setdefault(id(owner), where)

    def _logging_call(self, frame: FrameType) -> None:
        caller = frame.f_back
        if caller is None or not is_user_file(caller.f_code.co_filename):
            return  # e.g. logging.info() calling Logger.info(): the user's call is reported once
        logging_function = _LOGGING_FUNCTIONS[frame.f_code]
        if logging_function.startswith("logging."):
            what = f"logs with {logging_function}() (the root logger)"
        else:
            logger = frame.f_locals.get("self")
            what = f"logs with logger '{getattr(logger, 'name', '?')}' ({logging_function})"
        self.effects.append(SideEffect(what, _location(caller.f_code.co_filename, caller.f_lineno)))


# --- What changed outside the call, and the line that changed it ---------------------------

def _changes(snapshot: Snapshot, profiler: _Profiler | None) -> list[SideEffect]:
    """What changed since the snapshot, each with its line (the profiler's record says which code ran)."""
    ran = profiler.ran if profiler is not None else None
    mutation_lines = profiler.mutation_lines if profiler is not None else {}
    effects = []
    for binding in snapshot.all_bindings():
        now = binding.now()
        if now is binding.before:
            continue
        where = _find_line(binding.origin, ran, _rebinds)
        if not where and binding.origin.kind == "attribute":
            # Set from elsewhere: the user's code reaching the module otherwise (a parent's forward, a hook)
            # is found by the attribute's name; torch's hooks (pruning and spectral norm recompute `weight`
            # before each call) are not the user's Python, and are not reported.
            searched = _user_code(ran) if ran is not None else [function.__code__ for function in snapshot.functions]
            where = _line_setting_attribute(binding.origin.name, searched)
            if not where:
                continue
        effects.append(SideEffect(binding.describe(now), where))
    for container in snapshot.containers:
        if container.changed():
            origin = container.origin
            where = mutation_lines.get(id(container.value)) or _find_line(origin, ran, _mutates) or _find_line(origin, ran, _mentions)
            effects.append(SideEffect(container.describe(), where))
    return effects


# --- Finding the line: the source of the functions that ran -------------------------------

_Matcher = Callable[[ast.AST], bool]
_Definition = ast.FunctionDef | ast.AsyncFunctionDef


def _location(filename: str, line: int) -> str:
    here = os.getcwd() + os.sep
    return f"{filename.removeprefix(here)}:{line}"


def _find_line(origin: Origin, ran: set[CodeType] | None, matches: Callable[[ast.AST, _Matcher], bool]) -> str:
    """The first line of ``origin``'s functions (those that ran, when known) where ``matches`` holds; "" if none."""
    for function in origin.functions:
        definition = _definition(function.__code__) if ran is None or function.__code__ in ran else None
        if definition is not None:
            is_name = _name_matcher(origin, definition)
            lines = [node.lineno for node in ast.walk(definition) if matches(node, is_name)]
            if lines:
                return _location(function.__code__.co_filename, min(lines))
    return ""


def _line_setting_attribute(name: str, codes: Iterable[CodeType]) -> str:
    """The first line in ``codes`` that sets or deletes an attribute ``name`` of anything (``self.counter.calls += 1``)."""
    for code in codes:
        definition = _definition(code)
        if definition is not None:
            lines = [
                node.lineno
                for node in ast.walk(definition)
                if isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, (ast.Store, ast.Del))
            ]
            if lines:
                return _location(code.co_filename, min(lines))
    return ""


def _user_code(ran: set[CodeType]) -> list[CodeType]:
    return sorted((code for code in ran if is_user_file(code.co_filename)), key=lambda code: (code.co_filename, code.co_firstlineno))


def _rebinds(node: ast.AST, is_name: _Matcher) -> bool:
    """``self.calls = ...``, ``self.calls += 1``, ``del self.cache``, ``counter = ...`` (under ``global``)."""
    return isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del)) and is_name(node)


def _mutates(node: ast.AST, is_name: _Matcher) -> bool:
    """``history.append(x)``, ``self.seen[k] = v``, ``del self.seen[k]``, ``self.stats['n'] += 1``."""
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATING_METHODS and _reaches(node.func.value, is_name)
    if isinstance(node, ast.AugAssign):
        return _reaches(node.target, is_name)
    if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return _reaches(node.value, is_name)
    return False


def _mentions(node: ast.AST, is_name: _Matcher) -> bool:
    """Any use, when no line changes it visibly: ``heapq.heappush(self.heap, x)``."""
    return is_name(node)


def _reaches(node: ast.AST, is_name: _Matcher) -> bool:
    """Whether ``node`` is the name, or an item or attribute of it (``self.stats['calls']``)."""
    while not is_name(node):
        if not isinstance(node, (ast.Subscript, ast.Attribute)):
            return False
        node = node.value
    return True


def _name_matcher(origin: Origin, definition: _Definition) -> _Matcher:
    if origin.kind != "attribute":
        return lambda node: isinstance(node, ast.Name) and node.id == origin.name
    arguments = [*definition.args.posonlyargs, *definition.args.args]
    self_name = arguments[0].arg if arguments else None
    return lambda node: (
        isinstance(node, ast.Attribute) and node.attr == origin.name and isinstance(node.value, ast.Name) and node.value.id == self_name
    )


def _definition(code: CodeType) -> _Definition | None:
    """The ``def`` of ``code`` in its file's syntax tree (lines numbered as in the file)."""
    # linecache is what inspect.getsourcelines reads: files, and notebook cells registered by IPython.
    return _definitions("".join(linecache.getlines(code.co_filename))).get((code.co_name, code.co_firstlineno))


@functools.lru_cache(maxsize=16)
def _definitions(source: str) -> dict[tuple[str, int], _Definition]:
    """Each ``def`` of ``source`` by (name, first line), the line of its first decorator as in ``co_firstlineno``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # the file changed since it was imported, or is not Python
        return {}
    return {
        (node.name, min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])): node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _in_source_order(effects: Iterable[SideEffect]) -> list[SideEffect]:
    """Without repeats (a print in a loop is one effect), sorted by file and line; those without a line last."""

    def position(effect: SideEffect) -> tuple[bool, str, int]:
        filename, _, line = effect.where.rpartition(":")
        return (not effect.where, filename, int(line) if line.isdigit() else 0)

    return sorted(dict.fromkeys(effects), key=position)

"""The inputs an optimized graph is checked on, and the calls it accepts.

A rewrite must be right for every input the optimized graph accepts, not only for the
example it was planned on. `other_inputs` makes candidates for a second, independent
check: other sizes of the dimensions that may vary (`graphopt.dynamic`), fresh values
(resampled from the example's own values, so integer ids, masks and value ranges stay
valid) and other strides (channels_last for 4-D/5-D tensors, transposed storage for
2-D/3-D, a strided view for 1-D). The caller keeps the first candidate the original
model accepts.

`InputSignature` is what the optimized module then accepts: per tensor input its dtype,
device, rank and sizes, each size fixed to the example's unless it was verified to vary
(at a second size). A call outside it raises `InputMismatchError` naming the input,
what the graph accepts and how to optimize for it, instead of a guard failure deep in
torch or, worse, a wrong result. A call that leaves out an argument gets forward()'s
default, as in eager, or `InputMismatchError` where the graph cannot compute with it:
never the example's value.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt.dynamic import Dims, batch_size, leaf_names, second_sizes
from graphopt.errors import InputMismatchError

SEED = 1


def positional_parameters(signature: inspect.Signature) -> list[inspect.Parameter]:
    """The parameters of ``signature`` that can be given by position, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [parameter for parameter in signature.parameters.values() if parameter.kind in kinds]


def positional_arguments(
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    length: int | None = None,
    parameters: list[inspect.Parameter] | None = None,
) -> tuple[Any, ...]:
    """A call ``(*args, **kwargs)`` of ``signature`` as positional arguments: named ones in their places, skipped ones at their defaults.

    ``length``: how many arguments to return (those of the example); None: up to the last one
    given. ``parameters``: `positional_parameters` of ``signature``, when the caller keeps them.
    Raises `TypeError` for a call the signature does not take, or that names a keyword-only
    parameter or one beyond ``length`` (a graph takes positional inputs).
    """
    bound = signature.bind(*args, **kwargs)
    parameters = positional_parameters(signature) if parameters is None else parameters
    positional = {parameter.name for parameter in parameters}
    others = [name for name in bound.arguments if name not in positional]
    if others:
        raise TypeError(f"{', '.join(others)} cannot be given: only forward()'s positional-or-keyword parameters can")
    given = [index for index, parameter in enumerate(parameters) if parameter.name in bound.arguments]
    count = (given[-1] + 1 if given else 0) if length is None else length
    beyond = [parameters[index].name for index in given if index >= count]
    if beyond:
        raise TypeError(f"{', '.join(beyond)} was not among the example inputs: optimize with example inputs that include it")
    return tuple(bound.arguments.get(parameter.name, parameter.default) for parameter in parameters[:count])


def did_you_mean(unknown: Sequence[str], names: Sequence[str]) -> str:
    """``"; 'attention_maks': did you mean 'attention_mask'?"`` for each name of ``unknown`` close to one of ``names`` ('' when none is)."""
    close = [difflib.get_close_matches(name, names, n=1) for name in unknown]
    return "".join(f"; {name!r}: did you mean {match[0]!r}?" for name, match in zip(unknown, close, strict=True) if match)


def keyword_names(signature: inspect.Signature) -> list[str]:
    """The parameters of ``signature`` a call can name (not ``*args``/``**kwargs``)."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [parameter.name for parameter in signature.parameters.values() if parameter.kind not in variadic]


@dataclass
class OtherInputs:
    """A candidate second input and how it differs from the example."""

    args: tuple[Any, ...]
    description: str


def describe_leaf(leaf: Any) -> str:
    """A tensor as ``Tensor[8, 3, 224, 224] float32 cpu``, anything else as its type's name."""
    if isinstance(leaf, torch.Tensor):
        return f"Tensor{list(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')} {leaf.device}"
    return type(leaf).__name__


def describe_value(value: Any) -> str:
    """``value`` for an error message: tensors (also inside containers) described, never their values; other values by repr."""
    if isinstance(value, torch.Tensor):
        return describe_leaf(value)
    return describe_inputs(value) if holds_tensor(value) else repr(value)


def describe_inputs(args: tuple[Any, ...]) -> str:
    """A short summary such as ``(Tensor[8, 3, 224, 224] float32 cpu, int)``."""
    return "(" + ", ".join(describe_leaf(leaf) for leaf in pytree.tree_leaves(args)) + ")"


def holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or a container holding one."""
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def copied_inputs(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every tensor copied (other values shared): a run on the copy cannot write the caller's tensors.

    `copy.deepcopy` with one memo keeps strides and the aliasing between inputs (views of
    one tensor stay views of one copy); it refuses tensors computed with autograd, which are
    cloned.
    """
    memo: dict[int, Any] = {}

    def copied(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return copy.deepcopy(leaf, memo) if leaf.is_leaf else leaf.detach().clone().requires_grad_(leaf.requires_grad)

    return pytree.tree_map(copied, args)


def at_batch_size(args: tuple[Any, ...], size: int) -> tuple[Any, ...]:
    """``args`` with ``size`` rows in the batch dimension (dim 0 of each tensor whose first size is the example's batch,
    as `graphopt.dynamic` counts it): the example's rows repeated in turn, or its first ``size``; other values shared."""
    batch = batch_size(args)

    def resized(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != batch:
            return leaf
        return leaf.detach()[torch.arange(size, device=leaf.device) % batch].requires_grad_(leaf.requires_grad)

    return pytree.tree_map(resized, args)


def _other_layout(shape: tuple[int, ...], example: torch.Tensor) -> tuple[torch.Tensor, str]:
    """An empty tensor of ``shape`` laid out unlike ``example`` (the layout's name)."""
    make = dict(dtype=example.dtype, device=example.device)
    if len(shape) in (4, 5):
        channels_last = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        if example.is_contiguous(memory_format=channels_last) and not example.is_contiguous():
            return torch.empty(shape, **make), "contiguous"
        return torch.empty(shape, **make, memory_format=channels_last), "channels_last"
    if len(shape) in (2, 3):
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return torch.empty(swapped, **make).transpose(-1, -2), "transposed"
    if len(shape) == 1:
        return torch.empty(2 * shape[0], **make)[::2], "strided"
    return torch.empty(shape, **make), "contiguous"


def _fresh(example: torch.Tensor, shape: tuple[int, ...], strided: bool, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """A tensor of ``shape`` with values drawn from ``example``'s, in another layout when ``strided``."""
    flat = example.detach().reshape(-1)
    if flat.numel():
        picks = torch.randint(flat.numel(), (math.prod(shape),), generator=generator).to(flat.device)
        out, layout = flat[picks].reshape(shape), "contiguous"
    else:
        out, layout = torch.zeros(shape, dtype=example.dtype, device=example.device), "contiguous"
    if strided:
        values = out
        out, layout = _other_layout(shape, example)
        out.copy_(values)
    if example.requires_grad:
        out.requires_grad_(True)
    return out, layout


def other_inputs(args: tuple[Any, ...], dims: Dims, strided: bool) -> OtherInputs:
    """A candidate second input with the sizes of ``dims`` varied (`dynamic.second_sizes`), in other strides when ``strided``."""
    sizes = second_sizes(args, dims)
    batch = batch_size(args)
    batch_varies = any(0 in mine and leaf.shape[0] == batch for leaf, mine in zip(pytree.tree_leaves(args), dims, strict=True))
    changes = [f"batch {sizes[batch]} (example: {batch})" if batch_varies and batch is not None else "the example's batch size"]
    changes += [f"size {new} (example: {old})" for old, new in sizes.items() if old != batch or not batch_varies]
    generator = torch.Generator().manual_seed(SEED)
    layouts: list[str] = []
    leaf_dims = iter(dims)

    def remake(leaf: Any) -> Any:
        mine = next(leaf_dims)
        if not isinstance(leaf, torch.Tensor):
            return leaf
        shape = tuple(sizes[size] if dim in mine else size for dim, size in enumerate(leaf.shape))
        tensor, layout = _fresh(leaf, shape, strided, generator)
        layouts.append(layout)
        return tensor

    made = pytree.tree_map(remake, args)
    strides = ", ".join(sorted(set(layouts) - {"contiguous"})) or "contiguous"
    return OtherInputs(made, f"{', '.join(changes)}, values resampled from the example's, {strides} strides")


@dataclass(frozen=True)
class TensorSpec:
    """What the graph accepts for one tensor input: sizes of None vary."""

    name: str
    dtype: torch.dtype
    device: torch.device
    sizes: tuple[int | None, ...]
    example: tuple[int, ...] = ()  # the example's sizes (a file is exported at them)
    fixed: tuple[tuple[int, int], ...] = field(init=False, repr=False)  # (dim, size) of each fixed size, for `fits`

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", tuple((dim, size) for dim, size in enumerate(self.sizes) if size is not None))

    def fits(self, value: Any) -> bool:
        """Whether ``value`` is accepted: the check run on every call, kept to plain comparisons."""
        if not isinstance(value, torch.Tensor) or value.dtype != self.dtype or value.device != self.device or value.dim() != len(self.sizes):
            return False
        shape = value.shape
        return all(shape[dim] == size for dim, size in self.fixed)

    def other_sizes(self, value: Any) -> list[int]:
        """The fixed dimensions where ``value``, a tensor of the right dtype, device and rank, has another size."""
        if not isinstance(value, torch.Tensor) or (value.dtype, value.device, value.dim()) != (self.dtype, self.device, len(self.sizes)):
            return []
        return [dim for dim, size in self.fixed if value.shape[dim] != size]

    def accepted(self) -> str:
        sizes = ", ".join("*" if size is None else str(size) for size in self.sizes)
        return f"Tensor[{sizes}] {str(self.dtype).removeprefix('torch.')} on {self.device}"

    def mismatch(self, value: Any) -> str | None:
        """What is wrong with ``value``, for the error message (None: nothing)."""
        if not isinstance(value, torch.Tensor):
            return f"is a {type(value).__name__}, not a tensor"
        if value.dtype != self.dtype:
            return f"has dtype {str(value.dtype).removeprefix('torch.')}"
        if value.device != self.device:
            return f"is on {value.device}"
        if value.dim() != len(self.sizes):
            return f"has {value.dim()} dimensions ({list(value.shape)})"
        if any(size is not None and size != actual for size, actual in zip(self.sizes, value.shape)):
            return f"has shape {list(value.shape)}"
        return None


def unread_arguments(gm: fx.GraphModule, args: tuple[Any, ...], names: Sequence[str]) -> frozenset[str]:
    """The arguments without tensors that ``gm``, traced by symbolic_trace, takes but never reads.

    symbolic_trace went past them with the example's value (``if normalize is True:`` on a
    traced value takes one branch for good), so the graph computes for that value only.
    fx makes one placeholder per parameter of forward, in order.
    """
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    return frozenset(name for name, value, node in zip(names, args, placeholders) if not holds_tensor(value) and not node.users)


def argument_names(model: nn.Module, count: int) -> list[str]:
    """forward()'s names for its first ``count`` positional arguments (``input<i>`` where it has none)."""
    try:
        positional = [parameter.name for parameter in positional_parameters(inspect.signature(model.forward))]
    except (TypeError, ValueError):
        positional = []
    return [positional[i] if i < len(positional) else f"input{i}" for i in range(count)]


class InputSignature:
    """The calls an optimized graph accepts: the example's structure, with verified dimensions free to vary."""

    def __init__(self, model: nn.Module, args: tuple[Any, ...], free: Dims, fixed_values: bool, fixed_arguments: Collection[str] = ()) -> None:
        """``free``: per leaf of ``args``, the dimensions that may take other sizes (`graphopt.dynamic`);
        ``fixed_values``: non-tensor arguments must equal the example's (torch.export specialises them);
        ``fixed_arguments``: the names of arguments without tensors that must equal the example's all the same
        (the graph does not read them: `unread_arguments`)."""
        try:
            self.signature: inspect.Signature | None = inspect.signature(model.forward)
        except (TypeError, ValueError):
            self.signature = None
        self.parameters = positional_parameters(self.signature) if self.signature else []  # kept: calls by name read them
        self.names = argument_names(model, len(args))
        leaves, self.spec = pytree.tree_flatten(args)
        self.free = any(free)
        self.fixed_values = fixed_values
        self.fixed_arguments = frozenset(fixed_arguments)
        # the example's arguments without tensors: a call that leaves one out gets forward()'s default, which `bind` checks against them
        self.settings = {name: value for name, value in zip(self.names, args) if not holds_tensor(value)}
        self.leaves: list[TensorSpec | tuple[str, Any]] = []
        for name, leaf, dims in zip(leaf_names(args, self.names), leaves, free, strict=True):
            if isinstance(leaf, torch.Tensor):
                sizes = tuple(None if dim in dims else size for dim, size in enumerate(leaf.shape))
                self.leaves.append(TensorSpec(name, leaf.dtype, leaf.device, sizes, tuple(leaf.shape)))
            else:
                self.leaves.append((name, leaf))
        # the usual call, a flat tuple of tensors, is checked without flattening
        self.tensors_only = len(args) == len(self.leaves) and all(isinstance(leaf, TensorSpec) for leaf in self.leaves)

    def to_dict(self) -> dict[str, Any]:
        """The signature as JSON-ready data (`from_dict` rebuilds it); raises `TypeError` for a non-tensor input JSON cannot hold."""
        parameters = None
        if self.signature is not None:
            parameters = [{"name": p.name, **({} if p.default is inspect.Parameter.empty else {"default": p.default})} for p in self.parameters]
        leaves = [
            {"name": leaf.name, "dtype": str(leaf.dtype).removeprefix("torch."), "device": str(leaf.device), "sizes": list(leaf.sizes), "example": list(leaf.example)}
            if isinstance(leaf, TensorSpec)
            else {"name": leaf[0], "value": leaf[1]}
            for leaf in self.leaves
        ]
        data = {
            "parameters": parameters, "names": self.names, "spec": pytree.treespec_dumps(self.spec), "leaves": leaves, "fixed_values": self.fixed_values,
            "fixed_arguments": sorted(self.fixed_arguments), "settings": self.settings,
        }  # fmt: skip
        json.dumps(data)  # raises TypeError now rather than in the caller's file writing
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], fixed_values: bool | None = None) -> InputSignature:
        """The signature `to_dict` wrote; ``fixed_values``: override whether non-tensor inputs must equal the example's."""
        signature = cls.__new__(cls)
        parameters = data["parameters"]
        signature.signature = None
        if parameters is not None:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            signature.signature = inspect.Signature([inspect.Parameter(p["name"], kind, **({"default": p["default"]} if "default" in p else {})) for p in parameters])
        signature.parameters = positional_parameters(signature.signature) if signature.signature else []
        signature.names = list(data["names"])
        signature.spec = pytree.treespec_loads(data["spec"])
        signature.fixed_values = data["fixed_values"] if fixed_values is None else fixed_values
        signature.fixed_arguments = frozenset(data.get("fixed_arguments", ()))  # absent from files of graphopt before it
        signature.settings = dict(data["settings"])
        signature.leaves = [
            TensorSpec(leaf["name"], getattr(torch, leaf["dtype"]), torch.device(leaf["device"]), tuple(leaf["sizes"]), tuple(leaf["example"]))
            if "dtype" in leaf
            else (leaf["name"], leaf["value"])
            for leaf in data["leaves"]
        ]
        signature.free = any(isinstance(leaf, TensorSpec) and None in leaf.sizes for leaf in signature.leaves)
        signature.tensors_only = len(signature.names) == len(signature.leaves) and all(isinstance(leaf, TensorSpec) for leaf in signature.leaves)
        return signature

    def example_inputs(self) -> tuple[Any, ...]:
        """Inputs of the example's sizes, dtypes and devices with fresh values (zeros for integer and bool tensors), non-tensor inputs as given."""
        generator = torch.Generator().manual_seed(SEED)

        def make(leaf: TensorSpec | tuple[str, Any]) -> Any:
            if not isinstance(leaf, TensorSpec):
                return leaf[1]
            if leaf.dtype.is_floating_point or leaf.dtype.is_complex:
                return torch.randn(leaf.example, generator=generator).to(leaf.dtype).to(leaf.device)
            return torch.zeros(leaf.example, dtype=leaf.dtype, device=leaf.device)

        return pytree.tree_unflatten([make(leaf) for leaf in self.leaves], self.spec)

    def dims(self) -> Dims:
        """Per leaf of the inputs, the dimensions calls may vary."""
        return tuple(frozenset(d for d, size in enumerate(leaf.sizes) if size is None) if isinstance(leaf, TensorSpec) else frozenset() for leaf in self.leaves)

    def describe(self) -> str:
        """What the graph accepts, e.g. ``(x: Tensor[*, 3, 224, 224] float32 on cpu, scale: float)``."""
        parts = []
        for leaf in self.leaves:
            if isinstance(leaf, TensorSpec):
                parts.append(f"{leaf.name}: {leaf.accepted()}")
            else:
                parts.append(f"{leaf[0]}={leaf[1]!r}" if self._fixed(leaf[0]) else f"{leaf[0]}: {type(leaf[1]).__name__}")
        return "(" + ", ".join(parts) + ")"

    @staticmethod
    def _argument(name: str) -> str:
        """The argument a leaf's name belongs to (`dynamic.leaf_names`: the argument's name, then the path: ``sizes[0]``)."""
        return name.partition("[")[0].partition(".")[0]

    def _fixed(self, name: str) -> bool:
        """Whether the input without tensors ``name`` (an argument, or a leaf of one) must equal the example's."""
        return self.fixed_values or self._argument(name) in self.fixed_arguments

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The positional arguments of a call that may name some of them and leave some out.

        A parameter left out takes forward()'s default, as in eager; where the graph cannot
        compute with it, `InputMismatchError` says so (`_check_default`).
        """
        if not kwargs and len(args) >= len(self.names):
            return args
        if self.signature is None:
            if kwargs:
                raise InputMismatchError("this optimized module takes positional arguments only: call it like the example inputs")
            return args  # `check` refuses the call, which lacks arguments
        try:
            bound = positional_arguments(self.signature, args, kwargs, length=len(self.names), parameters=self.parameters)
        except TypeError as error:
            names = keyword_names(self.signature)
            unknown = [name for name in kwargs if name not in names]
            problem = f"forward() has no parameter named {', '.join(map(repr, unknown))}{did_you_mean(unknown, names)}" if unknown else str(error)
            # the accepted names, not forward()'s whole signature: a Hugging Face one runs to hundreds of characters
            raise InputMismatchError(f"the call does not fit this optimized module ({problem}). It takes {self._accepted()}.") from error
        self._check_positions(args, kwargs)
        for parameter in self.parameters[len(args) : len(self.names)]:
            if parameter.name not in kwargs:
                self._check_default(parameter.name, parameter.default)
        return bound

    def _tensor_arguments(self) -> list[str]:
        """The arguments whose example held a tensor, in forward()'s order."""
        return [name for name in self.names if name not in self.settings]

    def _by_name(self) -> str:
        """The call that names every tensor argument, e.g. ``fast(input_ids=..., attention_mask=...)``."""
        return "fast(" + ", ".join(f"{name}=..." for name in self._tensor_arguments()) + ")"

    def _accepted(self) -> str:
        """The arguments a call may give, briefly: ``input_ids, attention_mask, by position or by name: fast(input_ids=..., attention_mask=...)``."""
        names = [name for name in self.names if self.settings.get(name, ...) is not None]  # not those the example left at None
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"{shown}, by position or by name: {self._by_name()}"

    def _check_positions(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse a call that gives a tensor by position to an argument the example gave none, and leaves out a tensor argument after it.

        The usual cause: the example named its inputs (``{"input_ids": ..., "attention_mask": ...}``),
        skipping a parameter between them (GPT-2's cache), and the call gives them by position.
        """
        left_out = [name for name in self.names[len(args) :] if name not in self.settings and name not in kwargs]
        for index, (name, value) in enumerate(zip(self.names, args)):
            later = [other for other in left_out if self.names.index(other) > index]
            if name in self.settings and holds_tensor(value) and later:
                raise InputMismatchError(
                    f"argument {index + 1} of the call, {describe_value(value)}, lands by position on forward()'s parameter {name!r}, "
                    f"which this optimized module takes as {name}={self.settings[name]!r}; forward() takes {', '.join(later)} after it. "
                    f"Pass the inputs by name: {self._by_name()}."
                )

    def _check_default(self, name: str, default: Any) -> None:
        """Refuse a call that leaves out ``name`` when the graph cannot compute with forward()'s ``default`` for it.

        Never the example's value instead: that would silently compute something else than
        eager. The graph can where the argument is an input it reads of the same type; not
        where it fixed the example's value, nor where the example gave a tensor.
        """
        if name in self.settings:
            example = self.settings[name]
            if type(default) is type(example) and (default == example or not self._fixed(name)):
                return
            if type(default) is not type(example):
                why = f"the graph takes a {type(example).__name__} there"
            elif self.fixed_values:
                why = "torch.export fixed that value in the graph"
            else:
                why = "the graph does not read it: symbolic_trace fixed that value in the graph"
            given = f"the example's {name}={example!r}"
            fix = f"Pass {name}={example!r} for what the graph computes, or optimize with {name}={describe_value(default)} (or {name} left out) to run with the default."
        elif holds_tensor(default):
            return  # `check` compares it with what the graph accepts
        else:
            accepted = [leaf.accepted() for leaf in self.leaves if isinstance(leaf, TensorSpec) and self._argument(leaf.name) == name]
            given, why = f"a tensor for {name} ({', '.join(accepted)})", "the graph computes with it"
            fix = f"Pass {name} (all inputs by name: {self._by_name()}), or optimize with example inputs that leave {name} out to run with the default."
        raise InputMismatchError(
            f"{name} was left out of the call, so forward()'s default {name}={describe_value(default)} applies, but this optimized module was "
            f"captured and verified with {given} ({why}): it would compute something else than forward() does. {fix}"
        )

    def check(self, args: tuple[Any, ...]) -> None:
        """Raise `InputMismatchError` unless ``args`` is a call the graph accepts (run on every call: kept cheap)."""
        if self.tensors_only and len(args) == len(self.leaves) and all(spec.fits(value) for spec, value in zip(self.leaves, args)):  # type: ignore[union-attr]
            return
        leaves, spec = pytree.tree_flatten(args)
        if spec != self.spec or len(leaves) != len(self.leaves):
            self._refuse("the call's arguments", f"are {describe_inputs(args)}")
        for expected, value in zip(self.leaves, leaves, strict=True):
            if isinstance(expected, TensorSpec):
                if not expected.fits(value):
                    self._refuse(expected.name, expected.mismatch(value) or "", expected.other_sizes(value))
            else:
                name, example = expected
                same = type(value) is type(example) and (not self._fixed(name) or value == example)
                if not same:
                    self._refuse(name, f"is {describe_value(value)}")

    def _refuse(self, what: str, problem: str, dims: list[int] | None = None) -> None:
        sizes = "* sizes vary (each verified at a second size), the others are the example's" if self.free else "every size is the example's"
        if dims:
            example = "{" + repr(what.split("[")[0]) + ": {" + ", ".join(f"{dim}: torch.export.Dim.AUTO" for dim in dims) + "}}"
            fix = (
                f"To call it with other sizes there, optimize with dynamic_shapes={example} (or dynamic_shapes='auto': every "
                "dimension the model allows); the report's notes say why a dimension that was asked for stayed fixed."
            )
        else:
            fix = (
                "Optimize the model again with example inputs like the ones you call it with (one optimized module per input "
                "dtype or rank), or call the original model."
            )
        raise InputMismatchError(
            f"{what} {problem}, but this optimized module accepts {self.describe()}, where {sizes}. It was captured and "
            f"verified for those inputs only and may compute something else for others. {fix}"
        )

"""Checks on what the user hands in, before any capture: each failure says what to do."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from graphopt import verify
from graphopt.errors import InvalidInputsError, InvalidModelError
from graphopt.inputs import OtherInputs, describe_inputs, other_inputs, positional_arguments


def _with_keywords(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``args`` and ``kwargs`` as forward()'s positional arguments, or `InvalidInputsError` saying which name does not fit."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError) as error:
        raise InvalidInputsError(f"{type(model).__name__}.forward has no signature to place keyword inputs in: pass them by position") from error
    try:
        return positional_arguments(signature, args, kwargs)
    except TypeError as error:
        names = [name for name in signature.parameters if name not in ("args", "kwargs")]
        unknown = [name for name in kwargs if name not in signature.parameters]
        close = [difflib.get_close_matches(name, names, n=1) for name in unknown]
        hint = "".join(f"; {name!r}: did you mean {match[0]!r}?" for name, match in zip(unknown, close, strict=True) if match)
        reason = f"no parameter named {', '.join(map(repr, unknown))}" if unknown else str(error)
        raise InvalidInputsError(f"example inputs {sorted(kwargs)} do not fit {type(model).__name__}.forward{signature} ({reason}){hint}") from error


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise InvalidModelError(
            f"expected a torch.nn.Module to optimize, got {type(model).__name__}; "
            "wrap a plain function in an nn.Module whose forward() calls it"
        )
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise InvalidModelError(
            f"{type(model).__name__}'s {', '.join(empty[:3])}{' and others' if len(empty) > 3 else ''} are on the meta device: "
            "they have shapes but no values, so there is nothing to run or verify (the model was built under "
            "torch.device('meta') or with empty weights). Give it real weights first, e.g. model.to_empty(device='cpu') "
            "then model.load_state_dict(checkpoint)."
        )


def positional_inputs(model: nn.Module, example_inputs: Any, kwargs: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
    """``example_inputs`` (and ``kwargs``) as a tuple of forward()'s positional arguments.

    ``example_inputs`` is a tensor, a tuple of positional arguments or a dict of keyword
    arguments (``model(**batch)``); named arguments take their places in forward()'s
    signature, and skipped ones before them their defaults.
    """
    if isinstance(example_inputs, torch.Tensor):
        args: tuple[Any, ...] = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    elif isinstance(example_inputs, Mapping):
        args, kwargs = (), {**example_inputs, **(kwargs or {})}
    else:
        raise InvalidInputsError(
            f"example_inputs must be a tensor, a tuple of the positional arguments of forward() or a dict of its keyword "
            f"arguments, got {type(example_inputs).__name__}; e.g. optimize(model, (torch.randn(8, 3, 224, 224),))"
        )
    return _with_keywords(model, args, dict(kwargs)) if kwargs else args


def check_inputs(model: nn.Module, example_inputs: Any, device: torch.device | None = None) -> tuple[Any, ...]:
    """`positional_inputs`, checked: they hold a tensor, on the model's device (``device``: where it will be moved)."""
    args = positional_inputs(model, example_inputs)
    if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(args)):
        raise InvalidInputsError(
            f"example_inputs {describe_inputs(args)} contain no tensor: pass example tensors with the shapes, "
            "dtypes and device the model will see"
        )
    model_devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    if device is not None:
        model_devices = {device}
    input_devices = {leaf.device for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)}
    if model_devices and not input_devices <= model_devices:
        raise InvalidInputsError(
            f"the model's parameters are on {', '.join(sorted(map(str, model_devices)))} but example inputs "
            f"{describe_inputs(args)} are on {', '.join(sorted(map(str, input_devices)))}: move the inputs "
            "(or the model, with .to(device)) so both are on the device you will run on"
        )
    return args


def reference_run(model: nn.Module, args: tuple[Any, ...], gradients: bool = False) -> verify.Reference:
    """Eager outputs and state updates (with ``gradients``, also gradients) of ``model`` on ``args``.

    Raises `InvalidInputsError` when the model rejects the inputs, or when its outputs hold
    NaN (or no finite value at all): nothing could then be verified against them.
    """
    try:
        reference = verify.run_reference(model, args, gradients=gradients)
    except Exception as error:
        dtypes = {t.dtype for t in model.parameters() if t.is_floating_point()}
        input_dtypes = {leaf.dtype for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
        hint = ""
        if dtypes and input_dtypes and not input_dtypes <= dtypes:
            hint = f" The inputs are {', '.join(sorted(map(str, input_dtypes)))} but the parameters are {', '.join(sorted(map(str, dtypes)))}."
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise InvalidInputsError(
            f"{type(model).__name__} raised {type(error).__name__} when called with example inputs "
            f"{describe_inputs(args)}: {message}.{hint} Pass example inputs that model(*example_inputs) accepts "
            "(check the number of arguments, shapes, dtypes and device)."
        ) from error
    if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(reference.outputs)):
        raise InvalidModelError(
            f"{type(model).__name__}.forward() returned {_kind(reference.outputs)} on the example inputs, with no tensor in it: "
            "an optimized graph would compute nothing, and nothing could be verified. Optimize a module whose forward() "
            "returns the tensors it computes."
        )
    unusable = _unusable_output(reference.outputs)
    if unusable is not None:
        raise InvalidInputsError(
            f"{type(model).__name__}'s {unusable} on the example inputs {describe_inputs(args)} "
            "holds NaN or no finite value: graphopt could not tell a correct rewrite from a wrong one. "
            "Pass example inputs for which the model's outputs are finite numbers."
        )
    return reference


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _unusable_output(outputs: Any) -> str | None:
    """The first floating-point output holding NaN or no finite value, e.g. "output[0]"; None when all are usable."""
    for path, leaf in pytree.tree_flatten_with_path(outputs)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
            if torch.isnan(leaf).any() or not torch.isfinite(leaf).any():
                return f"output{pytree.keystr(path)}"
    return None


class SecondInputs:
    """Second inputs the eager model accepts with usable outputs, most different from the example first.

    Candidates come from `graphopt.inputs.other_inputs`, made when first iterated; each is
    run eagerly the first time it is asked for (a graph that accepts the first needs no
    more), and kept.
    """

    def __init__(self, model: nn.Module, args: tuple[Any, ...], vary_batch: bool, gradients: bool) -> None:
        self.model, self.args, self.vary_batch, self.gradients = model, args, vary_batch, gradients
        self.checks: dict[int, verify.Check | None] = {}
        self.refused: list[str] = []  # why the eager model refused candidates

    @functools.cached_property
    def candidates(self) -> list[OtherInputs]:
        return other_inputs(self.args, self.vary_batch)

    def __iter__(self) -> Iterator[verify.Check]:
        for index, candidate in enumerate(self.candidates):
            if index not in self.checks:
                self.checks[index] = self._run(candidate)
            check = self.checks[index]
            if check is not None:
                yield check

    def _run(self, candidate: OtherInputs) -> verify.Check | None:
        try:
            reference = verify.run_reference(self.model, candidate.args, gradients=self.gradients)
        except Exception as error:
            self.refused.append(f"{candidate.description}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
            return None
        unusable = _unusable_output(reference.outputs)
        if unusable is not None:
            self.refused.append(f"{candidate.description}: the model's {unusable} holds NaN or no finite value")
            return None
        return verify.Check(candidate.args, reference, f"a second input ({candidate.description})", candidate.batch, candidate.description)

"""Checks on what the user hands in, before any capture: each failure says what to do."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Generator, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from graphopt import verify
from graphopt.errors import InvalidInputsError, InvalidModelError, error_summary
from graphopt.dynamic import Dims, batch_size, leaf_names
from graphopt.trees import leaves_with_paths
from graphopt.inputs import (
    OtherInputs, argument_names, copied_inputs, describe_inputs, did_you_mean, keyword_names, other_inputs, positional_arguments, positional_parameters,
)  # fmt: skip


def _with_keywords(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``args`` and ``kwargs`` as forward()'s positional arguments, or `InvalidInputsError` saying which name does not fit."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError) as error:
        raise InvalidInputsError(f"{type(model).__name__}.forward has no signature to place keyword inputs in: pass them by position") from error
    try:
        return positional_arguments(signature, args, kwargs)
    except TypeError as error:
        unknown = [name for name in kwargs if name not in signature.parameters]
        hint = did_you_mean(unknown, keyword_names(signature))
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
    _check_cache_arguments(model, args)
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
    """Eager outputs and state updates (with ``gradients``, also gradients) of ``model`` on a copy of ``args``.

    Raises `InvalidInputsError` when the model rejects the inputs, or when its outputs hold
    NaN (or no finite value at all): nothing could then be verified against them;
    `InvalidModelError` when forward writes to an input in place (`_check_input_writes`).
    """
    copies = _tracked_copy(args)
    versions = _versions(copies)
    try:
        reference = verify.run_reference(model, copies, gradients=gradients)
    except Exception as error:
        dtypes = {t.dtype for t in model.parameters() if t.is_floating_point()}
        input_dtypes = {leaf.dtype for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
        hint = ""
        if dtypes and input_dtypes and not input_dtypes <= dtypes:
            hint = f" The inputs are {', '.join(sorted(map(str, input_dtypes)))} but the parameters are {', '.join(sorted(map(str, dtypes)))}."
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if isinstance(error, TypeError) and "got multiple values for argument" in message:
            hint += (
                f" {type(model).__name__}.forward is wrapped by a decorator that passes {message.rsplit(' ', 1)[-1]} by keyword itself: "
                "leave it out of the example inputs and set it on the model instead (e.g. model.config.use_cache = False)."
            )
        raise InvalidInputsError(
            f"{type(model).__name__} raised {type(error).__name__} when called with example inputs "
            f"{describe_inputs(args)}: {message}.{hint} Pass example inputs that model(*example_inputs) accepts "
            "(check the number of arguments, shapes, dtypes and device)."
        ) from error
    _check_input_writes(model, args, versions, copies)
    _check_cache_outputs(model, reference.outputs)
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


def _tracked_copy(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`copied_inputs`, made outside inference mode (``optimize`` may be called in it): tensors with version counters."""
    with torch.inference_mode(False):
        return copied_inputs(args)


def _versions(args: tuple[Any, ...]) -> list[int]:
    """The version counter of each tensor in ``args``: every in-place write to a tensor (or a view of it) bumps it."""
    return [leaf._version for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]


class _InputWrites(TorchDispatchMode):
    """Records the ops that write to the memory of the watched tensors, with the tensor's name."""

    def __init__(self, watched: dict[str, torch.Tensor]) -> None:
        super().__init__()
        pointers = {name: tensor.untyped_storage().data_ptr() for name, tensor in watched.items()}
        self.storages = {pointer: name for name, pointer in pointers.items() if pointer}  # 0: no memory, nothing to write
        self.writes: list[tuple[str, str]] = []  # (op, input name)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                name = self.storages.get(value.untyped_storage().data_ptr())
                if name is not None:
                    self.writes.append((str(func), name))
        return func(*args, **kwargs)


def _check_input_writes(model: nn.Module, args: tuple[Any, ...], versions: list[int], copies: tuple[Any, ...]) -> None:
    """Refuse a forward that writes to its inputs in place (``x.mul_(2)``, ``x += 1``, ``out=x``), naming the op and the input.

    graphopt runs forward and the graph many times on copies of the inputs and verifies
    outputs and stored state, not what a run leaves in its inputs: an optimized graph could
    not be shown to write them as forward does. ``versions``: those of ``copies`` before the
    run that produced the reference; only when one changed is forward run again, on a fresh
    copy, to find the op.
    """
    names = argument_names(model, len(args))
    tensor_names = [name for name, leaf in zip(leaf_names(args, names), pytree.tree_leaves(args)) if isinstance(leaf, torch.Tensor)]
    written = [name for name, before, after in zip(tensor_names, versions, _versions(copies), strict=True) if after != before]
    if not written:
        return
    fresh = _tracked_copy(args)
    watched = dict(zip(tensor_names, [leaf for leaf in pytree.tree_leaves(fresh) if isinstance(leaf, torch.Tensor)], strict=True))
    finder = _InputWrites(watched)
    try:
        with finder:
            verify.run_isolated(model, fresh)
    except Exception:  # noqa: BLE001 - the op is a detail of the message; the write is established
        pass
    op, name = finder.writes[0] if finder.writes else ("an in-place op", written[0])
    raise InvalidModelError(
        f"{type(model).__name__}.forward writes to its input {name} in place ({op}). graphopt checks the optimized graph "
        f"against forward on copies of your inputs, which it leaves untouched, and cannot verify writes to inputs: make "
        f"forward leave {name} as it is, e.g. y = {name} * 2 instead of {name}.mul_(2), {name} = {name} + 1 instead of "
        f"{name} += 1, or {name} = {name}.clone() before writing to it."
    )


def _is_cache(parameter: inspect.Parameter) -> bool:
    """Whether forward()'s ``parameter`` takes a key/value cache (Hugging Face's ``cache``/``past_key_values``)."""
    return parameter.name in ("cache", "past_key_values", "cache_params") or "Cache" in str(parameter.annotation)


def _check_cache_arguments(model: nn.Module, args: tuple[Any, ...]) -> None:
    """A tensor given by position where forward() takes a cache: the inputs were meant by name (GPT-2's ``(ids, mask)``)."""
    try:
        parameters = positional_parameters(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return
    for index, (parameter, value) in enumerate(zip(parameters, args)):
        if isinstance(value, torch.Tensor) and _is_cache(parameter):
            names = [p.name for p in parameters]
            raise InvalidInputsError(
                f"example input {index + 1} is a tensor, but parameter {index + 1} of {type(model).__name__}.forward is "
                f"{parameter.name!r}, a key/value cache ({', '.join(names[: index + 2])}, ...): pass the inputs by name, e.g. "
                "optimize(model, {'input_ids': ids, 'attention_mask': mask}), and call the optimized model the same way"
            )


def _check_cache_outputs(model: nn.Module, outputs: Any) -> None:
    """Outputs holding a key/value cache object: graphs return tensors, and a cache grows with every call."""
    caches = [(path, leaf) for path, leaf in leaves_with_paths(outputs) if type(leaf).__name__.endswith("Cache")]
    if not caches:
        return
    path, cache = caches[0]
    try:
        takes_use_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_use_cache = False
    if hasattr(getattr(model, "config", None), "use_cache"):
        fix = "Set model.config.use_cache = False before optimize (the optimized model then returns no cache: fine for encoding and scoring)"
    elif takes_use_cache:
        fix = "Pass use_cache=False with the example inputs (the optimized model then returns no cache)"
    else:
        fix = "Return the tensors the cache holds instead, or optimize a module that does not keep one"
    raise InvalidInputsError(
        f"{type(model).__name__} returns a {type(cache).__name__} (output{pytree.keystr(path)}) on the example inputs: a key/value "
        f"cache object, which an optimized graph cannot return (it returns tensors, and the cache changes every call). {fix}."
    )


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _unusable_output(outputs: Any) -> str | None:
    """The first floating-point output holding NaN or no finite value, e.g. "output[0]"; None when all are usable."""
    for path, leaf in leaves_with_paths(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
            if torch.isnan(leaf).any() or not torch.isfinite(leaf).any():
                return f"output{pytree.keystr(path)}"
    return None


class SecondInputs:
    """Second inputs the eager model accepts with usable outputs, most different from the example first.

    Candidates come from `graphopt.inputs.other_inputs`, made and run eagerly when first
    asked for (a graph that accepts the first needs no more), and kept. `varying` yields
    them for the dimensions a graph may vary: all of them at once; when the model refuses
    that, those it accepts one size at a time, together; the batch alone; none.
    """

    def __init__(self, model: nn.Module, args: tuple[Any, ...], dims: Dims, gradients: bool) -> None:
        self.model, self.args, self.dims, self.gradients = model, args, dims, gradients
        self.checks: dict[tuple[Dims, bool], verify.Check | None] = {}  # (dims varied, other strides) -> its run
        self.refused: list[str] = []  # why the eager model refused candidates

    def __iter__(self) -> Iterator[verify.Check]:
        return self.varying(self.dims)

    def varying(self, dims: Dims) -> Iterator[verify.Check]:
        """The checks for a graph that may vary ``dims`` (a subset of the requested ones), most different first."""
        leaves = pytree.tree_leaves(self.args)
        batch = batch_size(self.args)
        batch_only = tuple(frozenset(mine & {0}) if isinstance(leaf, torch.Tensor) and leaf.shape[0:1] == (batch,) else frozenset() for leaf, mine in zip(leaves, dims))
        nothing = tuple(frozenset() for _ in leaves)
        found = yield from self._checks(dims)
        sizes = {leaf.shape[dim] for leaf, mine in zip(leaves, dims) for dim in mine}
        if not found and len(sizes) > 1:  # one size the model cannot take (a channel count) must not fix the others
            accepted = [
                size for size in sizes
                if self._check(tuple(frozenset(dim for dim in mine if leaf.shape[dim] == size) for leaf, mine in zip(leaves, dims)), False)
            ]  # fmt: skip
            yield from self._checks(tuple(frozenset(dim for dim in mine if leaf.shape[dim] in accepted) for leaf, mine in zip(leaves, dims)))
        yield from self._checks(batch_only)
        yield from self._checks(nothing)

    def _checks(self, dims: Dims) -> Generator[verify.Check, None, bool]:
        """The checks varying ``dims`` that the model accepts, other strides first; whether there was one."""
        found = False
        for strided in (True, False):
            check = self._check(dims, strided)
            if check is not None:
                found = True
                yield check
        return found

    def _check(self, dims: Dims, strided: bool) -> verify.Check | None:
        if (dims, strided) not in self.checks:
            self.checks[dims, strided] = self._run(other_inputs(self.args, dims, strided))
        return self.checks[dims, strided]

    def _run(self, candidate: OtherInputs) -> verify.Check | None:
        try:
            reference = verify.run_reference(self.model, candidate.args, gradients=self.gradients)
        except Exception as error:
            self.refused.append(f"{candidate.description}: {error_summary(error)}")
            return None
        unusable = _unusable_output(reference.outputs)
        if unusable is not None:
            self.refused.append(f"{candidate.description}: the model's {unusable} holds NaN or no finite value")
            return None
        return verify.Check(candidate.args, reference, f"a second input ({candidate.description})", candidate.description)


def with_values_of(check: verify.Check, values: tuple[Any, ...], model: nn.Module) -> verify.Check | None:
    """``check``'s second input (its sizes and strides) filled with the values of ``values`` (forward()'s arguments).

    Used where a second input of resampled example values says nothing (int8, calibrated on
    real data): the batch dimension is repeated or cut to the check's size; None when any
    other size differs.
    """
    args = copy.deepcopy(check.args)  # the same strides (a view stays a view of its own copy)
    for target, source in zip(pytree.tree_leaves(args), pytree.tree_leaves(values), strict=True):
        if not isinstance(target, torch.Tensor):
            continue
        if target.dim() == 0 or target.shape[1:] != source.shape[1:]:
            return None
        repeats = -(-target.shape[0] // source.shape[0])
        with torch.no_grad():
            target.copy_(source.repeat(repeats, *([1] * (source.dim() - 1)))[: target.shape[0]])
    differences = check.differences.replace("values resampled from the example's", "values of the last calibration batch")
    return verify.Check(args, reference_run(model, args), f"a second input ({differences})", differences)

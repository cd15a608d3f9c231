"""Device moves, dtype casts and tensor factories: `TransferView`, `FactoryView`, `is_dtype_cast`, `is_metadata_check`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphopt.ops.arguments import call_arguments, not_constant
from graphopt.ops.graph import Form

aten = torch.ops.aten

_TO_ATEN = (aten.to.device, aten.to.dtype, aten.to.dtype_layout, aten.to.other, aten._to_copy.default)
_CAST_METHODS = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
    "long": torch.int64, "int": torch.int32, "short": torch.int16, "bool": torch.bool,
}
_FLOAT_CAST_METHODS = frozenset(method for method, dtype in _CAST_METHODS.items() if dtype.is_floating_point)
_FLOAT_DTYPES = tuple(dtype for dtype in _CAST_METHODS.values() if dtype.is_floating_point)


def _read_attribute(value: Any, name: str) -> fx.Node | None:
    """``x`` when ``value`` is the node ``getattr(x, name)`` (``x.device``, ``x.dtype``), else None."""
    if isinstance(value, fx.Node) and value.op == "call_function" and value.target is getattr and value.args[1] == name:
        return value.args[0]  # type: ignore[return-value]
    return None


def _device_operand(value: Any) -> torch.device | fx.Node:
    """A ``.to()``/``.cuda()`` device argument: a fixed device, or the tensor whose ``.device`` is read at run time."""
    tensor = _read_attribute(value, "device")
    if tensor is not None:
        return tensor
    if isinstance(value, int):  # .to(0) / .cuda(0): a CUDA ordinal
        return torch.device("cuda", value)
    return torch.device(value)


def _dtype_operand(value: Any) -> torch.dtype | fx.Node | None:
    """A dtype argument: a fixed dtype, the tensor whose ``.dtype`` is read at run time, or None."""
    return _read_attribute(value, "dtype") or value


@dataclass
class TransferView:
    """A device move or dtype cast: ``.to(...)``, ``.cpu()``, ``.cuda()``, ``.float()``..., ATen ``to``/``_to_copy``.

    ``device`` and ``dtype`` are a fixed value, a node (the tensor whose device or dtype
    is read at run time, as in ``.to(x.device)`` or ``.to(x)``) or None (not changed).
    A node the capture recorded as no tensor (``.to(dtype)`` with a dtype passed to
    forward()) is a target known only at run time: ``unsupported`` says so.
    """

    node: fx.Node
    form: Form
    input: fx.Node
    device: torch.device | fx.Node | None
    dtype: torch.dtype | fx.Node | None
    non_blocking: bool
    copy: bool  # copies even when nothing changes (copy=True, aten._to_copy)
    memory_format: torch.memory_format | None
    unsupported: str | None = None  # why the target is unknown when optimizing: a dtype or device passed to forward()

    def set_non_blocking(self) -> None:
        if self.form == "aten":
            call_arguments(self.node).set("non_blocking", True)
        else:
            self.node.kwargs = {**self.node.kwargs, "non_blocking": True}
        self.non_blocking = True

    def set_copy(self, copy: bool) -> None:
        """Ask for a copy or not (``to`` forms only; a copy is never needed when dtype and device change)."""
        if self.form == "aten":
            call_arguments(self.node).set("copy", copy)
        else:
            self.node.kwargs = {**self.node.kwargs, "copy": copy}
        self.copy = copy


def _method_transfer(node: fx.Node) -> TransferView | None:
    source, *args = node.args
    kwargs = dict(node.kwargs)
    if not isinstance(source, fx.Node):
        return None
    device: torch.device | fx.Node | None = None
    dtype: torch.dtype | fx.Node | None = None
    if node.target in _CAST_METHODS:
        dtype = _CAST_METHODS[str(node.target)]
    elif node.target == "cpu":
        device = torch.device("cpu")
    elif node.target == "cuda":
        index = args[0] if args else kwargs.get("device")
        device = torch.device("cuda") if index is None else _device_operand(index)
    elif node.target == "to":
        flags = []
        for arg in args:
            if isinstance(arg, bool):
                flags.append(arg)
            elif isinstance(arg, torch.dtype) or _read_attribute(arg, "dtype") is not None:
                dtype = _dtype_operand(arg)
            elif isinstance(arg, fx.Node) and _read_attribute(arg, "device") is None:
                device = dtype = arg  # .to(other): other's device and dtype
            else:
                device = _device_operand(arg)
        kwargs.update(zip(("non_blocking", "copy"), flags))
        if kwargs.get("device") is not None:
            device = _device_operand(kwargs["device"])
        dtype = _dtype_operand(kwargs.get("dtype", dtype))
    else:
        return None
    # .to(other) reads other's device and dtype at run time; a dtype or device passed to forward() is no tensor to read
    unknown = next((operand for operand in (device, dtype) if _recorded_as_non_tensor(operand)), None)
    return TransferView(
        node, "function", source, device, dtype, bool(kwargs.get("non_blocking", False)), bool(kwargs.get("copy", False)),
        kwargs.get("memory_format"), None if unknown is None else not_constant(node, "device/dtype", unknown),
    )


def _recorded_as_non_tensor(value: Any) -> bool:
    """Whether ``value`` is a graph value the capture recorded as something other than a tensor (a dtype, a device)."""
    if not isinstance(value, fx.Node):
        return False
    if "val" in value.meta:  # torch.export
        return not isinstance(value.meta["val"], torch.Tensor)
    recorded = value.meta.get("type")  # ShapeProp, after symbolic_trace
    return isinstance(recorded, type) and not issubclass(recorded, torch.Tensor)


def transfer_view(gm: fx.GraphModule, node: fx.Node) -> TransferView | None:
    """View of a device move or dtype cast in method or ATen form, else ``None``."""
    if node.op == "call_method":
        try:
            return _method_transfer(node)
        except (TypeError, RuntimeError):  # a device argument graphopt cannot read (computed in the graph)
            return None
    if node.op != "call_function" or node.target not in _TO_ATEN:
        return None
    arguments = call_arguments(node)
    names = arguments.names
    if node.target is aten.to.other:
        device = dtype = arguments.get("other")
    else:
        device = arguments.get("device") if "device" in names else None
        dtype = arguments.get("dtype")
    copy = node.target is aten._to_copy.default or bool(arguments.get("copy"))
    return TransferView(
        node, "aten", node.args[0], None if device is None else _device_operand(device), dtype,  # type: ignore[arg-type]
        bool(arguments.get("non_blocking")), copy, arguments.get("memory_format"),
    )


# kind: "fill" (same values in any dtype: zeros, ones, full, empty, eye), "sequence" (arange, linspace:
# computed in the target dtype) or "random" (drawn from the generator of the device, in the dtype's format)
_FACTORY_FUNCTIONS: dict[Any, str] = {
    **dict.fromkeys((torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.zeros_like, torch.ones_like,
                     torch.full_like, torch.empty_like, torch.scalar_tensor), "fill"),
    **dict.fromkeys((torch.arange, torch.linspace), "sequence"),
    **dict.fromkeys((torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
                     torch.randperm, torch.normal), "random"),
}
_FACTORY_ATEN: dict[Any, str] = {
    **dict.fromkeys((aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format, aten.eye.default,
                     aten.eye.m, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
                     aten.empty_like.default, aten.scalar_tensor.default, aten.new_zeros.default, aten.new_ones.default,
                     aten.new_full.default, aten.new_empty.default), "fill"),
    **dict.fromkeys((aten.arange.default, aten.arange.start, aten.arange.start_step, aten.linspace.default), "sequence"),
    **dict.fromkeys((aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low, aten.rand_like.default,
                     aten.randn_like.default, aten.randint_like.default, aten.randperm.default), "random"),
}
_FACTORY_METHODS = {"new_zeros": "fill", "new_ones": "fill", "new_full": "fill", "new_empty": "fill"}


@dataclass
class FactoryView:
    """A call that creates a tensor (``torch.zeros``, ``x.new_ones``, ``aten.arange``, ...) and takes ``device=``/``dtype=``."""

    node: fx.Node
    form: Form
    kind: str  # "fill", "sequence" or "random"

    def create_on(self, device: torch.device | fx.Node | None, dtype: torch.dtype | fx.Node | None) -> None:
        """Create the tensor on ``device`` in ``dtype`` (a node: read from that tensor at run time); None keeps it."""
        graph = self.node.graph
        kwargs = dict(self.node.kwargs)
        for name, value in (("device", device), ("dtype", dtype)):
            if isinstance(value, fx.Node):
                with graph.inserting_before(self.node):
                    value = graph.call_function(getattr, (value, name))
            if value is not None:
                kwargs[name] = value
        self.node.kwargs = kwargs


def factory_view(gm: fx.GraphModule, node: fx.Node) -> FactoryView | None:
    """View of a tensor factory in function, method or ATen form, else ``None``."""
    if node.op == "call_method" and node.target in _FACTORY_METHODS:
        return FactoryView(node, "function", _FACTORY_METHODS[str(node.target)])
    if node.op == "call_function" and node.target in _FACTORY_FUNCTIONS:
        return FactoryView(node, "function", _FACTORY_FUNCTIONS[node.target])
    if node.op == "call_function" and node.target in _FACTORY_ATEN:
        return FactoryView(node, "aten", _FACTORY_ATEN[node.target])
    return None


def is_metadata_check(node: fx.Node) -> bool:
    """torch.export's check that a value has the dtype and device seen at export time (no other effect)."""
    return node.op == "call_function" and node.target is aten._assert_tensor_metadata.default


def is_dtype_cast(node: fx.Node) -> bool:
    """A dtype-only conversion: ``x.to(dtype)``, ``x.float()``, ``aten._to_copy(x, dtype=...)``."""
    if node.op == "call_method" and node.target in _FLOAT_CAST_METHODS:
        return len(node.args) == 1 and not node.kwargs
    if node.op == "call_method" and node.target == "to":
        return len(node.args) == 2 and node.args[1] in _FLOAT_DTYPES and not node.kwargs
    if node.op == "call_function" and node.target in (aten._to_copy.default, aten.to.dtype):
        return set(node.kwargs) <= {"dtype"} and len(node.args) <= (2 if node.target is aten.to.dtype else 1)
    return False

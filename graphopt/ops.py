"""Op views: recognise an op family in every graph form and give uniform access to it.

A captured graph spells the same operation three ways:

- ``call_module``: ``self.conv(x)`` with an ``nn.Conv2d`` (symbolic_trace of module code);
- ``call_function``: ``F.conv2d(x, self.weight, ...)`` (symbolic_trace of functional code);
- ATen: ``torch.ops.aten.conv2d.default(x, w, ...)`` (torch.export).

Each ``*_view(gm, node)`` function returns a small view object when ``node`` belongs to
the family, else ``None``. Views expose the operands, attributes and parameters, and
write parameters back, so a pass is written once for all three forms. Passes never
compare targets themselves: a new spelling of an op is added here, once.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.utils import _pytree as pytree

aten = torch.ops.aten

Form = Literal["module", "function", "aten"]


# --------------------------------------------------------------------------- attributes


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


class Arguments:
    """Read and write a call's arguments by name, whether passed positionally or by keyword."""

    def __init__(self, node: fx.Node, names: tuple[str, ...], defaults: dict[str, Any]) -> None:
        self.node = node
        self.names = names
        self.defaults = defaults

    def get(self, name: str) -> Any:
        index = self.names.index(name)
        if index < len(self.node.args):
            return self.node.args[index]
        return self.node.kwargs.get(name, self.defaults.get(name))

    def set(self, name: str, value: Any) -> None:
        index = self.names.index(name)
        if index < len(self.node.args):
            args = list(self.node.args)
            args[index] = value
            self.node.args = tuple(args)
        else:
            self.node.kwargs = {**self.node.kwargs, name: value}


@dataclass(frozen=True)
class _Signature:
    names: tuple[str, ...]
    defaults: dict[str, Any] = field(default_factory=dict)


def _resolve(gm: fx.GraphModule, arg: Any) -> tuple[torch.Tensor | None, str | None]:
    """A tensor argument's value and attribute path when it is a constant (get_attr), else (None, None)."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = get_attr(gm, str(arg.target))
        if isinstance(value, torch.Tensor):
            return value, str(arg.target)
    return None, None


# --------------------------------------------------------------------------- conv / linear

_CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_NAMES = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_CONVOLUTION_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
_LINEAR_NAMES = ("input", "weight", "bias")

# function -> (spatial dims, transposed, signature); spatial dims 0 means linear.
_WEIGHTED_FUNCTIONS: dict[Any, tuple[int, bool | None, _Signature]] = {
    F.conv1d: (1, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    F.conv2d: (2, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    F.conv3d: (3, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    F.conv_transpose1d: (1, True, _Signature(_CONV_T_NAMES, {"bias": None, "groups": 1})),
    F.conv_transpose2d: (2, True, _Signature(_CONV_T_NAMES, {"bias": None, "groups": 1})),
    F.conv_transpose3d: (3, True, _Signature(_CONV_T_NAMES, {"bias": None, "groups": 1})),
    F.linear: (0, False, _Signature(_LINEAR_NAMES, {"bias": None})),
}
_WEIGHTED_ATEN: dict[Any, tuple[int, bool | None, _Signature]] = {
    aten.conv1d.default: (1, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    aten.conv2d.default: (2, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    aten.conv3d.default: (3, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    aten.conv1d.padding: (1, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    aten.conv2d.padding: (2, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    aten.conv3d.padding: (3, False, _Signature(_CONV_NAMES, {"bias": None, "groups": 1})),
    aten.conv_transpose1d.default: (1, True, _Signature(_CONV_T_NAMES, {"bias": None, "groups": 1})),
    aten.conv_transpose2d.input: (2, True, _Signature(_CONV_T_NAMES, {"bias": None, "groups": 1})),
    aten.conv_transpose3d.input: (3, True, _Signature(_CONV_T_NAMES, {"bias": None, "groups": 1})),
    # spatial dims and transposition of the generic form are read from its arguments
    aten.convolution.default: (-1, None, _Signature(_CONVOLUTION_NAMES)),
    aten.linear.default: (0, False, _Signature(_LINEAR_NAMES, {"bias": None})),
}
_FUNCTION_OF = {
    (spatial_dims, transposed): function
    for function, (spatial_dims, transposed, _) in _WEIGHTED_FUNCTIONS.items()
    if spatial_dims
}
_CONV_MODULES: dict[type[nn.Module], tuple[int, bool]] = {
    nn.Conv1d: (1, False),
    nn.Conv2d: (2, False),
    nn.Conv3d: (3, False),
    nn.ConvTranspose1d: (1, True),
    nn.ConvTranspose2d: (2, True),
    nn.ConvTranspose3d: (3, True),
    nn.Linear: (0, False),
}


@dataclass
class WeightedOpView:
    """A convolution (any rank, plain or transposed) or a linear layer."""

    node: fx.Node
    form: Form
    spatial_dims: int  # 0 for linear
    transposed: bool
    groups: int
    weight: torch.Tensor | None  # None when the weight is computed in the graph
    bias: torch.Tensor | None
    weight_target: str | None  # attribute path of the weight, when it is a stored tensor
    bias_target: str | None
    module: nn.Module | None = None
    arguments: Arguments | None = None
    unsupported: str | None = None  # why a rewrite of this op cannot be trusted

    @property
    def kind(self) -> str:
        if self.spatial_dims == 0:
            return "linear"
        return f"conv_transpose{self.spatial_dims}d" if self.transposed else f"conv{self.spatial_dims}d"

    @property
    def input(self) -> fx.Node:
        return self.node.args[0]  # type: ignore[return-value]

    def set_weight(self, gm: fx.GraphModule, weight: torch.Tensor) -> None:
        assert self.weight_target is not None
        self.weight = replace_tensor(gm, self.weight_target, weight)

    def set_bias(self, gm: fx.GraphModule, bias: torch.Tensor) -> None:
        """Store a new bias; when there was none, create it (and its graph input) in the weight's role."""
        assert self.weight_target is not None and self.weight is not None
        if self.bias_target is not None:
            self.bias = replace_tensor(gm, self.bias_target, bias)
            return
        if self.module is not None:
            self.module.bias = nn.Parameter(bias.detach().clone(), requires_grad=self.weight.requires_grad)
            self.bias_target = f"{self.node.target}.bias"
        else:
            assert self.arguments is not None
            self.bias_target = add_tensor(gm, self.weight_target, "bias", bias.detach().clone(), self.weight)
            with gm.graph.inserting_before(self.node):
                self.arguments.set("bias", gm.graph.get_attr(self.bias_target))
        self.bias = get_attr(gm, self.bias_target)

    def to_function(self, gm: fx.GraphModule) -> None:
        """Turn a module call into the functional call it makes, reading the weights through get_attr.

        Module names, parameters and state_dict keys stay; the op's operands become graph
        values a pass can cast or rewrite. Only for supported (unmodified) modules.
        """
        assert self.module is not None and self.unsupported is None
        module, node = self.module, self.node
        if self.spatial_dims == 0:
            function, names, extra = F.linear, _LINEAR_NAMES, ()
        elif self.transposed:
            function = _FUNCTION_OF[(self.spatial_dims, True)]
            names = _CONV_T_NAMES
            extra = (module.stride, module.padding, module.output_padding, module.groups, module.dilation)
        else:
            function = _FUNCTION_OF[(self.spatial_dims, False)]
            names = _CONV_NAMES
            extra = (module.stride, module.padding, module.dilation, module.groups)
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
            call = gm.graph.call_function(function, (node.args[0], weight, bias, *extra))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        self.node, self.form, self.module = call, "function", None
        self.arguments = Arguments(call, names, {})

    def remove_bias(self, gm: fx.GraphModule) -> None:
        """Drop the bias: the op computes without it and the parameter leaves the module."""
        if self.module is not None:
            self.module.bias = None
        else:
            assert self.arguments is not None and self.bias_target is not None
            self.arguments.set("bias", None)
            for node in list(gm.graph.nodes):
                if node.op == "get_attr" and node.target == self.bias_target and not node.users:
                    gm.graph.erase_node(node)
            delete_attr(gm, self.bias_target)
        self.bias, self.bias_target = None, None


def weighted_op_view(gm: fx.GraphModule, node: fx.Node) -> WeightedOpView | None:
    """View of a conv/conv-transpose/linear node in any form, else ``None``."""
    if node.op == "call_module":
        module = called_module(gm, node)
        base = next((cls for cls in _CONV_MODULES if isinstance(module, cls)), None)
        if base is None:
            return None
        assert module is not None
        spatial_dims, transposed = _CONV_MODULES[base]
        unsupported = None
        if parametrize.is_parametrized(module):
            unsupported = f"{type(module).__name__} '{node.target}' is parametrized"
        elif type(module).forward is not base.forward:
            unsupported = f"{type(module).__name__} '{node.target}' overrides forward()"
        elif getattr(module, "padding_mode", "zeros") != "zeros":
            unsupported = f"{type(module).__name__} '{node.target}' uses padding_mode={module.padding_mode!r}"
        return WeightedOpView(
            node=node,
            form="module",
            spatial_dims=spatial_dims,
            transposed=transposed,
            groups=getattr(module, "groups", 1),
            weight=module.weight,
            bias=module.bias,
            weight_target=f"{node.target}.weight",
            bias_target=f"{node.target}.bias" if module.bias is not None else None,
            module=module,
            unsupported=unsupported,
        )
    if node.op != "call_function":
        return None
    if node.target in _WEIGHTED_FUNCTIONS:
        form: Form = "function"
        spatial_dims, transposed, signature = _WEIGHTED_FUNCTIONS[node.target]
    elif node.target in _WEIGHTED_ATEN:
        form = "aten"
        spatial_dims, transposed, signature = _WEIGHTED_ATEN[node.target]
    else:
        return None
    arguments = Arguments(node, signature.names, signature.defaults)
    weight, weight_target = _resolve(gm, arguments.get("weight"))
    bias, bias_target = _resolve(gm, arguments.get("bias"))
    if transposed is None:  # aten.convolution: read rank and kind from the arguments
        transposed = bool(arguments.get("transposed"))
        spatial_dims = len(arguments.get("stride"))
    unsupported = None
    if weight is None:
        unsupported = f"the weight of '{node.name}' is computed in the graph, not a stored parameter"
    elif arguments.get("bias") is not None and bias is None:
        unsupported = f"the bias of '{node.name}' is computed in the graph, not a stored parameter"
    return WeightedOpView(
        node=node,
        form=form,
        spatial_dims=spatial_dims,
        transposed=transposed,
        groups=int(arguments.get("groups") or 1) if spatial_dims else 1,
        weight=weight,
        bias=bias,
        weight_target=weight_target,
        bias_target=bias_target,
        arguments=arguments,
        unsupported=unsupported,
    )


# --------------------------------------------------------------------------- batch norm

_F_BATCH_NORM = _Signature(
    ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5},
)
_ATEN_BATCH_NORM = _Signature(
    ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled"),
)
_ATEN_BN_NO_TRAINING = _Signature(("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps"))
_ATEN_BN_LEGIT = _Signature(("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"))

# target -> (form, signature, returns a tuple whose item 0 is the result)
_BATCH_NORM_FUNCTIONS: dict[Any, tuple[Form, _Signature, bool]] = {
    F.batch_norm: ("function", _F_BATCH_NORM, False),
    torch.batch_norm: ("function", _ATEN_BATCH_NORM, False),
    aten.batch_norm.default: ("aten", _ATEN_BATCH_NORM, False),
    aten._native_batch_norm_legit_no_training.default: ("aten", _ATEN_BN_NO_TRAINING, True),
    aten._native_batch_norm_legit.default: ("aten", _ATEN_BN_LEGIT, True),
}


_BATCH_NORM_ROLES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _has_attr(root: nn.Module, target: str) -> bool:
    try:
        get_attr(root, target)
    except AttributeError:
        return False
    return True


@dataclass
class BatchNormView:
    """A batch normalisation in any form, with its statistics and affine parameters."""

    node: fx.Node
    form: Form
    input: fx.Node
    output: fx.Node | None  # node holding the normalised tensor; None if other results are used too
    training: bool  # normalises with batch statistics (and updates running ones)
    eps: float
    num_features: int | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    running_mean_target: str | None
    module: nn.Module | None = None
    unsupported: str | None = None
    # attribute path of each stored tensor, by role: weight, bias, running_mean, running_var, num_batches_tracked
    targets: dict[str, str] = field(default_factory=dict)



def batch_norm_view(gm: fx.GraphModule, node: fx.Node) -> BatchNormView | None:
    """View of a BatchNorm node (nn.BatchNormNd, F.batch_norm, ATen forms), else ``None``."""
    if node.op == "call_module":
        module = called_module(gm, node)
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            return None
        unsupported = None
        if type(module).forward not in (nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward):
            unsupported = f"{type(module).__name__} '{node.target}' overrides forward()"
        # Without running stats a BatchNorm normalises with batch statistics even in eval mode.
        training = module.training or not module.track_running_stats
        return BatchNormView(
            node=node,
            form="module",
            input=node.args[0],  # type: ignore[arg-type]
            output=node,
            training=training,
            eps=module.eps,
            num_features=module.num_features,
            weight=module.weight,
            bias=module.bias,
            running_mean=module.running_mean,
            running_var=module.running_var,
            running_mean_target=f"{node.target}.running_mean" if module.running_mean is not None else None,
            module=module,
            unsupported=unsupported,
            targets={role: f"{node.target}.{role}" for role in _BATCH_NORM_ROLES if getattr(module, role, None) is not None},
        )
    if node.op != "call_function" or node.target not in _BATCH_NORM_FUNCTIONS:
        return None
    form, signature, returns_tuple = _BATCH_NORM_FUNCTIONS[node.target]
    arguments = Arguments(node, signature.names, signature.defaults)
    weight, weight_target = _resolve(gm, arguments.get("weight"))
    bias, bias_target = _resolve(gm, arguments.get("bias"))
    running_mean, running_mean_target = _resolve(gm, arguments.get("running_mean"))
    running_var, running_var_target = _resolve(gm, arguments.get("running_var"))
    targets = {"weight": weight_target, "bias": bias_target, "running_mean": running_mean_target, "running_var": running_var_target}
    if running_mean_target is not None and running_mean_target.endswith("running_mean"):
        # the counter is not an argument: it lives beside the running mean
        counter = running_mean_target.removesuffix("running_mean") + "num_batches_tracked"
        targets["num_batches_tracked"] = counter if _has_attr(gm, counter) else None
    unsupported = None
    for name, value in (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)):
        if arguments.get(name) is not None and value is None:
            unsupported = f"the {name} of '{node.name}' is computed in the graph, not a stored tensor"
    output: fx.Node | None = node
    if returns_tuple:
        users = list(node.users)
        is_first_item = [u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users]
        output = users[0] if len(users) == 1 and is_first_item[0] else None
    training = bool(arguments.get("training")) if "training" in signature.names else False
    return BatchNormView(
        node=node,
        form=form,
        input=node.args[0],  # type: ignore[arg-type]
        output=output,
        training=training,
        eps=float(arguments.get("eps")),
        num_features=running_mean.numel() if running_mean is not None else None,
        weight=weight,
        bias=bias,
        running_mean=running_mean,
        running_var=running_var,
        running_mean_target=running_mean_target,
        unsupported=unsupported,
        targets={role: target for role, target in targets.items() if target is not None},
    )


# --------------------------------------------------------------------------- dropout / identity

_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_DROPOUT_NAMES = _Signature(("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False})
_ATEN_DROPOUT_NAMES = _Signature(("input", "p", "train"))
# target -> signature; F.* default to training=True, which is why the argument is read, not assumed
_DROPOUT_FUNCTIONS: dict[Any, tuple[Form, _Signature]] = {
    F.dropout: ("function", _DROPOUT_NAMES),
    F.dropout1d: ("function", _DROPOUT_NAMES),
    F.dropout2d: ("function", _DROPOUT_NAMES),
    F.dropout3d: ("function", _DROPOUT_NAMES),
    F.alpha_dropout: ("function", _DROPOUT_NAMES),
    F.feature_alpha_dropout: ("function", _DROPOUT_NAMES),
    torch.dropout: ("function", _ATEN_DROPOUT_NAMES),
    torch.alpha_dropout: ("function", _ATEN_DROPOUT_NAMES),
    torch.feature_alpha_dropout: ("function", _ATEN_DROPOUT_NAMES),
    torch.feature_dropout: ("function", _ATEN_DROPOUT_NAMES),
    aten.dropout.default: ("aten", _ATEN_DROPOUT_NAMES),
    aten.dropout_.default: ("aten", _ATEN_DROPOUT_NAMES),
    aten.alpha_dropout.default: ("aten", _ATEN_DROPOUT_NAMES),
    aten.feature_dropout.default: ("aten", _ATEN_DROPOUT_NAMES),
    aten.feature_alpha_dropout.default: ("aten", _ATEN_DROPOUT_NAMES),
}


# dropouts that draw one number per (sample, channel), a (N, C, 1, ...) mask, not one per element
_PER_CHANNEL_DROPOUTS = frozenset({
    "Dropout1d", "Dropout2d", "Dropout3d", "FeatureAlphaDropout", "dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout",
    "feature_dropout",
})  # fmt: skip


@dataclass
class DropoutView:
    """A dropout (any flavour) or an identity: passes its input through when inactive."""

    node: fx.Node
    form: Form
    input: Any
    active: bool  # randomly drops values when executed
    kind: str

    @property
    def per_element(self) -> bool:
        """Whether it draws one random number per element (in memory order), not one per channel."""
        return self.kind != "identity" and self.kind.split(".")[0] not in _PER_CHANNEL_DROPOUTS


def dropout_view(gm: fx.GraphModule, node: fx.Node) -> DropoutView | None:
    """View of a dropout or identity node in any form, else ``None``."""
    if node.op == "call_module":
        module = called_module(gm, node)
        if type(module) is nn.Identity:
            return DropoutView(node, "module", node.args[0] if node.args else None, False, "identity")
        if not isinstance(module, _DROPOUT_MODULES):
            return None
        active = module.training and module.p > 0
        return DropoutView(node, "module", node.args[0], active, type(module).__name__)
    if node.op != "call_function" or node.target not in _DROPOUT_FUNCTIONS:
        return None
    form, signature = _DROPOUT_FUNCTIONS[node.target]
    arguments = Arguments(node, signature.names, signature.defaults)
    training = arguments.get("training") if "training" in signature.names else arguments.get("train")
    active = bool(training) and float(arguments.get("p")) > 0
    return DropoutView(node, form, node.args[0], active, getattr(node.target, "__name__", str(node.target)))


# --------------------------------------------------------------------------- activations

# kind -> its parameters with their defaults (ReLU6 is hardtanh(0, 6))
_ACTIVATION_PARAMETERS: dict[str, dict[str, Any]] = {
    "relu": {}, "silu": {}, "hardswish": {}, "sigmoid": {}, "tanh": {}, "hardsigmoid": {},
    "hardtanh": {"min_val": -1.0, "max_val": 1.0}, "gelu": {"approximate": "none"}, "leaky_relu": {"negative_slope": 0.01},
}
_ACTIVATION_MODULES: dict[type[nn.Module], str] = {
    nn.ReLU: "relu", nn.ReLU6: "hardtanh", nn.Hardtanh: "hardtanh", nn.SiLU: "silu", nn.GELU: "gelu",
    nn.Hardswish: "hardswish", nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Hardsigmoid: "hardsigmoid", nn.LeakyReLU: "leaky_relu",
}
# target -> (kind, argument names after the input); in-place flags are accepted: the input is an op's fresh output
_ACTIVATION_FUNCTIONS: dict[Any, tuple[str, tuple[str, ...]]] = {
    F.relu: ("relu", ("inplace",)), torch.relu: ("relu", ()), aten.relu.default: ("relu", ()), aten.relu_.default: ("relu", ()),
    aten.hardtanh_.default: ("hardtanh", ("min_val", "max_val")), aten.silu_.default: ("silu", ()),
    aten.hardswish_.default: ("hardswish", ()), aten.hardsigmoid_.default: ("hardsigmoid", ()),
    aten.leaky_relu_.default: ("leaky_relu", ("negative_slope",)),
    F.relu6: ("relu6", ("inplace",)), aten.relu6.default: ("relu6", ()), F.hardtanh: ("hardtanh", ("min_val", "max_val", "inplace")),
    aten.hardtanh.default: ("hardtanh", ("min_val", "max_val")),
    F.silu: ("silu", ("inplace",)), aten.silu.default: ("silu", ()),
    F.gelu: ("gelu", ("approximate",)), aten.gelu.default: ("gelu", ("approximate",)),
    F.hardswish: ("hardswish", ("inplace",)), aten.hardswish.default: ("hardswish", ()),
    torch.sigmoid: ("sigmoid", ()), F.sigmoid: ("sigmoid", ()), aten.sigmoid.default: ("sigmoid", ()),
    torch.tanh: ("tanh", ()), F.tanh: ("tanh", ()), aten.tanh.default: ("tanh", ()),
    F.hardsigmoid: ("hardsigmoid", ("inplace",)), aten.hardsigmoid.default: ("hardsigmoid", ()),
    F.leaky_relu: ("leaky_relu", ("negative_slope", "inplace")), aten.leaky_relu.default: ("leaky_relu", ("negative_slope",)),
}
_ACTIVATION_METHODS = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}


@dataclass
class ActivationView:
    """A pointwise activation (relu, relu6/hardtanh, silu, gelu, hardswish, sigmoid, tanh, hardsigmoid, leaky_relu)."""

    node: fx.Node
    input: Any
    kind: str
    parameters: dict[str, Any]  # e.g. hardtanh's min_val/max_val, gelu's approximate


def activation_view(gm: fx.GraphModule, node: fx.Node) -> ActivationView | None:
    """View of an activation node in module, function, method or ATen form, else ``None``."""
    if node.op == "call_module":
        module = called_module(gm, node)
        kind = _ACTIVATION_MODULES.get(type(module))  # exact types: a subclass may override forward()
        if kind is None or len(node.args) != 1 or node.kwargs:
            return None
        parameters = {name: getattr(module, name, default) for name, default in _ACTIVATION_PARAMETERS[kind].items()}
        if isinstance(module, nn.ReLU6):
            parameters = {"min_val": 0.0, "max_val": 6.0}
        return ActivationView(node, node.args[0], kind, parameters)
    if node.op == "call_method" and node.target in _ACTIVATION_METHODS and len(node.args) == 1 and not node.kwargs:
        return ActivationView(node, node.args[0], _ACTIVATION_METHODS[str(node.target)], {})
    if node.op != "call_function" or node.target not in _ACTIVATION_FUNCTIONS or not node.args:
        return None
    kind, names = _ACTIVATION_FUNCTIONS[node.target]
    arguments = Arguments(node, ("input", *names), {})
    if kind == "relu6":
        return ActivationView(node, node.args[0], "hardtanh", {"min_val": 0.0, "max_val": 6.0})
    defaults = _ACTIVATION_PARAMETERS[kind]
    parameters = {name: default if arguments.get(name) is None else arguments.get(name) for name, default in defaults.items()}
    return ActivationView(node, node.args[0], kind, parameters)


# --------------------------------------------------------------------------- parameter sharing


class ParameterUsage:
    """Who reads each stored tensor: tied parameters and reused modules block in-place rewrites."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self._names: dict[int, list[str]] = {}
        for name, tensor in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
            self._names.setdefault(id(tensor), []).append(name)
        self._reads: dict[str, int] = {}
        for node in gm.graph.nodes:
            # a stored tensor is read once per user of its get_attr nodes; a module once per call
            reads = len(node.users) if node.op == "get_attr" else 1 if node.op == "call_module" else 0
            if reads:
                self._reads[str(node.target)] = self._reads.get(str(node.target), 0) + reads

    def sharing(self, view: WeightedOpView) -> str | None:
        """Why ``view``'s parameters cannot be rewritten in place without affecting another op, or None."""
        if view.module is not None:
            calls = self._reads.get(str(view.node.target), 0)
            if calls > 1:
                return f"module '{view.node.target}' is called at {calls} places"
        for label, tensor, target in (("weight", view.weight, view.weight_target), ("bias", view.bias, view.bias_target)):
            if tensor is None or target is None:
                continue
            names = self._names.get(id(tensor), [])
            if len(names) > 1:
                others = ", ".join(n for n in names if n != target)
                return f"{label} '{target}' is tied to {others}"
            if view.module is None and self._reads.get(target, 0) > 1:
                return f"{label} '{target}' is also read by another op"
        return None

    def is_shared(self, tensor: torch.Tensor) -> bool:
        return len(self._names.get(id(tensor), [])) > 1

    def reads(self, target: str) -> int:
        """How many times the graph reads the stored tensor (or calls the module) at ``target``."""
        return self._reads.get(target, 0)


# --------------------------------------------------------------------------- layout


_RESHAPE_METHODS = {"view", "reshape", "flatten", "view_as", "reshape_as"}
_RESHAPE_TARGETS = {
    torch.flatten,
    torch.reshape,
    aten.view.default,
    aten.reshape.default,
    aten.flatten.using_ints,
    aten._unsafe_view.default,
    aten.view_as.default,
    aten.reshape_as.default,
}
_PERMUTE_METHODS = {"permute", "transpose", "movedim", "t"}
_PERMUTE_TARGETS = {torch.permute, torch.transpose, torch.movedim, aten.permute.default, aten.transpose.int, aten.movedim.int}


def _matches(gm: nn.Module, node: fx.Node, methods: Collection[str], targets: Collection[Any], modules: tuple[type, ...] = ()) -> bool:
    if node.op == "call_method":
        return node.target in methods
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_module" and modules:
        return isinstance(gm.get_submodule(str(node.target)), modules)
    return False


def is_reshape(gm: nn.Module, node: fx.Node) -> bool:
    """view/reshape/flatten in any form: they read their input in row-major (NCHW) order."""
    return _matches(gm, node, _RESHAPE_METHODS, _RESHAPE_TARGETS, (nn.Flatten,))


def is_permute(gm: nn.Module, node: fx.Node) -> bool:
    """permute/transpose/movedim in any form: they change which dimension is which, not the data."""
    return _matches(gm, node, _PERMUTE_METHODS, _PERMUTE_TARGETS)


def layout_key(value: Any) -> tuple[Any, ...] | None:
    """A tensor's shape, dtype and strides (of dims larger than 1, whose strides matter), else None.

    Two tensors with equal keys are laid out alike: one can stand in for the other.
    """
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(value.shape), value.dtype, tuple(stride for stride, size in zip(value.stride(), value.shape) if size > 1)


def permute_dims(node: fx.Node) -> list[int] | None:
    """The dims of a permute (``x.permute(0, 2, 3, 1)``, ``torch.permute(x, [...])``, ATen), made non-negative, else None."""
    if node.op == "call_method" and node.target == "permute":
        dims: Any = node.args[1:]
        dims = dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims
    elif node.op == "call_function" and node.target in (torch.permute, aten.permute.default):
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dims")
    else:
        return None
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return [d % len(dims) for d in dims]


def layout_of(value: Any) -> str | None:
    """Memory layout of a 4-D/5-D tensor: "channels_last", "contiguous", "any" (both, e.g. N,C,1,1) or "strided"."""
    if not isinstance(value, torch.Tensor) or value.dim() not in (4, 5):
        return None
    channels_last = torch.channels_last if value.dim() == 4 else torch.channels_last_3d
    contiguous, last = value.is_contiguous(), value.is_contiguous(memory_format=channels_last)
    if contiguous and last:
        return "any"
    return "channels_last" if last else "contiguous" if contiguous else "strided"


def interpreter_inputs(gm: fx.GraphModule, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The values of ``gm``'s placeholders for ``gm(*args)``: a torch.export module flattens its inputs."""
    return tuple(pytree.tree_leaves(args)) if getattr(gm, "_in_spec", None) is not None else args


# --------------------------------------------------------------------------- attention parts

_MATMUL_METHODS = {"matmul", "bmm"}
_MATMUL_TARGETS = {operator.matmul, torch.matmul, torch.bmm, aten.matmul.default, aten.bmm.default}
# binary arithmetic: kind -> (methods, targets); keyword arguments (alpha, rounding_mode) are not accepted
_ARITHMETIC: dict[str, tuple[set[str], set[Any]]] = {
    "mul": ({"mul"}, {operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar}),
    "div": ({"div"}, {operator.truediv, torch.div, torch.true_divide, aten.div.Tensor, aten.div.Scalar}),
    "add": ({"add"}, {operator.add, torch.add, aten.add.Tensor}),
}
# softmax target -> argument names (F.softmax has a _stacklevel before dtype, aten._softmax a half_to_float flag)
_SOFTMAX_SIGNATURES: dict[Any, tuple[str, ...]] = {
    F.softmax: ("input", "dim", "_stacklevel", "dtype"),
    torch.softmax: ("input", "dim", "dtype"),
    aten.softmax.int: ("input", "dim", "dtype"),
    aten._softmax.default: ("input", "dim", "half_to_float"),
}


def form_of(node: fx.Node) -> Form:
    """The spelling a node uses: "aten" for torch.export's ATen ops, else "module"/"function"."""
    if node.op == "call_module":
        return "module"
    return "aten" if isinstance(node.target, torch._ops.OpOverload) else "function"


def matmul_operands(gm: nn.Module, node: fx.Node) -> tuple[Any, Any] | None:
    """The two operands of a matmul/bmm (``a @ b``, ``torch.matmul``, ``aten.bmm``, ...), else None."""
    if len(node.args) != 2 or node.kwargs or not _matches(gm, node, _MATMUL_METHODS, _MATMUL_TARGETS):
        return None
    return node.args[0], node.args[1]


def arithmetic_operands(gm: nn.Module, node: fx.Node, kind: str) -> tuple[Any, Any] | None:
    """The operands of a plain binary ``kind`` ("mul", "div", "add") with no alpha/rounding mode, else None."""
    methods, targets = _ARITHMETIC[kind]
    if len(node.args) != 2 or node.kwargs or not _matches(gm, node, methods, targets):
        return None
    return node.args[0], node.args[1]


@dataclass
class SoftmaxView:
    """A softmax in any form, with the dimension it normalises (None: implicit) and its dtype argument."""

    node: fx.Node
    input: Any
    dim: int | None
    dtype: Any  # a dtype argument (or aten._softmax's half_to_float) that changes the result's dtype


def softmax_view(gm: fx.GraphModule, node: fx.Node) -> SoftmaxView | None:
    """View of a softmax node (nn.Softmax, ``x.softmax``, F.softmax, ATen), else None."""
    if node.op == "call_module":
        module = called_module(gm, node)
        if type(module) is not nn.Softmax:
            return None
        return SoftmaxView(node, node.args[0], module.dim, None)
    if node.op == "call_method" and node.target == "softmax":
        names: tuple[str, ...] = ("input", "dim", "dtype")
    elif node.op == "call_function" and node.target in _SOFTMAX_SIGNATURES:
        names = _SOFTMAX_SIGNATURES[node.target]
    else:
        return None
    arguments = Arguments(node, names, {})
    dtype = arguments.get("half_to_float") if "half_to_float" in names else arguments.get("dtype")
    return SoftmaxView(node, node.args[0], arguments.get("dim"), dtype or None)


def swapped_last_dims_input(gm: nn.Module, node: fx.Node, rank: int) -> Any:
    """The input of a transpose/permute that swaps the last two dims of a rank-``rank`` tensor, else None."""
    if not is_permute(gm, node) or node.kwargs:
        return None
    method = node.op == "call_method" and node.target
    if method == "transpose" or node.target in (torch.transpose, aten.transpose.int):
        dims = sorted(d % rank for d in node.args[1:])
        return node.args[0] if dims == [rank - 2, rank - 1] else None
    if permute_dims(node) == [*range(rank - 2), rank - 1, rank - 2]:
        return node.args[0]
    return None


# --------------------------------------------------------------------------- precision families


@dataclass(frozen=True)
class _Family:
    methods: frozenset[str] = frozenset()
    targets: frozenset[Any] = frozenset()
    modules: tuple[type, ...] = ()


def _family(methods: tuple[str, ...] = (), targets: tuple[Any, ...] = (), modules: tuple[type, ...] = ()) -> _Family:
    return _Family(frozenset(methods), frozenset(targets), modules)


_LOSS_FUNCTIONS = (
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.cosine_embedding_loss,
)
_LOSS_ATEN = (
    aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default, aten.mse_loss.default,
    aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default, aten.kl_div.default,
    aten.binary_cross_entropy.default, aten.binary_cross_entropy_with_logits.default,
)

# Named op families for the precision policy. conv and linear are recognised by weighted_op_view.
PRECISION_FAMILIES: dict[str, _Family] = {
    "matmul": _family(("matmul", "mm"), (torch.matmul, operator.matmul, torch.mm, aten.matmul.default, aten.mm.default)),
    "bmm": _family(("bmm",), (torch.bmm, aten.bmm.default)),
    "baddbmm": _family(("baddbmm", "addmm", "addbmm"), (torch.baddbmm, torch.addmm, torch.addbmm, aten.baddbmm.default, aten.addmm.default)),
    "scaled_dot_product_attention": _family(
        (), (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
    ),
    "softmax": _family(("softmax",), (F.softmax, torch.softmax, aten.softmax.int, aten._softmax.default), (nn.Softmax, nn.Softmax2d)),
    "log_softmax": _family(("log_softmax",), (F.log_softmax, torch.log_softmax, aten.log_softmax.int, aten._log_softmax.default), (nn.LogSoftmax,)),
    "layer_norm": _family((), (F.layer_norm, aten.layer_norm.default, aten.native_layer_norm.default), (nn.LayerNorm,)),
    "group_norm": _family((), (F.group_norm, aten.group_norm.default, aten.native_group_norm.default), (nn.GroupNorm,)),
    "instance_norm": _family((), (F.instance_norm, aten.instance_norm.default), (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)),
    "exp": _family(("exp",), (torch.exp, aten.exp.default)),
    "log": _family(("log",), (torch.log, aten.log.default)),
    "pow": _family(("pow",), (torch.pow, operator.pow, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor)),
    "sum": _family(("sum",), (torch.sum, aten.sum.dim_IntList, aten.sum.default)),
    "mean": _family(("mean",), (torch.mean, aten.mean.dim, aten.mean.default)),
    "norm": _family(("norm",), (torch.norm, torch.linalg.vector_norm, aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim)),
    "cumsum": _family(("cumsum",), (torch.cumsum, aten.cumsum.default)),
    "loss": _family((), (*_LOSS_FUNCTIONS, *_LOSS_ATEN), (nn.modules.loss._Loss,)),
}
PRECISION_FAMILY_NAMES = ("conv", "linear", *PRECISION_FAMILIES)


def precision_family(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The precision-policy family of ``node`` ("conv", "linear", "softmax", ...), or None."""
    weighted = weighted_op_view(gm, node)
    if weighted is not None:
        return "linear" if weighted.kind == "linear" else "conv"
    for name, family in PRECISION_FAMILIES.items():
        if _matches(gm, node, family.methods, family.targets, family.modules):
            return name
    return None


# --------------------------------------------------------------------------- device moves, casts, factories


def _schema_arguments(node: fx.Node) -> Arguments:
    """Named access to an ATen call's arguments, from the op's own schema."""
    schema = node.target._schema  # type: ignore[union-attr]
    names = tuple(a.name for a in schema.arguments)
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return Arguments(node, names, defaults)


_TO_ATEN = (aten.to.device, aten.to.dtype, aten.to.dtype_layout, aten.to.other, aten._to_copy.default)
_CAST_METHODS = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
    "long": torch.int64, "int": torch.int32, "short": torch.int16, "bool": torch.bool,
}


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
    """

    node: fx.Node
    form: Form
    input: fx.Node
    device: torch.device | fx.Node | None
    dtype: torch.dtype | fx.Node | None
    non_blocking: bool
    copy: bool  # copies even when nothing changes (copy=True, aten._to_copy)
    memory_format: torch.memory_format | None

    def set_non_blocking(self) -> None:
        if self.form == "aten":
            _schema_arguments(self.node).set("non_blocking", True)
        else:
            self.node.kwargs = {**self.node.kwargs, "non_blocking": True}
        self.non_blocking = True

    def set_copy(self, copy: bool) -> None:
        """Ask for a copy or not (``to`` forms only; a copy is never needed when dtype and device change)."""
        if self.form == "aten":
            _schema_arguments(self.node).set("copy", copy)
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
    return TransferView(
        node, "function", source, device, dtype, bool(kwargs.get("non_blocking", False)), bool(kwargs.get("copy", False)),
        kwargs.get("memory_format"),
    )


def transfer_view(gm: fx.GraphModule, node: fx.Node) -> TransferView | None:
    """View of a device move or dtype cast in method or ATen form, else ``None``."""
    if node.op == "call_method":
        try:
            return _method_transfer(node)
        except (TypeError, RuntimeError):  # a device argument graphopt cannot read (computed in the graph)
            return None
    if node.op != "call_function" or node.target not in _TO_ATEN:
        return None
    arguments = _schema_arguments(node)
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


# --------------------------------------------------------------------------- channel-wise pointwise ops

_UNARY_POINTWISE = _family(
    ("relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu", "elu", "mish", "clamp"),
    (
        torch.relu, F.relu, F.relu6, F.gelu, F.silu, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.hardswish,
        F.hardsigmoid, F.leaky_relu, F.elu, F.mish, torch.clamp, F.hardtanh,
        aten.relu.default, aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
        aten.hardswish.default, aten.hardsigmoid.default, aten.leaky_relu.default, aten.elu.default, aten.mish.default,
        aten.clamp.default, aten.hardtanh.default,
    ),
    (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Hardtanh),
)


def is_unary_pointwise(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An activation applied to each element on its own (ReLU, GELU, SiLU, sigmoid, ...), in any form."""
    return _matches(gm, node, _UNARY_POINTWISE.methods, _UNARY_POINTWISE.targets, _UNARY_POINTWISE.modules)


# --------------------------------------------------------------------------- pointwise

_POINTWISE_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.abs, torch.exp, torch.sqrt, torch.rsqrt,
    torch.pow, torch.clamp, torch.clip, torch.maximum, torch.minimum, torch.where, torch.erf, torch.reciprocal,
    torch.relu, torch.sigmoid, torch.tanh,
    F.relu, F.relu6, F.gelu, F.silu, F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.leaky_relu, F.elu,
    F.softplus, F.sigmoid, F.tanh,
})  # fmt: skip
_POINTWISE_METHODS = frozenset({
    "add", "sub", "mul", "div", "neg", "abs", "exp", "sqrt", "rsqrt", "pow", "clamp", "clip", "erf", "reciprocal",
    "relu", "sigmoid", "tanh",
})  # fmt: skip
_UNTAGGED_POINTWISE_ATEN = frozenset({aten.hardswish.default})  # elementwise, though not tagged pointwise
_FLOAT_CAST_METHODS = frozenset({"float", "half", "bfloat16", "double"})
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _activation(function: Any, **attributes: str) -> Any:
    """How an activation module calls its functional form: (function, kwargs read from the module)."""
    return lambda module: (function, {name: getattr(module, attribute) for name, attribute in attributes.items()})


# Activation modules and the functional call each makes. Looked up by exact type: a subclass may override forward.
_ACTIVATION_CALLS: dict[type, Any] = {
    nn.ReLU: _activation(F.relu),
    nn.ReLU6: _activation(F.relu6),
    nn.GELU: _activation(F.gelu, approximate="approximate"),
    nn.SiLU: _activation(F.silu),
    nn.Mish: _activation(F.mish),
    nn.Hardswish: _activation(F.hardswish),
    nn.Hardsigmoid: _activation(F.hardsigmoid),
    nn.Hardtanh: _activation(F.hardtanh, min_val="min_val", max_val="max_val"),
    nn.LeakyReLU: _activation(F.leaky_relu, negative_slope="negative_slope"),
    nn.ELU: _activation(F.elu, alpha="alpha"),
    nn.Sigmoid: _activation(torch.sigmoid),
    nn.Tanh: _activation(torch.tanh),
}


@dataclass(frozen=True)
class PointwiseView:
    """An elementwise op: each output element depends only on the same element of its inputs.

    ``in_place`` ops write their result into ``node.args[0]`` (``nn.ReLU(inplace=True)``,
    ``F.relu(x, inplace=True)``, ``x.add_(y)``, ``aten.relu_``).
    """

    node: fx.Node
    form: Form
    in_place: bool

    def to_function(self, gm: fx.GraphModule) -> None:
        """Rewrite the op as an out-of-place ``call_function`` (activation modules become their functional form).

        Only exact when nothing else reads the input after the op: the caller checks that.
        """
        node = self.node
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            function, kwargs = _ACTIVATION_CALLS[type(module)](module)
            node.op, node.target, node.kwargs = "call_function", function, kwargs
        elif node.op == "call_function" and "inplace" in node.kwargs:
            node.kwargs = {**node.kwargs, "inplace": False}
        elif node.op == "call_function" and self.in_place:  # inplace passed positionally
            args = list(node.args)
            args[_parameter_names(node.target).index("inplace")] = False
            node.args = tuple(args)


def _is_cast(node: fx.Node) -> bool:
    """A dtype-only conversion: ``x.to(dtype)``, ``x.float()``, ``aten._to_copy(x, dtype=...)``."""
    if node.op == "call_method" and node.target in _FLOAT_CAST_METHODS:
        return len(node.args) == 1 and not node.kwargs
    if node.op == "call_method" and node.target == "to":
        return len(node.args) == 2 and node.args[1] in _FLOAT_DTYPES and not node.kwargs
    if node.op == "call_function" and node.target in (aten._to_copy.default, aten.to.dtype):
        return set(node.kwargs) <= {"dtype"} and len(node.args) <= (2 if node.target is aten.to.dtype else 1)
    return False


def pointwise_view(gm: fx.GraphModule, node: fx.Node) -> PointwiseView | None:
    """A view of ``node`` when it is an elementwise op (activation, arithmetic, dtype cast), else ``None``.

    The caller still checks that the op computes a tensor: ``operator.add`` also adds sizes.
    """
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if type(module) not in _ACTIVATION_CALLS:
            return None
        return PointwiseView(node, "module", bool(getattr(module, "inplace", False)))
    if node.op == "call_method":
        if node.target in _POINTWISE_METHODS or _is_cast(node):
            return PointwiseView(node, "function", False)
        if isinstance(node.target, str) and node.target.endswith("_") and node.target[:-1] in _POINTWISE_METHODS:
            return PointwiseView(node, "function", True)
        return None
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        if torch.Tag.pointwise in node.target.tags or node.target in _UNTAGGED_POINTWISE_ATEN or _is_cast(node):
            return PointwiseView(node, "aten", node.target._schema.is_mutable)
        return None
    if node.target not in _POINTWISE_FUNCTIONS:
        return None
    in_place = node.kwargs.get("inplace") is True
    names = _parameter_names(node.target)
    if not in_place and "inplace" in names:
        index = names.index("inplace")
        in_place = len(node.args) > index and node.args[index] is True
    return PointwiseView(node, "function", in_place)


def _parameter_names(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # builtins such as torch.add have no Python signature
        return ()

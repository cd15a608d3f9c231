"""Batch normalisation in every form: `BatchNormView` and `batch_norm_view`, with its statistics and affine parameters."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops.arguments import call_arguments, graph_values
from graphopt.ops.graph import Form, called_module, get_attr, stored_tensor

aten = torch.ops.aten

# target -> (form, the op whose schema or signature names its arguments (None: the target itself; torch.batch_norm
# has no Python signature), returns a tuple whose item 0 is the result)
_BATCH_NORM_FUNCTIONS: dict[Any, tuple[Form, Any, bool]] = {
    F.batch_norm: ("function", None, False),
    torch.batch_norm: ("function", aten.batch_norm.default, False),
    aten.batch_norm.default: ("aten", None, False),
    aten._native_batch_norm_legit_no_training.default: ("aten", None, True),
    aten._native_batch_norm_legit.default: ("aten", None, True),
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
    training: bool  # normalises with batch statistics (and updates running ones); True when unknown (a graph value)
    eps: float | None  # None when it is a graph value (``unsupported`` says so)
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


def _module_view(gm: fx.GraphModule, node: fx.Node) -> BatchNormView | None:
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


def batch_norm_view(gm: fx.GraphModule, node: fx.Node) -> BatchNormView | None:
    """View of a BatchNorm node (nn.BatchNormNd, F.batch_norm, ATen forms), else ``None``."""
    if node.op == "call_module":
        return _module_view(gm, node)
    if node.op != "call_function" or node.target not in _BATCH_NORM_FUNCTIONS:
        return None
    form, named_by, returns_tuple = _BATCH_NORM_FUNCTIONS[node.target]
    arguments = call_arguments(node, named_by)
    weight, weight_target = stored_tensor(gm, arguments.get("weight"))
    bias, bias_target = stored_tensor(gm, arguments.get("bias"))
    running_mean, running_mean_target = stored_tensor(gm, arguments.get("running_mean"))
    running_var, running_var_target = stored_tensor(gm, arguments.get("running_var"))
    targets = {"weight": weight_target, "bias": bias_target, "running_mean": running_mean_target, "running_var": running_var_target}
    if running_mean_target is not None and running_mean_target.endswith("running_mean"):
        # the counter is not an argument: it lives beside the running mean
        counter = running_mean_target.removesuffix("running_mean") + "num_batches_tracked"
        targets["num_batches_tracked"] = counter if _has_attr(gm, counter) else None
    # momentum is not read: folding ignores it and a dropped bias stays exact under any momentum
    unsupported = arguments.not_constant("training", "eps")
    for name, value in (("weight", weight), ("bias", bias), ("running_mean", running_mean), ("running_var", running_var)):
        if arguments.get(name) is not None and value is None:
            unsupported = f"the {name} of '{node.name}' is computed in the graph, not a stored tensor"
    output: fx.Node | None = node
    if returns_tuple:
        users = list(node.users)
        is_first_item = [u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in users]
        output = users[0] if len(users) == 1 and is_first_item[0] else None
    flag = arguments.get("training") if "training" in arguments.names else False
    training = True if graph_values(flag) else bool(flag)  # unknown: read as batch statistics, which no pass folds
    eps = arguments.get("eps")
    return BatchNormView(
        node=node,
        form=form,
        input=node.args[0],  # type: ignore[arg-type]
        output=output,
        training=training,
        eps=None if graph_values(eps) else float(eps),
        num_features=running_mean.numel() if running_mean is not None else None,
        weight=weight,
        bias=bias,
        running_mean=running_mean,
        running_var=running_var,
        running_mean_target=running_mean_target,
        unsupported=unsupported,
        targets={role: target for role, target in targets.items() if target is not None},
    )

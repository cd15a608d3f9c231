"""The op families of the precision policy: `PRECISION_FAMILIES`, `PRECISION_FAMILY_NAMES` and `precision_family`."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops.graph import is_call_to
from graphopt.ops.weighted import weighted_op_view

aten = torch.ops.aten


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
        if is_call_to(gm, node, family.methods, family.targets, family.modules):
            return name
    return None

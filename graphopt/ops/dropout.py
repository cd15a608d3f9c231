"""Dropouts (every flavour) and identities: `DropoutView` and `dropout_view`, whether the op is active and how it draws."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops.arguments import call_arguments, graph_values
from graphopt.ops.graph import Form, called_module

aten = torch.ops.aten

_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# target -> (form, the op whose schema or signature names its arguments; None: the target itself). F.* default to
# training=True, which is why the argument is read, not assumed. F.alpha_dropout and F.feature_alpha_dropout default
# to training=False but are read as F.dropout is: omitting it reads as active, the safe mistake (the op is kept).
_DROPOUT_FUNCTIONS: dict[Any, tuple[Form, Any]] = {
    F.dropout: ("function", None),
    F.dropout1d: ("function", None),
    F.dropout2d: ("function", None),
    F.dropout3d: ("function", None),
    F.alpha_dropout: ("function", F.dropout),
    F.feature_alpha_dropout: ("function", F.dropout),
    torch.dropout: ("function", aten.dropout.default),
    torch.alpha_dropout: ("function", aten.alpha_dropout.default),
    torch.feature_alpha_dropout: ("function", aten.feature_alpha_dropout.default),
    torch.feature_dropout: ("function", aten.feature_dropout.default),
    aten.dropout.default: ("aten", None),
    aten.dropout_.default: ("aten", None),
    aten.alpha_dropout.default: ("aten", None),
    aten.feature_dropout.default: ("aten", None),
    aten.feature_alpha_dropout.default: ("aten", None),
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
    active: bool  # randomly drops values when executed; True when unknown (``unsupported`` says why)
    kind: str
    unsupported: str | None = None  # why whether it is active is unknown: its p or training is a graph value

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
    form, named_by = _DROPOUT_FUNCTIONS[node.target]
    arguments = call_arguments(node, named_by)
    flag = "training" if "training" in arguments.names else "train"
    training, p = arguments.get(flag), arguments.get("p")
    kind = getattr(node.target, "__name__", str(node.target))
    if (not graph_values(training) and not training) or (not graph_values(p) and float(p) == 0):
        return DropoutView(node, form, node.args[0], False, kind)
    # active unless a graph value (a forward() argument) turns it off at run time: read as active, the safe side
    return DropoutView(node, form, node.args[0], True, kind, arguments.not_constant(flag, "p"))

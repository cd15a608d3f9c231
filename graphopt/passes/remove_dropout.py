"""remove_dropout: remove inactive dropout and identity ops from an inference graph.

Pattern: ``nn.Dropout*/nn.AlphaDropout/nn.Identity`` modules, ``F.dropout*``,
``torch.dropout`` and ``aten.dropout`` (and their alpha/feature variants). In eval mode
they return their input; removing them saves a call (and, for some backends, a copy)
and lets later passes see through them. Users of the node read its input instead.

Guard: a dropout that is active in this graph (``F.dropout(x, p)`` defaults to
``training=True`` even in an eval model, e.g. Monte-Carlo dropout) is kept, with the
reason recorded; so is one whose ``p`` or ``training`` is a graph value (a forward()
argument): whether it is active is known only at run time.
"""

from __future__ import annotations

import torch.fx as fx

from graphopt.ops import dropout_view
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport


def remove_dropout(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Remove dropout and identity ops that do nothing at inference."""
    report = PassReport("remove_dropout")
    for node in list(gm.graph.nodes):
        dropout = dropout_view(gm, node)
        if dropout is None:
            continue
        if dropout.unsupported is not None:
            report.skip(node, f"{dropout.kind} may be active at run time: {dropout.unsupported}")
            continue
        if dropout.active:
            report.skip(node, f"{dropout.kind} is active (training=True, p > 0) in this graph; removing it would change outputs")
            continue
        if not isinstance(dropout.input, fx.Node):
            report.skip(node, f"{dropout.kind} input is not a graph value")
            continue
        report.rewrite(node, f"removed {dropout.kind}")
        node.replace_all_uses_with(dropout.input)
        gm.graph.erase_node(node)
    return finish(gm, bool(report.rewrites), report)

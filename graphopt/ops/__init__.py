"""Op views: recognise an op family in every graph form and give uniform access to it.

A captured graph spells the same operation three ways:

- ``call_module``: ``self.conv(x)`` with an ``nn.Conv2d`` (symbolic_trace of module code);
- ``call_function``: ``F.conv2d(x, self.weight, ...)`` (symbolic_trace of functional code);
- ATen: ``torch.ops.aten.conv2d.default(x, w, ...)`` (torch.export).

Each ``*_view(gm, node)`` function returns a small view object when ``node`` belongs to
the family, else ``None``. Views expose the operands, attributes and parameters, and
write parameters back, so a pass is written once for all three forms. Passes never
compare targets themselves: a new spelling of an op is added here, once.

One module per concern: `graph` (stored tensors, graph edits, reading nodes),
`arguments` (arguments by the names the op's schema or signature gives), `weighted`
(conv/linear), `parameter_usage`, `batch_norm`, `dropout`, `pointwise` (the activation
table and elementwise ops), `attention` (matmul, softmax, transposes), `transfers`
(device moves, casts, factories), `layout`, `precision` (the precision policy's
families) and `record` (running the graph on the example inputs). Import from
``graphopt.ops``.

Which view for an activation:

- `activation_view`: an activation oneDNN can fuse as a post-op of a conv/linear, with
  its kind and parameters (relu6 reads as hardtanh(0, 6)).
- `is_unary_pointwise`: any one-input elementwise activation, clamp, ELU and Mish
  included: for layout decisions (it computes each element on its own).
- `pointwise_view`: any elementwise op, arithmetic and dtype casts included: for fusion
  regions and in-place rewrites.
"""

from __future__ import annotations

from graphopt.ops.arguments import Arguments, argument_names, call_arguments
from graphopt.ops.attention import SoftmaxView, matmul_operands, softmax_view, swapped_last_dims_input
from graphopt.ops.batch_norm import BatchNormView, batch_norm_view
from graphopt.ops.dropout import DropoutView, dropout_view
from graphopt.ops.graph import (
    Form,
    add_tensor,
    called_module,
    delete_attr,
    form_of,
    get_attr,
    insert_reader,
    is_call_to,
    remove_dead_code,
    replace_tensor,
    set_attr,
    stored_tensor,
    tensor_meta,
    writes_in_place,
)
from graphopt.ops.layout import is_permute, is_reshape, layout_key, layout_of, permute_dims
from graphopt.ops.parameter_usage import ParameterUsage
from graphopt.ops.pointwise import (
    ACTIVATIONS,
    Activation,
    ActivationView,
    PointwiseView,
    activation_view,
    arithmetic_operands,
    is_unary_pointwise,
    pointwise_view,
)
from graphopt.ops.precision import PRECISION_FAMILIES, PRECISION_FAMILY_NAMES, precision_family
from graphopt.ops.record import Recorder, interpreter_inputs, record
from graphopt.ops.transfers import FactoryView, TransferView, factory_view, is_dtype_cast, is_metadata_check, transfer_view
from graphopt.ops.weighted import WeightedOpView, weighted_op_view

__all__ = [
    "ACTIVATIONS",
    "PRECISION_FAMILIES",
    "PRECISION_FAMILY_NAMES",
    "Activation",
    "ActivationView",
    "Arguments",
    "BatchNormView",
    "DropoutView",
    "FactoryView",
    "Form",
    "ParameterUsage",
    "PointwiseView",
    "Recorder",
    "SoftmaxView",
    "TransferView",
    "WeightedOpView",
    "activation_view",
    "add_tensor",
    "argument_names",
    "arithmetic_operands",
    "batch_norm_view",
    "call_arguments",
    "called_module",
    "delete_attr",
    "dropout_view",
    "factory_view",
    "form_of",
    "get_attr",
    "insert_reader",
    "interpreter_inputs",
    "is_call_to",
    "is_dtype_cast",
    "is_metadata_check",
    "is_permute",
    "is_reshape",
    "is_unary_pointwise",
    "layout_key",
    "layout_of",
    "matmul_operands",
    "permute_dims",
    "pointwise_view",
    "precision_family",
    "record",
    "remove_dead_code",
    "replace_tensor",
    "set_attr",
    "softmax_view",
    "stored_tensor",
    "swapped_last_dims_input",
    "tensor_meta",
    "transfer_view",
    "weighted_op_view",
    "writes_in_place",
]

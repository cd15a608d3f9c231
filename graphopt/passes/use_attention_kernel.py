"""use_attention_kernel: compute attention with one fused kernel, ``F.scaled_dot_product_attention``.

Patterns, in module/function/method (symbolic_trace) and ATen (torch.export) spellings:

1. Attention written by hand::

       softmax((q @ k.transpose(-2, -1)) * scale [+ mask], dim=-1) @ v
       -> scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

   ``scale`` is ``* s`` or ``/ d`` with a Python number (or absent: scale 1); the key's
   transpose is ``transpose``/``permute`` of the last two dims; ``matmul``, ``@`` or
   ``bmm``; ``mask`` is a floating tensor added after scaling. SDPA computes the same
   function in one kernel (on CPU a flash-attention kernel that never stores the full
   score matrix), about 1.5x (fp32) to 2x (bf16) faster than the four ops at ViT-B size.

2. ``nn.MultiheadAttention`` self-attention, which symbolic_trace keeps as one opaque
   module call, becomes the functional form it computes::

       linear(x, in_proj_weight, in_proj_bias) -> heads -> scaled_dot_product_attention
       -> merge heads -> linear(out_proj)

   reading the module's own parameters (state_dict keys stay). ``use_low_precision`` can
   then run both projections in bf16/fp16 with the weights cast once at optimize time;
   the module call itself would stay fp32. (torch.export already decomposes the module
   this way, so its graphs only need pattern 1.)

Exact: the same math, only floating-point rounding changes.

Guards, each a recorded skip: the softmax is over the last dim with no dtype argument
and its only reader is the matmul with the values (an active dropout in between, or
attention weights used elsewhere, block it); the scores are read by nothing else; q, k
and v have the scores' batch shape (no broadcasting, no mask enlarging the scores);
the mask has the queries' dtype. For nn.MultiheadAttention: query,
key and value are one tensor (self-attention), the returned attention weights are not
used, no masks or ``is_causal`` are passed, dropout is inactive, no ``add_bias_kv`` /
``add_zero_attn`` / separate q/k/v projection weights, and the input is batched (3-D).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops import (
    arithmetic_operands,
    called_module,
    form_of,
    matmul_operands,
    softmax_view,
    swapped_last_dims_input,
    tensor_meta,
)
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport, describe

_SDPA = {
    "function": F.scaled_dot_product_attention,
    "module": F.scaled_dot_product_attention,
    "aten": torch.ops.aten.scaled_dot_product_attention.default,
}


def use_attention_kernel(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Route hand-written attention and nn.MultiheadAttention self-attention to scaled_dot_product_attention."""
    report = PassReport("use_attention_kernel")
    for node in list(gm.graph.nodes):
        softmax = softmax_view(gm, node)
        if softmax is not None:
            reason = softmax.unsupported or _fuse_attention(gm, softmax.node, softmax.input, softmax.dim, softmax.dtype, report)
        elif isinstance(called_module(gm, node), nn.MultiheadAttention):
            reason = _decompose_multihead_attention(gm, node, report)
        else:
            continue
        if reason is not None:
            report.skip(node, reason)
    return finish(gm, bool(report.rewrites), report)


def _shape(value: Any) -> tuple[str, ...] | None:
    """A node's sizes as text: export's symbolic sizes ("s0") compare by name without touching its shape guards."""
    meta = tensor_meta(value) if isinstance(value, fx.Node) else None
    return tuple(str(size) for size in meta[0]) if meta is not None else None


def _dtype(value: Any) -> torch.dtype | None:
    meta = tensor_meta(value) if isinstance(value, fx.Node) else None
    return meta[1] if meta is not None else None


def _scores(gm: fx.GraphModule, softmax_input: fx.Node) -> tuple[fx.Node, float | None, fx.Node | None] | None:
    """Split softmax's input into (the q @ k^T product, scale, mask); None when it is not that shape."""
    added = arithmetic_operands(gm, softmax_input, "add")
    if added is None:
        found = _product_and_scale(gm, softmax_input)
        return None if found is None else (*found, None)
    for scaled, mask in (added, added[::-1]):
        found = _product_and_scale(gm, scaled) if isinstance(scaled, fx.Node) and isinstance(mask, fx.Node) else None
        if found is not None:
            return (*found, mask)
    return None


def _product_and_scale(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, float | None] | None:
    """``node`` as ``product * s``, ``s * product``, ``product / d`` or ``product`` (a matmul): (product, scale)."""
    if matmul_operands(gm, node) is not None:
        return node, None
    for kind in ("mul", "div"):
        operands = arithmetic_operands(gm, node, kind)
        if operands is None:
            continue
        for product, number in [operands, operands[::-1]] if kind == "mul" else [operands]:
            is_number = isinstance(number, int | float) and not isinstance(number, bool) and number != 0
            if is_number and isinstance(product, fx.Node) and matmul_operands(gm, product) is not None:
                return product, float(number) if kind == "mul" else 1.0 / float(number)
    return None


def _fuse_attention(
    gm: fx.GraphModule, softmax: fx.Node, softmax_input: Any, dim: int | None, dtype: Any, report: PassReport
) -> str | None:
    """Replace ``softmax(scores) @ v`` by one SDPA call; the reason when the pattern does not hold."""
    shape = _shape(softmax_input)
    if shape is None or not isinstance(softmax_input, fx.Node):
        return "the softmax input's shape is unknown"
    rank = len(shape)
    if not isinstance(dim, int) or dim % rank != rank - 1:
        return f"softmax over dim {dim}, not the last: not attention"
    if dtype is not None:
        return "softmax with a dtype argument: SDPA has none"
    readers = list(softmax.users)
    weights_times_values = matmul_operands(gm, readers[0]) if len(readers) == 1 else None
    if weights_times_values is None or weights_times_values[0] is not softmax:
        names = ", ".join(describe(user) for user in readers) or "nothing"
        return f"the softmax output is read by {names}, not only by a matmul with the values (an active dropout or used attention weights)"
    final, values = readers[0], weights_times_values[1]
    scores = _scores(gm, softmax_input)
    if scores is None:
        return "the softmax input is not (q @ k^T) * scale [+ mask] with a number as scale: not recognised as attention"
    product, scale, mask = scores
    chain = [product, *product.users] if product is not softmax_input else [product]
    if any(len(node.users) != 1 for node in {*chain, softmax_input}):
        return "the attention scores are also read elsewhere: the fused kernel would not replace them"
    query, transposed_key = matmul_operands(gm, product)  # type: ignore[misc]
    key = swapped_last_dims_input(gm, transposed_key, rank) if isinstance(transposed_key, fx.Node) else None
    if key is None:
        return "the keys are not transposed in the graph (transpose/permute of the last two dims, given as numbers)"
    shapes = [_shape(value) for value in (query, key, values)]
    if any(s is None or s[:-2] != shape[:-2] for s in shapes):
        return f"queries, keys and values {shapes} do not all have the scores' batch shape {shape[:-2]}: SDPA would broadcast differently"
    if mask is not None and _dtype(mask) != _dtype(query):
        return f"the mask is {_dtype(mask)}, not the queries' dtype {_dtype(query)}"
    scale = 1.0 if scale is None else scale
    with gm.graph.inserting_before(final):
        fused = gm.graph.call_function(_SDPA[form_of(final)], (query, key, values, mask), {"scale": scale})
    fused.meta.update(final.meta)
    final.replace_all_uses_with(fused)
    gm.graph.erase_node(final)
    gm.graph.erase_node(softmax)  # explicitly: dead-code removal keeps module calls (nn.Softmax); the rest goes with it
    report.rewrite(fused, f"softmax(q @ k^T * {scale:.4g}{' + mask' if mask is not None else ''}) @ v -> scaled_dot_product_attention")
    return None


def _decompose_multihead_attention(gm: fx.GraphModule, node: fx.Node, report: PassReport) -> str | None:
    """Replace a self-attention nn.MultiheadAttention call by linear -> SDPA -> linear; the reason when not."""
    module = called_module(gm, node)
    assert isinstance(module, nn.MultiheadAttention)
    reason = _multihead_attention_guard(gm, node, module)
    if reason is not None:
        return reason
    x = node.args[0]
    heads, head_dim, target = module.num_heads, module.head_dim, str(node.target)
    graph = gm.graph
    with graph.inserting_before(node):
        if not module.batch_first:
            x = graph.call_method("transpose", (x, 0, 1))
        in_bias = graph.get_attr(f"{target}.in_proj_bias") if module.in_proj_bias is not None else None
        qkv = graph.call_function(F.linear, (x, graph.get_attr(f"{target}.in_proj_weight"), in_bias))
        qkv = graph.call_method("unflatten", (qkv, -1, (3, heads, head_dim)))
        qkv = graph.call_method("permute", (qkv, 2, 0, 3, 1, 4))  # (3, batch, heads, tokens, head_dim)
        query, key, value = (graph.call_function(operator.getitem, (qkv, i)) for i in range(3))
        attended = graph.call_function(F.scaled_dot_product_attention, (query, key, value))
        merged = graph.call_method("flatten", (graph.call_method("transpose", (attended, 1, 2)), 2))
        out_bias = graph.get_attr(f"{target}.out_proj.bias") if module.out_proj.bias is not None else None
        out = graph.call_function(F.linear, (merged, graph.get_attr(f"{target}.out_proj.weight"), out_bias))
        if not module.batch_first:
            out = graph.call_method("transpose", (out, 0, 1))
    out.meta.update({key: value for key, value in node.meta.items() if key != "tensor_meta"})
    for user in list(node.users):  # the guard checked: item 0 readers, and unused items
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)
    report.rewrite(attended, f"nn.MultiheadAttention '{target}' -> in_proj linear, scaled_dot_product_attention, out_proj linear")
    return None


def _multihead_attention_guard(gm: fx.GraphModule, node: fx.Node, module: nn.MultiheadAttention) -> str | None:
    if type(module).forward is not nn.MultiheadAttention.forward:
        return f"{type(module).__name__} overrides forward()"
    query = node.args[0] if node.args else node.kwargs.get("query")
    key = node.args[1] if len(node.args) > 1 else node.kwargs.get("key")
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
    if len(node.args) != 3 or not (query is key is value):
        return "not self-attention on one tensor (query, key and value differ, or are passed by keyword)"
    for name in ("key_padding_mask", "attn_mask"):
        if node.kwargs.get(name) is not None:
            return f"{name} is given: only unmasked self-attention is rewritten"
    if node.kwargs.get("is_causal"):
        return "is_causal=True: only unmasked self-attention is rewritten"
    for user in node.users:
        is_item = user.op == "call_function" and user.target is operator.getitem
        if not is_item or (user.args[1] != 0 and user.users):
            return f"the attention weights (or the whole output tuple) are used by {describe(user)}"
    if module.training and module.dropout > 0:
        return f"attention dropout p={module.dropout} is active in training"
    if module.bias_k is not None or module.add_zero_attn:
        return "add_bias_kv/add_zero_attn change the keys and values"
    if not module._qkv_same_embed_dim:
        return "separate q/k/v projection weights (kdim/vdim differ from embed_dim)"
    shape = _shape(query)
    if shape is None or len(shape) != 3:
        return f"input of shape {shape}: only batched 3-D input is rewritten"
    return None

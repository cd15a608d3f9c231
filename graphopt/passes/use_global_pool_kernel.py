"""use_global_pool_kernel: global average pooling of bf16/fp16 channels_last CPU tensors by ATen's pooling kernel.

Pattern: ``nn.AdaptiveAvgPool2d(1)``, ``F.adaptive_avg_pool2d(x, 1)`` and
``aten.adaptive_avg_pool2d(x, [1, 1])`` (the squeeze-excitation and classifier pools of
ResNet, MobileNet, EfficientNet, ConvNeXt) become ``aten._adaptive_avg_pool2d(x, [1, 1])``.

For a 1x1 output ATen's ``adaptive_avg_pool2d`` takes a shortcut to ``mean(dim=(2, 3))``.
On the CPU, ``mean`` of a bf16/fp16 tensor first copies it to float32 and reduces the
copy in a channels_last-unfriendly order: 20 ms for an 8x96x112x112 bf16 channels_last
tensor on 2 cores, where the pooling kernel behind the shortcut reads the tensor once,
accumulates in float32 and takes 1 ms (fp32 tensors: both about equal, so they are left
alone). The result is the same value rounded once to the tensor's dtype, for any
spatial size. Inference only: in training the backward of ``mean`` is a cheap expand,
and bf16 training keeps autocast's exact ops (tests compare the two step by step).

Guards, each a recorded skip reason, decided on the example inputs: the pooled tensor
is on the CPU, bfloat16 or float16, and channels_last (NCHW tensors with small
spatial sizes pool faster through ``mean``). Run after use_low_precision and
to_channels_last: those decide the dtype and layout the pool sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from graphopt.ops import layout_of, record
from graphopt.passes.base import PassContext, PassResult, finish
from graphopt.report import PassReport, describe

aten = torch.ops.aten
_POOL_FUNCTIONS = (F.adaptive_avg_pool2d, torch._C._nn.adaptive_avg_pool2d, aten.adaptive_avg_pool2d.default)
_LOW = (torch.bfloat16, torch.float16)


def _global_pool_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The pooled tensor when ``node`` is an adaptive average pool to a 1x1 output, else None."""
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.AdaptiveAvgPool2d) and node.args:
        output_size = gm.get_submodule(str(node.target)).output_size
        source = node.args[0]
    elif node.op == "call_function" and node.target in _POOL_FUNCTIONS:
        source = node.args[0] if node.args else node.kwargs.get("input")
        output_size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
    else:
        return None
    if output_size not in (1, (1, 1), [1, 1]) or not isinstance(source, fx.Node):
        return None
    return source


def _guard(value: Any) -> str | None:
    """Why pooling ``value`` through the kernel would not pay, or None."""
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return "the pooled value is not a 4-D tensor"
    if value.device.type != "cpu":
        return f"tensor on {value.device.type}: the slow mean shortcut is a CPU matter"
    if value.dtype not in _LOW:
        return f"{str(value.dtype).removeprefix('torch.')} tensor: mean is as fast as the pooling kernel"
    if layout_of(value) not in ("channels_last", "any"):
        return "NCHW tensor: mean is faster for small spatial sizes (use memory_format='channels_last')"
    return None


def use_global_pool_kernel(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Replace global average pools of bf16/fp16 channels_last CPU tensors with ATen's pooling kernel."""
    report = PassReport("use_global_pool_kernel")
    pools = {node: source for node in gm.graph.nodes if (source := _global_pool_input(gm, node)) is not None}
    if not pools:
        return finish(gm, False, report)
    pooled: dict[fx.Node, Any] = {}  # the value each pool reads on the example inputs

    def keep_pooled(node: fx.Node, result: Any, values: Mapping[fx.Node, Any]) -> None:
        if node in pools:
            pooled[node] = values[pools[node]]

    record(gm, ctx.example_inputs, keep_pooled)
    for node, source in pools.items():
        reason = _guard(pooled.get(node))
        if reason is not None:
            report.skip(node, reason)
            continue
        with gm.graph.inserting_before(node):
            pool = gm.graph.call_function(aten._adaptive_avg_pool2d.default, (source, [1, 1]))
        pool.meta.update(node.meta)
        node.replace_all_uses_with(pool)
        gm.graph.erase_node(node)
        report.rewrite(pool, f"{describe(pool)}: global average pool by the pooling kernel, not a float32 copy and mean")
    return finish(gm, bool(report.rewrites), report)

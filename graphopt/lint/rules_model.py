"""Lint rules on model structure (GO4xx)."""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator

from graphopt.lint.core import Edit, Facts, Match, call_name, calls, constant_int, keyword, loader_setting, replace_node, rule
from graphopt.passes.drop_conv_bias import drop_conv_bias

_CONV = re.compile(r"Conv(Transpose)?[123]d")
_BATCH_NORM = re.compile(r"BatchNorm[123]d")
# Conv2d(in, out, kernel_size, stride, padding, dilation, groups, bias, ...) and
# ConvTranspose2d(in, out, kernel_size, stride, padding, output_padding, groups, bias, ...)
_BIAS_POSITION = 7


def _last_name(call: ast.AST) -> str:
    return call_name(call).split(".")[-1]


def _sequential_layers(call: ast.Call) -> list[ast.expr] | None:
    """The layers of ``nn.Sequential(a, b, ...)`` or ``nn.Sequential(OrderedDict([("a", a), ...]))``, in order."""
    if any(isinstance(a, ast.Starred) for a in call.args) or call.keywords:
        return None  # layers we cannot see
    if len(call.args) == 1 and isinstance(call.args[0], ast.Call) and _last_name(call.args[0]) == "OrderedDict":
        items = call.args[0].args[0] if len(call.args[0].args) == 1 else None
        if not isinstance(items, (ast.List, ast.Tuple)):
            return None
        pairs = [e for e in items.elts if isinstance(e, ast.Tuple) and len(e.elts) == 2]
        return [pair.elts[1] for pair in pairs] if len(pairs) == len(items.elts) else None
    return list(call.args)


def _append_keyword(call: ast.Call, text: str, source: str) -> Edit:
    """Insert ``, text`` right after the call's last argument (and the parentheses closing it, if any).

    core.add_keyword inserts at the call's ")", which puts ``, bias=False)`` on a line of its
    own when the ")" closes a multi-line call; here the keyword joins the last argument's line.
    """
    last = max([*call.args, *(k.value for k in call.keywords)], key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0))
    lines = source.encode().splitlines(keepends=True)  # ast's lines and byte columns
    line, col = last.end_lineno or last.lineno, last.end_col_offset or 0
    end = (call.end_lineno or line, (call.end_col_offset or 1) - 1)  # the call's own ")"
    scan_line, scan_col = line, col
    while (scan_line, scan_col) < end:  # skip whitespace, and the ")" of an argument written as ``(3)``
        text_line = lines[scan_line - 1]
        if scan_col >= len(text_line):
            scan_line, scan_col = scan_line + 1, 0
            continue
        char = text_line[scan_col : scan_col + 1]
        if char == b")":
            line, col = scan_line, scan_col + 1
        elif not char.isspace() and char != b"\\":
            break
        scan_col += 1
    return Edit(line, col, line, col, f", {text}")


def _bias_fix(conv: ast.Call, source: str) -> Edit | None:
    """The edit giving ``conv`` ``bias=False``, or None when it has none already or it cannot be told."""
    if any(k.arg is None for k in conv.keywords) or any(isinstance(a, ast.Starred) for a in conv.args):
        return None  # **kwargs / *args may set the bias
    bias = keyword(conv, "bias") or (conv.args[_BIAS_POSITION] if len(conv.args) > _BIAS_POSITION else None)
    if bias is None:
        return _append_keyword(conv, "bias=False", source)  # the default is bias=True
    if isinstance(bias, ast.Constant) and bias.value:
        return replace_node(bias, "False")
    return None  # bias=False already, or bias=use_bias decided at run time


@rule(
    "GO401",
    "conv-bias-before-bn",
    "convolution with a bias right before a BatchNorm: bias=False",
    "BatchNorm subtracts the per-channel mean of its input, so a per-channel bias added by the convolution "
    "just before it cancels out: it receives no gradient in training and only costs parameters, optimizer "
    "state, memory traffic and an extra add per element (the bias is folded into BatchNorm's running_mean "
    "in eval mode). Training from scratch with bias=False gives an equivalent model. For an already trained "
    "model, graphopt.optimize's opt-in " f"{drop_conv_bias.__name__} pass removes the bias (it moves it into running_mean), "
    "which this source edit cannot: checkpoints saved with the bias no longer load with strict=True. Training "
    "goes on exactly as the original's under plain SGD without weight decay only: weight decay or Adam would have "
    "moved the bias.",
    "Pass bias=False to the convolution (the fix applies it). To keep loading trained weights, leave the "
    f'source as it is and ask graphopt.optimize(model, inputs, mode="training", passes=[..., "{drop_conv_bias.__name__}"]) '
    "to drop the bias.",
)
def conv_bias_before_bn(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    for call in calls(tree):
        if _last_name(call) != "Sequential":
            continue
        layers = _sequential_layers(call) or []
        for conv, norm in itertools.pairwise(layers):
            if not (isinstance(conv, ast.Call) and isinstance(norm, ast.Call)):
                continue
            if not (_CONV.fullmatch(_last_name(conv)) and _BATCH_NORM.fullmatch(_last_name(norm))):
                continue
            edit = _bias_fix(conv, facts.source)
            if edit is not None:
                yield Match(conv, f"{_last_name(conv)} with a bias feeds {_last_name(norm)}: the bias is cancelled, pass bias=False", edit)


_SIZE_ARGUMENTS = {
    "conv": ("in_channels", "out_channels"),
    "linear": ("in_features", "out_features"),
}
_IMAGE_CHANNELS = (1, 3)


def _sizes(call: ast.Call, kind: str) -> list[tuple[str, int]]:
    """The literal (argument name, value) pairs of a conv's channels or a linear layer's features."""
    found = []
    for position, name in enumerate(_SIZE_ARGUMENTS[kind]):
        value = constant_int(keyword(call, name) or (call.args[position] if len(call.args) > position else None))
        if value is not None:
            found.append((name, value))
    return found


@rule(
    "GO402",
    "channels-not-multiple-of-8",
    "layer sizes not multiples of 8 in a mixed-precision script",
    "Tensor cores multiply fp16/bf16 matrices in tiles of 8 (16 bytes) along every dimension. A channel or "
    "feature count that is not a multiple of 8 makes cuBLAS/cuDNN pad on the fly or fall back to slower "
    "kernels; so does the batch size, one dimension of every linear layer's matrix multiply.",
    "Round the channel/feature counts and the batch size up to multiples of 8 (64 or more for large "
    "vocabularies and hidden sizes); the image input channels (1 or 3) of the first convolution are fine, "
    "and a small final classifier layer matters little.",
)
def channels_not_multiple_of_8(tree: ast.Module, facts: Facts) -> Iterator[Match]:
    if not facts.uses_amp:
        return
    for statement in tree.body:  # each top-level class/function/assignment: its first conv takes the image
        first_conv = True
        for call in sorted(calls(statement), key=lambda c: (c.lineno, c.col_offset)):
            name = _last_name(call)
            if name == "DataLoader":
                value = constant_int(loader_setting(call, "batch_size"))
                if value is not None and value % 8:
                    yield Match(call, f"DataLoader batch_size={value} is not a multiple of 8: tensor cores pad it")
                continue
            if _CONV.fullmatch(name):
                sizes = _sizes(call, "conv")
                if first_conv:
                    sizes = [(arg, value) for arg, value in sizes if not (arg == "in_channels" and value in _IMAGE_CHANNELS)]
                first_conv = False
            elif name == "Linear":
                sizes = _sizes(call, "linear")
            else:
                continue
            odd = [f"{arg}={value}" for arg, value in sizes if value % 8]
            if odd:
                yield Match(call, f"{name} {', '.join(odd)}: not a multiple of 8, tensor cores pad or fall back to slower kernels")

"""use_attention_kernel: hand-written attention and nn.MultiheadAttention -> scaled_dot_product_attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.pipeline import PRESETS
from graphopt.passes.use_attention_kernel import use_attention_kernel
from graphopt.passes.use_low_precision import CAST
from tests.conftest import FRONTENDS, assert_same_outputs, assert_trains_like, captured, context

SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
SOFTMAXES = {
    "method": lambda s: s.softmax(dim=-1),
    "F.softmax": lambda s: F.softmax(s, dim=-1),
    "torch.softmax": lambda s: torch.softmax(s, -1),
    "last dim by index": lambda s: s.softmax(3),
}
TRANSPOSES = {
    "transpose(-2, -1)": lambda k: k.transpose(-2, -1),
    "transpose(3, 2)": lambda k: k.transpose(3, 2),
    "permute": lambda k: k.permute(0, 1, 3, 2),
}


def scaled(scores: torch.Tensor, scale: str) -> torch.Tensor:
    if scale == "times":
        return scores * 0.125
    if scale == "number times":
        return 0.125 * scores
    if scale == "divided":
        return scores / 8.0
    return scores


class HandWritten(nn.Module):
    """softmax((q @ k^T) * scale [+ mask]) @ v over (batch, heads, tokens, head_dim)."""

    def __init__(self, scale: str = "times", masked: bool = False, softmax: str = "method", transpose: str = "transpose(-2, -1)") -> None:
        super().__init__()
        self.scale, self.masked = scale, masked
        self.softmax, self.transpose = SOFTMAXES[softmax], TRANSPOSES[transpose]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = scaled(q @ self.transpose(k), self.scale)
        if self.masked:
            scores = scores + mask
        return self.softmax(scores) @ v


def qkv_mask(batch: int = 2, heads: int = 3, tokens: int = 5, dim: int = 8) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(batch, heads, tokens, dim) for _ in range(3))
    return q, k, v, torch.randn(tokens, tokens)


def sdpa_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA]


def softmax_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if (n.op == "call_method" and n.target == "softmax") or n.target in (F.softmax, torch.softmax, torch.ops.aten.softmax.int)
    ]


def rewrite_and_check(model: nn.Module, inputs: tuple, frontend: str, fused: int = 1, tolerance: float = 1e-5):
    gm = captured(model, inputs, frontend)
    result = use_attention_kernel(gm, context(inputs))
    report = result.report
    assert result.modified and len(report.rewrites) == fused, report
    assert len(sdpa_nodes(gm)) == fused
    assert_same_outputs(model, gm, inputs, tolerance)
    return gm, report


# --------------------------------------------------------------------------- hand-written attention


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("scale", ["times", "number times", "divided", "none"])
@pytest.mark.parametrize("masked", [False, True])
def test_fuses_scaled_masked_attention(frontend: str, scale: str, masked: bool) -> None:
    gm, report = rewrite_and_check(HandWritten(scale, masked), qkv_mask(), frontend)
    assert softmax_nodes(gm) == []
    (node,) = sdpa_nodes(gm)
    assert node.kwargs["scale"] == (1.0 if scale == "none" else 0.125)
    assert (node.args[3] is not None) == masked
    assert ("+ mask" in report.rewrites[0].detail) == masked


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("softmax", SOFTMAXES)
@pytest.mark.parametrize("transpose", TRANSPOSES)
def test_fuses_every_spelling_of_softmax_and_key_transpose(frontend: str, softmax: str, transpose: str) -> None:
    gm, _ = rewrite_and_check(HandWritten(softmax=softmax, transpose=transpose), qkv_mask(), frontend)
    assert not any(n.target in ("transpose", "permute") for n in gm.graph.nodes if n.op == "call_method")


def test_fuses_softmax_module_and_bmm_over_three_dims() -> None:
    class Bmm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.softmax = nn.Softmax(dim=-1)

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.bmm(self.softmax(torch.bmm(q, k.transpose(1, 2)) / 4.0), v)

    inputs = tuple(torch.randn(6, 5, 16) for _ in range(3))
    gm, _ = rewrite_and_check(Bmm(), inputs, "fx")
    assert not any(n.op == "call_module" for n in gm.graph.nodes)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_fuses_attention_inside_a_vit_style_block_and_keeps_other_batch_sizes(frontend: str) -> None:
    class Block(nn.Module):
        def __init__(self, dim: int = 16, heads: int = 2) -> None:
            super().__init__()
            self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
            self.scale = (dim // heads) ** -0.5  # a number, as in timm (one computed from x.shape is a graph value under fx)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, tokens, dim = x.shape
            q, k, v = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
            attended = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1) @ v
            return self.proj(attended.transpose(1, 2).reshape(batch, tokens, dim))

    rewrite_and_check(Block().eval(), (torch.randn(2, 7, 16),), frontend)  # assert_same_outputs runs batch 3 too


def test_training_gradients_match_through_the_fused_kernel() -> None:
    class Trained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return ((self.q(x) @ self.k(x).transpose(-2, -1)) / 8**0.5).softmax(-1) @ self.v(x)

    model = Trained().train()
    inputs = (torch.randn(3, 6, 8),)
    optimized = graphopt.optimize(model, inputs, mode="training", passes=["use_attention_kernel"])
    assert len(sdpa_nodes(optimized.graph_module)) == 1
    assert_trains_like(model, optimized, inputs)


# --------------------------------------------------------------------------- hand-written guards


def assert_left_alone(model: nn.Module, inputs: tuple, frontend: str, reason: str) -> None:
    gm = captured(model, inputs, frontend)
    code = gm.code
    result = use_attention_kernel(gm, context(inputs))
    assert not result.modified and result.report.rewrites == [] and gm.code == code
    assert any(reason in skip.reason for skip in result.report.skips), result.report.skips
    assert sdpa_nodes(gm) == []


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_softmax_not_over_the_last_dim(frontend: str) -> None:
    class Columns(HandWritten):
        def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
            return ((q @ k.transpose(-2, -1)) * 0.125).softmax(dim=-2) @ v

    assert_left_alone(Columns(), qkv_mask(), frontend, "not the last")


def test_guard_softmax_with_dtype() -> None:
    class WithDtype(HandWritten):
        def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
            return F.softmax((q @ k.transpose(-2, -1)) * 0.125, dim=-1, dtype=torch.float32) @ v

    assert_left_alone(WithDtype(), qkv_mask(), "fx", "dtype argument")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_attention_weights_also_returned(frontend: str) -> None:
    class ReturnsWeights(HandWritten):
        def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
            weights = ((q @ k.transpose(-2, -1)) * 0.125).softmax(dim=-1)
            return weights @ v, weights

    assert_left_alone(ReturnsWeights(), qkv_mask(), frontend, "not only by a matmul with the values")


def test_guard_active_dropout_on_the_attention_weights() -> None:
    class Dropped(HandWritten):
        def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
            return F.dropout(((q @ k.transpose(-2, -1)) * 0.125).softmax(dim=-1), 0.1, training=True) @ v

    assert_left_alone(Dropped(), qkv_mask(), "fx", "not only by a matmul with the values")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_scores_read_elsewhere(frontend: str) -> None:
    class ScoresReused(HandWritten):
        def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
            scores = (q @ k.transpose(-2, -1)) * 0.125
            return scores.softmax(dim=-1) @ v, scores.mean()

    assert_left_alone(ScoresReused(), qkv_mask(), frontend, "also read elsewhere")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_scale_is_a_tensor(frontend: str) -> None:
    class TensorScale(HandWritten):
        def __init__(self) -> None:
            super().__init__()
            self.temperature = nn.Parameter(torch.tensor(0.5))

        def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
            return ((q @ k.transpose(-2, -1)) * self.temperature).softmax(dim=-1) @ v

    assert_left_alone(TensorScale(), qkv_mask(), frontend, "not recognised as attention")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_keys_transposed_outside_the_graph(frontend: str) -> None:
    class PreTransposed(HandWritten):
        def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
            return ((q @ k) * 0.125).softmax(dim=-1) @ v

    q, k, v, mask = qkv_mask()
    assert_left_alone(PreTransposed(), (q, k.transpose(-2, -1).contiguous(), v, mask), frontend, "keys are not transposed")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_broadcast_keys_and_values(frontend: str) -> None:
    q, k, v, mask = qkv_mask()
    assert_left_alone(HandWritten(), (q, k[:1], v[:1], mask), frontend, "batch shape")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_mask_of_another_dtype(frontend: str) -> None:
    q, k, v, mask = qkv_mask()
    assert_left_alone(HandWritten(masked=True), (q, k, v, mask.half()), frontend, "queries' dtype")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_mask_that_enlarges_the_scores(frontend: str) -> None:
    q, k, v, _ = qkv_mask(batch=1)
    assert_left_alone(HandWritten(masked=True), (q, k, v, torch.randn(4, 1, 5, 5)), frontend, "batch shape")


def test_softmax_that_is_not_attention_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1))
    assert_left_alone(model, (torch.randn(2, 4),), "fx", "not only by a matmul with the values")


# --------------------------------------------------------------------------- nn.MultiheadAttention


class SelfAttention(nn.Module):
    """torchvision's ViT calls: self_attention(y, y, y, need_weights=False)."""

    def __init__(self, batch_first: bool = True, bias: bool = True, need_weights: bool = False, **options) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first, **options)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attention(x, x, x, need_weights=self.need_weights)
        return y + x


def multihead_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), nn.MultiheadAttention)]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [False, True])
def test_decomposes_multihead_self_attention(batch_first: bool, bias: bool, need_weights: bool) -> None:
    model = SelfAttention(batch_first, bias, need_weights).eval()
    inputs = (torch.randn(3, 5, 16),)
    gm, report = rewrite_and_check(model, inputs, "fx")
    assert multihead_calls(gm) == []
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert [str(n.args[1].target) for n in linears] == ["attention.in_proj_weight", "attention.out_proj.weight"]
    assert gm.state_dict().keys() == model.state_dict().keys()
    assert "nn.MultiheadAttention 'attention'" in report.rewrites[0].detail


def test_multihead_attention_from_export_is_already_sdpa() -> None:
    model = SelfAttention().eval()
    inputs = (torch.randn(3, 5, 16),)
    gm = captured(model, inputs, "export")
    assert len(sdpa_nodes(gm)) == 1
    result = use_attention_kernel(gm, context(inputs))
    assert not result.modified and result.report.skips == []


def test_multihead_attention_trains_like_the_module_without_dropout() -> None:
    model = SelfAttention().train()
    inputs = (torch.randn(3, 5, 16),)
    optimized = graphopt.optimize(model, inputs, mode="training", passes=["use_attention_kernel"], frontend="fx")
    assert multihead_calls(optimized.graph_module) == []
    assert_trains_like(model, optimized, inputs)


class CrossAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.attention(x, memory, memory, need_weights=False)[0]


class MaskedSelfAttention(SelfAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, attn_mask=torch.zeros(5, 5), need_weights=False)[0]


class WeightsUsed(SelfAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, weights = self.attention(x, x, x)
        return y.sum() + weights.sum()


class ScaledAttention(nn.MultiheadAttention):
    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out, weights = super().forward(*args, **kwargs)
        return out * 2, weights


@pytest.mark.parametrize(
    "model, inputs, reason",
    [
        (CrossAttention().eval(), (torch.randn(2, 5, 16), torch.randn(2, 7, 16)), "not self-attention"),
        (MaskedSelfAttention().eval(), (torch.randn(2, 5, 16),), "attn_mask is given"),
        (WeightsUsed().eval(), (torch.randn(2, 5, 16),), "attention weights"),
        (SelfAttention(dropout=0.1).train(), (torch.randn(2, 5, 16),), "dropout p=0.1 is active"),
        (SelfAttention(add_bias_kv=True).eval(), (torch.randn(2, 5, 16),), "add_bias_kv"),
        (SelfAttention(kdim=8, vdim=8).eval(), None, "separate q/k/v"),
        (SelfAttention().eval(), (torch.randn(5, 16),), "only batched 3-D input"),
    ],
    ids=["cross-attention", "mask", "weights used", "dropout", "bias_kv", "kdim", "unbatched"],
)
def test_multihead_attention_guards(model: nn.Module, inputs: tuple | None, reason: str) -> None:
    if inputs is None:  # kdim != embed_dim: self-attention on one tensor cannot even run; check the guard on the graph
        gm = fx.symbolic_trace(model)
        report = use_attention_kernel(gm, context(())).report
        assert report.rewrites == [] and any(reason in s.reason for s in report.skips), report.skips
        return
    assert_left_alone(model, inputs, "fx", reason)
    assert multihead_calls(captured(model, inputs, "fx"))


def test_multihead_attention_subclass_overriding_forward_is_left_alone() -> None:
    model = SelfAttention().eval()
    model.attention = ScaledAttention(16, 4, batch_first=True)
    tracer = fx.Tracer()
    tracer.is_leaf_module = lambda module, name: isinstance(module, nn.MultiheadAttention)  # type: ignore[method-assign]
    gm = fx.GraphModule(model, tracer.trace(model))
    report = use_attention_kernel(gm, context(())).report
    assert report.rewrites == [] and "overrides forward()" in report.skips[0].reason


# --------------------------------------------------------------------------- the ViT trap: weights cast once


class TinyViTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(x)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_bf16_inference_stores_attention_weights_in_bf16_once(frontend: str) -> None:
    model = TinyViTBlock().eval()
    inputs = (torch.randn(2, 9, 32),)
    fast = graphopt.optimize(model, inputs, precision="bf16", frontend=frontend, memory_format="preserve")
    gm = fast.graph_module
    assert multihead_calls(gm) == []
    assert gm.get_parameter("attention.in_proj_weight").dtype == torch.bfloat16
    assert gm.get_parameter("attention.out_proj.weight").dtype == torch.bfloat16
    weights = {n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("attention.")}
    casts_of_weights = [n for n in gm.graph.nodes if n.meta.get(CAST) and n.args[0] in weights]
    assert casts_of_weights == [], "a weight cast in the graph would run on every call"
    assert_same_outputs(model, fast, inputs, 3e-2)


def test_default_presets_include_the_pass() -> None:
    model, inputs = SelfAttention().eval(), (torch.randn(2, 5, 16),)
    fast = graphopt.optimize(model, inputs, frontend="fx")
    ran = [r.name for r in fast.graphopt_report.passes]
    assert "use_attention_kernel" in ran and ran == list(PRESETS["inference"][: len(ran)])
    assert multihead_calls(fast.graph_module) == []
    assert_same_outputs(model, copy.deepcopy(fast), inputs)  # a copy runs, and on another batch size

"""use_low_precision: dtypes op by op, numerics, training, weights cast once, policy overrides, errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt import precision, verify
from graphopt.models import REFERENCE_MODELS
from graphopt.ops import batch_norm_view, interpreter_inputs, precision_family
from graphopt.passes.use_low_precision import CAST, DEFAULT_FP32_OPS, DEFAULT_LOW_PRECISION_OPS
from graphopt.pipeline import preset
from tests.conftest import FRONTENDS, assert_same_outputs, randomize_batch_norms, relative_error, second_inputs

BF16_BOUND = 3e-2  # documented bound for bf16, relative to the output's scale


class InputDtypes(fx.Interpreter):
    """Records, for every node, the dtypes of the floating-point tensors it reads (independent of the pass)."""

    def run_node(self, n: fx.Node) -> Any:
        values = [self.env.get(a) for a in n.all_input_nodes]
        n.meta["test_input_dtypes"] = {v.dtype for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()}
        return super().run_node(n)


def record_dtypes(gm: fx.GraphModule, inputs: tuple) -> None:
    with torch.no_grad():
        InputDtypes(gm).run(*interpreter_inputs(gm, inputs))


def assert_policy_holds(gm: fx.GraphModule, low: torch.dtype, low_ops=DEFAULT_LOW_PRECISION_OPS, fp32_ops=DEFAULT_FP32_OPS) -> int:
    """Every low-precision op reads only ``low`` tensors, every fp32 op only fp32 ones; returns the low op count."""
    checked = 0
    for node in gm.graph.nodes:
        family = precision_family(gm, node)
        if family in low_ops:
            assert node.meta["test_input_dtypes"] == {low}, (node.name, node.meta["test_input_dtypes"])
            checked += 1
        elif family in fp32_ops:
            assert node.meta["test_input_dtypes"] <= {torch.float32}, (node.name, node.meta["test_input_dtypes"])
    return checked


def output_and_gradients(model: nn.Module, args: tuple, names: set[str], autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``model``'s float32 output on ``args`` and the gradients of ``names`` for mean(output²).

    The gradients come flat, in name order (an optimized module may list its parameters in
    another order); with ``autocast``, forward runs under torch.autocast's bf16.
    """
    copied = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        output = copied(*args).float()
    output.square().mean().backward()
    parameters = dict(copied.named_parameters())
    return output.detach(), torch.cat([parameters[name].grad.flatten() for name in sorted(names)])


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_reference_models_in_bf16(name: str, frontend: str, mode: str) -> None:
    reference = REFERENCE_MODELS[name]
    model = randomize_batch_norms(reference.build()).train(mode == "training")
    inputs = reference.example_inputs(batch_size=4)
    optimized = graphopt.optimize(model, inputs, frontend=frontend, precision="bf16", memory_format="preserve")

    record_dtypes(optimized.graph_module, inputs)
    assert assert_policy_holds(optimized.graph_module, torch.bfloat16) > 0
    report = optimized.graphopt_report["use_low_precision"]
    assert "100.0% of conv/linear/matmul FLOPs in low precision" in report.notes[-1]
    assert report.max_error < BF16_BOUND and report.mean_error < report.max_error
    assert_same_outputs(model, optimized, inputs, BF16_BOUND)
    if mode == "training":
        assert all(p.dtype == torch.float32 for p in optimized.parameters())
        # bf16 gradients are approximations of the fp32 ones whose error depends on the CPU's kernels
        # (1.5e-2 to 5.5e-2 of the largest here): the yardstick is torch.autocast's bf16 on the same CPU,
        # which graphopt's casts match (measured: the same error, 1.18x on the ResNet, whose biases
        # before BatchNorm are dropped)
        kept = {n for n, _ in optimized.named_parameters()}
        for args in (inputs, second_inputs(model, inputs)):
            _, fp32 = output_and_gradients(model, args, kept)
            _, autocast = output_and_gradients(model, args, kept, autocast=True)
            _, graphopt_bf16 = output_and_gradients(optimized, args, kept)
            assert relative_error(fp32, graphopt_bf16) <= 1.5 * relative_error(fp32, autocast)


def test_inference_weights_are_cast_once_and_fp32_values_kept() -> None:
    model = randomize_batch_norms(REFERENCE_MODELS["resnet"].build()).eval()
    inputs = (torch.randn(2, 3, 32, 32),)
    folded = graphopt.optimize(model, inputs, memory_format="preserve")
    optimized = graphopt.optimize(model, inputs, memory_format="preserve", precision="bf16")
    assert {p.dtype for p in optimized.parameters()} == {torch.bfloat16}
    fp32 = optimized.fp32_weights()
    assert set(fp32) == set(dict(optimized.named_parameters()))
    for name, value in folded.state_dict().items():
        torch.testing.assert_close(fp32[name], value)  # the folded fp32 weights, before the cast
    casts = [n for n in optimized.graph.nodes if n.meta.get(CAST)]
    assert len(casts) == 2, "the input to bf16 and the logits back to fp32: no per-call weight casts"


def test_works_with_folding_and_channels_last() -> None:
    model = randomize_batch_norms(REFERENCE_MODELS["mobilenet_v2"].build()).eval()
    inputs = (torch.randn(2, 3, 32, 32),)
    optimized = graphopt.optimize(model, inputs, precision="bf16", memory_format="channels_last")
    gm = optimized.graph_module
    assert not [n for n in gm.graph.nodes if batch_norm_view(gm, n) is not None]
    expected = list(preset("inference", measure=False))  # memory_format="channels_last": the oneDNN kernels are opt-in
    expected.insert(expected.index("to_channels_last"), "use_low_precision")
    assert [p.name for p in optimized.graphopt_report.passes] == expected
    record_dtypes(gm, inputs)
    assert_policy_holds(gm, torch.bfloat16)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in optimized.parameters() if p.dim() == 4)
    assert_same_outputs(model, optimized, inputs, BF16_BOUND)


@pytest.mark.skipif(not precision.cpu_runs(torch.float16), reason="this CPU has no fp16 kernels (the error is tested below)")
def test_fp16_on_cpu() -> None:
    model = REFERENCE_MODELS["transformer"].build().eval()
    inputs = (torch.randn(2, 3, 32, 32),)
    optimized = graphopt.optimize(model, inputs, precision="fp16", memory_format="preserve")
    record_dtypes(optimized.graph_module, inputs)
    assert assert_policy_holds(optimized.graph_module, torch.float16) > 0
    assert_same_outputs(model, optimized, inputs, 1e-2)


class Attention(nn.Module):
    """One input read by two linears (cast once), softmax and a PReLU with its own fp32 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.act = nn.Linear(8, 8), nn.Linear(8, 8), nn.PReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.act(F.softmax(scores, dim=-1) @ x)


def test_one_cast_per_value_and_unknown_modules_get_fp32() -> None:
    model = Attention()
    inputs = (torch.randn(2, 5, 8),)
    # the policy on matmul and softmax is the point here, not their fusion into one attention kernel
    optimized = graphopt.optimize(model.eval(), inputs, precision="bf16", memory_format="preserve", disable=["use_attention_kernel"])
    gm = optimized.graph_module
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert [u.meta.get(CAST) for u in placeholder.users].count(True) == 1
    record_dtypes(gm, inputs)
    assert assert_policy_holds(gm, torch.bfloat16) == 4  # q, k and both matmuls
    prelu = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "act")
    assert prelu.meta["test_input_dtypes"] == {torch.float32}
    assert_same_outputs(model, optimized, inputs, BF16_BOUND)


def test_policy_overrides() -> None:
    model = Attention().eval()
    inputs = (torch.randn(2, 5, 8),)
    optimized = graphopt.optimize(
        model, inputs, precision="bf16", memory_format="preserve", low_precision_ops=["matmul"], fp32_ops=["linear"], disable=["use_attention_kernel"]
    )
    gm = optimized.graph_module
    record_dtypes(gm, inputs)
    linears = [n for n in gm.graph.nodes if precision_family(gm, n) == "linear"]
    assert linears and all(n.meta["test_input_dtypes"] == {torch.float32} for n in linears)
    assert assert_policy_holds(gm, torch.bfloat16, {"matmul"}, {"linear"}) == 2
    softmax_in_low = graphopt.optimize(model, inputs, precision="bf16", memory_format="preserve", fp32_ops=[], disable=["use_attention_kernel"])
    record_dtypes(softmax_in_low.graph_module, inputs)
    softmax = next(n for n in softmax_in_low.graph.nodes if precision_family(softmax_in_low.graph_module, n) == "softmax")
    assert softmax.meta["test_input_dtypes"] == {torch.bfloat16}


def test_model_without_low_precision_ops_is_unchanged() -> None:
    model = nn.Sequential(nn.ReLU(), nn.LayerNorm(4))
    optimized = graphopt.optimize(model.eval(), torch.randn(2, 4), precision="bf16")
    report = optimized.graphopt_report["use_low_precision"]
    assert not report.modified and "nothing to gain" in report.notes[0]


def test_precision_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),)
    with pytest.raises(graphopt.InvalidOptionError, match="unknown precision 'int4': use one of 'fp32', 'bf16', 'fp16', 'int8'"):
        graphopt.optimize(model, inputs, precision="int4")
    with pytest.raises(graphopt.InvalidOptionError, match="precision='fp32': pass precision='bf16' or 'fp16'"):
        graphopt.optimize(model, inputs, passes=["use_low_precision"])
    with pytest.raises(graphopt.InvalidOptionError, match=r"unknown op families \['convolution'\]"):
        graphopt.optimize(model, inputs, precision="bf16", low_precision_ops=["convolution"])
    with pytest.raises(graphopt.InvalidOptionError, match=r"\['linear'\] are in both"):
        graphopt.optimize(model, inputs, precision="bf16", fp32_ops=["linear"])
    monkeypatch.setattr(precision, "cpu_runs", lambda dtype: False)
    with pytest.raises(graphopt.InvalidOptionError, match="this CPU has no fp16 convolution/matmul kernels"):
        graphopt.optimize(model, inputs, precision="fp16")


def test_verification_uses_the_low_precision_tolerance() -> None:
    model, x = REFERENCE_MODELS["resnet"].build().eval(), torch.randn(2, 3, 32, 32)
    report = graphopt.optimize(model, (x,), precision="bf16", memory_format="preserve").graphopt_report
    # torch.autocast's own bf16 error on the example, times the factor, at least one bf16 rounding (tests/test_autocast_reference.py)
    check = verify.Check((x,), verify.run_reference(copy.deepcopy(model), (x,)), "the example inputs")
    own, _ = verify.autocast_errors(check, copy.deepcopy(model), torch.bfloat16, gradients=False)
    assert report.tolerance == pytest.approx(max(verify.AUTOCAST_FACTOR * own, verify.low_precision_floor(torch.bfloat16)))
    assert f"tolerance {report.tolerance:.0e}" in str(report) and any("judged against torch.autocast(bfloat16)" in note for note in report.notes)
    assert report["fold_conv_bn"].max_error < 1e-5, "passes before the cast keep the fp32 check"


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_training_matches_torch_autocast(frontend: str) -> None:
    """Explicit casts give autocast's semantics: same forward, same fp32 gradients, on a conv/BN net."""
    model = randomize_batch_norms(REFERENCE_MODELS["resnet"].build()).train()
    inputs = (torch.randn(4, 3, 32, 32),)
    optimized = graphopt.optimize(model, inputs, frontend=frontend, precision="bf16", memory_format="preserve")
    names = {n for n, _ in optimized.named_parameters()}
    for args in (inputs, second_inputs(model, inputs)):
        expected, expected_gradients = output_and_gradients(model, args, names, autocast=True)
        actual, actual_gradients = output_and_gradients(optimized, args, names)
        assert relative_error(expected, actual) < 1e-3
        assert relative_error(expected_gradients, actual_gradients) < 1e-3


class NormsBetweenLinears(nn.Module):
    """layer_norm and group_norm between low-precision ops: both take the bf16 value with their fp32 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.group, self.b = nn.Linear(8, 8), nn.LayerNorm(8), nn.GroupNorm(2, 8), nn.Linear(8, 4)
        with torch.no_grad():
            for norm in (self.norm, self.group):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.group(self.norm(self.a(x))))


def test_layer_and_group_norm_read_low_precision_input_with_fp32_parameters() -> None:
    model, inputs = NormsBetweenLinears().eval(), (torch.randn(6, 8),)
    optimized = graphopt.optimize(model, inputs, precision="bf16", memory_format="preserve")
    gm = optimized.graph_module
    record_dtypes(gm, inputs)
    norms = [n for n in gm.graph.nodes if precision_family(gm, n) in ("layer_norm", "group_norm")]
    assert len(norms) == 2 and all(n.meta["test_input_dtypes"] == {torch.bfloat16} for n in norms)
    assert {p.dtype for name, p in optimized.named_parameters() if name.startswith(("norm.", "group."))} == {torch.float32}
    casts = [n for n in gm.graph.nodes if n.meta.get(CAST)]
    assert len(casts) == 2, "the input to bf16 and the output back: none around the norms"

    # the same values as the norms in fp32 on the bf16 value, rounded once to bf16
    low = copy.deepcopy(model).bfloat16()
    for (x,) in (inputs, second_inputs(model, inputs)):
        with torch.no_grad():
            normed = model.group(model.norm(low.a(x.bfloat16()).float()).bfloat16().float()).bfloat16()
            expected = low.b(normed).float()
            assert relative_error(expected, optimized(x)) < 1e-2

    kept = graphopt.optimize(model, inputs, precision="bf16", memory_format="preserve", fp32_ops=[*DEFAULT_FP32_OPS, "layer_norm", "group_norm"])
    record_dtypes(kept.graph_module, inputs)
    kept_norms = [n for n in kept.graph.nodes if precision_family(kept.graph_module, n) in ("layer_norm", "group_norm")]
    assert all(n.meta["test_input_dtypes"] == {torch.float32} for n in kept_norms), "fp32_ops= still keeps them in fp32"

"""Verified beyond the example: second inputs, gradients, side effects, calls outside the capture, degenerate outputs.

Regression tests for what a new user found unverified: gradients of layers frozen with
``torch.no_grad()`` in forward, buffers updated in forward under training, Python side
effects lost silently, calls with other sizes, ranks or dtypes, outputs too small to
verify (MobileViT from its default config), and what a failed check does.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.passes import REGISTRY, PassInfo
from graphopt.passes.base import finish
from graphopt.report import PassReport
from graphopt.verify import compare, run_reference
from tests.conftest import FRONTENDS, assert_trains_like


def _line(function: object, text: str) -> int:
    """The line number of the first source line of ``function`` containing ``text``."""
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


# --------------------------------------------------------------------------- training semantics


class FrozenByNoGrad(nn.Module):
    """A layer the user freezes inside forward: it must receive no gradient, as in eager."""

    def __init__(self, freeze: str) -> None:
        super().__init__()
        self.frozen, self.head, self.freeze = nn.Linear(6, 6), nn.Linear(6, 3), freeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.freeze == "no_grad":
            with torch.no_grad():
                y = self.frozen(x)
        else:
            with torch.set_grad_enabled(False):
                y = self.frozen(x)
        return self.head(torch.relu(y))


@pytest.mark.parametrize("freeze", ["no_grad", "set_grad_enabled"])
def test_fx_refuses_a_graph_that_drops_a_grad_mode_block(freeze: str) -> None:
    with pytest.raises(graphopt.CaptureError, match="frozen.weight'\\] receives a gradient in the graph but not in the original.*no_grad"):
        graphopt.optimize(FrozenByNoGrad(freeze).train(), (torch.randn(4, 6),), frontend="fx")


@pytest.mark.parametrize("frontend", ["auto", "export"])
@pytest.mark.parametrize("freeze", ["no_grad", "set_grad_enabled"])
def test_layers_frozen_in_forward_stay_frozen(freeze: str, frontend: str) -> None:
    model = FrozenByNoGrad(freeze).train()
    optimized = graphopt.optimize(model, (torch.randn(4, 6),), frontend=frontend)
    assert optimized.graphopt_report.frontend == "export"
    optimized(torch.randn(5, 6)).square().sum().backward()
    assert optimized.get_parameter("frozen.weight").grad is None and optimized.get_parameter("head.weight").grad is not None
    assert_trains_like(model, optimized, (torch.randn(4, 6),))


class AutocastInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.linear(x)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_autocast_in_forward_is_kept(mode: str) -> None:
    model = AutocastInForward().train(mode == "training")
    with pytest.raises(graphopt.CaptureError, match="dtype float32 instead of bfloat16; symbolic_trace drops torch.autocast"):
        graphopt.optimize(model, (torch.randn(4, 8),), frontend="fx")
    optimized = graphopt.optimize(model, (torch.randn(4, 8),))
    assert optimized.graphopt_report.frontend == "export"
    assert optimized(torch.randn(3, 8)).dtype == torch.bfloat16


class CountsSteps(nn.Module):
    """A buffer updated in forward, then used: exported as add_ on the buffer and a copy back onto itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.linear(x) * self.steps


def test_buffer_updated_in_forward_trains_like_eager() -> None:
    model = CountsSteps().train()
    optimized = graphopt.optimize(model, (torch.randn(3, 4),))
    assert optimized.graphopt_report.frontend == "export"
    reference = copy.deepcopy(model)
    for step in range(3):
        x = torch.randn(3 + step, 4)
        for module in (reference, optimized):
            module.zero_grad(set_to_none=True)
            module(x).square().sum().backward()  # raised "modified by an inplace operation" before
        assert optimized.steps == reference.steps == step + 1
        torch.testing.assert_close(optimized.get_parameter("linear.weight").grad, reference.linear.weight.grad)


def test_fx_says_why_it_cannot_capture_a_buffer_update() -> None:
    with pytest.raises(graphopt.CaptureError, match="does not update buffer\\['steps'\\].*symbolic_trace drops in-place updates of buffers"):
        graphopt.optimize(CountsSteps().train(), (torch.randn(3, 4),), frontend="fx")


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_training_verification_compares_gradients_of_a_random_projection() -> None:
    """A pass that breaks only gradients (outputs unchanged) is caught; a plain .sum() after BatchNorm would not see it."""

    def detach_conv(gm, ctx):
        from graphopt.passes.base import finish
        from graphopt.report import PassReport

        report = PassReport("detach_conv")
        for node in list(gm.graph.nodes):
            if node.op == "call_module" and node.target == "conv":
                with gm.graph.inserting_after(node):
                    detached = gm.graph.call_method("detach", (node,))
                node.replace_all_uses_with(detached, delete_user_cb=lambda user: user is not detached)
                report.rewrite(node, "conv output detached")
        return finish(gm, bool(report.rewrites), report)

    model = BatchNormNet().train()
    with pytest.MonkeyPatch.context() as patch:
        from graphopt.passes import REGISTRY, PassInfo

        patch.setitem(REGISTRY, "detach_conv", PassInfo("detach_conv", detach_conv, ("training",), "test"))
        with pytest.raises(graphopt.VerificationError, match="gradient\\['conv.weight'\\] on the example inputs.*receives no gradient in the graph"):
            graphopt.optimize(model, (torch.randn(4, 3, 6, 6),), passes=["detach_conv"], verify="strict")
    # what the projection adds: after a training-mode BatchNorm the gradient of a plain sum is zero
    bare = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    bare(torch.randn(4, 3, 6, 6)).sum().backward()
    assert float(bare[0].weight.grad.abs().max()) < 1e-5
    gradients = run_reference(bare, (torch.randn(4, 3, 6, 6),), gradients=True).gradients
    assert float(gradients["0.weight"].abs().max()) > 1e-2


class TiedEmbedding(nn.Module):
    """T5's layout: one embedding known by two names, forward using the second; a no-op cast to remove."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 8)
        self.encoder_embed = self.shared
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder_embed(ids).to(torch.float32))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_tied_parameter_kept_under_one_name_is_the_same_parameter(frontend: str) -> None:
    ids = torch.randint(0, 10, (4, 5))
    optimized = graphopt.optimize(TiedEmbedding().train(), (ids,), frontend=frontend, verify="strict")
    assert optimized.graphopt_report["remove_redundant_transfers"].rewrites


class ScaledBackward(torch.autograd.Function):
    """The identity in forward (bit for bit); backward multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def scaled_backward(x: torch.Tensor, factor: float) -> torch.Tensor:
    return ScaledBackward.apply(x, factor)


def register_gradient_scaling(monkeypatch: pytest.MonkeyPatch, factor: float, presets: tuple[str, ...] = ()) -> None:
    """Register the test pass "scale_gradients": outputs unchanged, every parameter's gradient times ``factor``."""

    def scale_gradients(gm, ctx):
        report = PassReport("scale_gradients")
        output = next(node for node in gm.graph.nodes if node.op == "output")
        for result in output.all_input_nodes:
            with gm.graph.inserting_before(output):
                scaled = gm.graph.call_function(scaled_backward, (result, factor))
            scaled.meta.update(result.meta)
            output.replace_input_with(result, scaled)
            report.rewrite(result, f"backward scaled by {factor}")
        return finish(gm, bool(report.rewrites), report)

    monkeypatch.setitem(REGISTRY, "scale_gradients", PassInfo("scale_gradients", scale_gradients, ("training",), "test pass", presets=presets))


def test_a_pass_that_changes_only_gradient_values_is_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    register_gradient_scaling(monkeypatch, 1.01)
    model, example = BatchNormNet().train(), (torch.randn(4, 3, 6, 6),)
    changed = "changed gradient\\['[\\w.]+'\\] on the example inputs by [\\d.e+-]+ relative to the gradient's scale"
    with pytest.warns(graphopt.VerificationWarning, match=f"rolled back pass 'scale_gradients', which failed verification: .*{changed}"):
        optimized = graphopt.optimize(model, example, passes=["scale_gradients"])
    assert optimized.graphopt_report["scale_gradients"].rolled_back
    assert_trains_like(model, optimized, example)  # the graph as captured: gradients unscaled
    with pytest.raises(graphopt.VerificationError, match=changed) as info:
        graphopt.optimize(model, example, passes=["scale_gradients"], verify="strict")
    assert info.value.pass_name == "scale_gradients" and info.value.max_error == pytest.approx(1e-2, rel=1e-3)


def test_training_report_has_gradient_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    optimized = graphopt.optimize(BatchNormNet().train(), (torch.randn(4, 3, 6, 6),), memory_format="channels_last")
    report = optimized.graphopt_report
    assert report["to_channels_last"].gradient_error is not None and report["to_channels_last"].gradient_error < 1e-4
    assert report.second_input_gradient_error is not None and report.second_input_gradient_error < 1e-4
    assert "grad error" in str(report)
    # the errors are measured, not 0 for want of a comparison: gradients scaled by 1 + 2e-5 (within tolerance) show 2e-5
    register_gradient_scaling(monkeypatch, 1 + 2e-5, presets=("training",))
    mlp = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).train()  # no gradient cancels to rounding noise
    report = graphopt.optimize(mlp, (torch.randn(4, 6),)).graphopt_report
    assert report["scale_gradients"].gradient_error == pytest.approx(2e-5, rel=0.05)
    assert report.second_input_gradient_error == pytest.approx(2e-5, rel=0.05)
    assert f"{report['scale_gradients'].gradient_error:.1e}" in str(report).split("grad error")[1]


# --------------------------------------------------------------------------- the second input


def test_every_optimized_module_is_checked_on_a_second_input() -> None:
    optimized = graphopt.optimize(BatchNormNet().eval(), (torch.randn(4, 3, 6, 6),))
    report = optimized.graphopt_report
    assert report.second_input.startswith("batch 5 (example: 4), values resampled from the example's, channels_last strides")
    assert report.second_input_error is not None and report.second_input_error < 1e-4
    assert "second input: batch 5" in str(report)


class HardCodedBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(4, -1).sum(1)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_model_that_fixes_its_batch_is_checked_at_that_batch_and_refuses_others(frontend: str) -> None:
    optimized = graphopt.optimize(HardCodedBatch().eval(), (torch.randn(4, 3),), frontend=frontend)
    assert optimized.graphopt_report.second_input.startswith("the example's batch size")
    with pytest.raises(graphopt.InputMismatchError, match="x has shape \\[5, 3\\]"):
        optimized(torch.randn(5, 3))


def test_without_an_acceptable_second_input_the_report_says_so() -> None:
    class IncreasingOnly(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(torch.diff(x))  # NaN unless x increases: resampled values do not

    with pytest.warns(graphopt.VerificationWarning, match="verified on the example inputs only.*NaN"):
        optimized = graphopt.optimize(IncreasingOnly().eval(), (torch.arange(1.0, 9.0),))
    assert optimized.graphopt_report.second_input == ""


# --------------------------------------------------------------------------- calls outside the capture


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_calls_outside_what_was_captured_raise_input_mismatch(frontend: str) -> None:
    optimized = graphopt.optimize(Convs().eval(), (torch.randn(2, 3, 16, 16),), frontend=frontend, memory_format="channels_last")
    assert optimized(torch.randn(5, 3, 16, 16)).shape == (5, 4, 16, 16)  # another batch size was verified
    other_sizes = "optimize with dynamic_shapes=\\{'x': \\{2: torch.export.Dim.AUTO, 3: torch.export.Dim.AUTO\\}\\}"
    calls = {
        "has shape \\[2, 3, 32, 32\\]": (torch.randn(2, 3, 32, 32), other_sizes),  # export: a bare "Guard failed" before
        "has 3 dimensions": (torch.randn(3, 16, 16), "Optimize the model again"),  # "required rank 4 tensor to use channels_last format" before
        "has dtype float64": (torch.randn(2, 3, 16, 16, dtype=torch.float64), "Optimize the model again"),
    }
    for problem, (x, fix) in calls.items():
        with pytest.raises(graphopt.InputMismatchError, match=f"x {problem}.*accepts \\(x: Tensor\\[\\*, 3, 16, 16\\] float32 on cpu\\).*{fix}"):
            optimized(x)
    with pytest.raises(graphopt.InputMismatchError, match="the call's arguments"):
        optimized(torch.randn(2, 3, 16, 16), torch.randn(2))
    assert optimized(x=torch.randn(1, 3, 16, 16)).shape == (1, 4, 16, 16)  # by keyword too


def test_without_dynamic_batch_the_batch_size_is_fixed() -> None:
    optimized = graphopt.optimize(Convs().eval(), (torch.randn(2, 3, 8, 8),), dynamic_batch=False)
    assert optimized.graphopt_report.second_input.startswith("the example's batch size")
    with pytest.raises(graphopt.InputMismatchError, match="accepts \\(x: Tensor\\[2, 3, 8, 8\\]"):
        optimized(torch.randn(3, 3, 8, 8))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_optimized_module_never_modifies_its_inputs(frontend: str) -> None:
    class UsesViews(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            a = x.reshape(-1) * 2
            b = x[0] + 1
            c = x.t() * y.t()
            d = torch.relu(y) * 3
            return a + 1, b * b, c / 2, d + y

    model = UsesViews().eval()
    for memory_format in ("preserve", "channels_last"):
        example = (torch.randn(4, 4), torch.randn(4, 4))
        optimized = graphopt.optimize(model, example, frontend=frontend, memory_format=memory_format, dynamic_batch=False)
        for args in (example, (torch.randn(4, 4).t(), torch.randn(8, 4)[::2])):
            kept = [t.clone() for t in args]
            with torch.no_grad():
                expected = model(*args)
            actual = optimized(*args)
            assert all(torch.equal(before, after) for before, after in zip(kept, args, strict=True))
            assert compare(expected, actual).ok


# --------------------------------------------------------------------------- side effects

HISTORY: list[object] = []


class Chatty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.calls = nn.Linear(4, 4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("forward called")
        HISTORY.append(x.shape[0])
        self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_side_effects_are_reported_with_their_lines_and_nothing_leaks(frontend: str, capsys: pytest.CaptureFixture[str]) -> None:
    HISTORY.clear()
    model = Chatty().eval()
    with pytest.warns(graphopt.SideEffectWarning) as record:
        optimized = graphopt.optimize(model, (torch.randn(3, 4),), frontend=frontend)
    message = str(record[0].message)
    for text in ('print("forward called")', "HISTORY.append", "self.calls += 1"):
        assert f"test_verification.py:{_line(Chatty.forward, text)}" in message, (text, message)
    assert "calls print" in message and "appends to the list `HISTORY`" in message and "self.calls" in message
    assert HISTORY == [] and model.calls == 0, "nothing symbolic (or real) was left in the user's objects"
    assert any("side effects" in warning for warning in optimized.graphopt_report.warnings)
    capsys.readouterr()
    optimized(torch.randn(2, 4))
    assert capsys.readouterr().out == "" and HISTORY == []  # as reported: the graph runs only tensor ops


def test_a_model_without_side_effects_warns_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphopt.SideEffectWarning)
        optimized = graphopt.optimize(BatchNormNet().eval(), (torch.randn(2, 3, 6, 6),))
    assert optimized.graphopt_report.warnings == []


# --------------------------------------------------------------------------- bad models


def test_a_model_returning_none_is_refused() -> None:
    class ReturnsNothing(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            torch.relu(x)

    with pytest.raises(graphopt.InvalidModelError, match="forward\\(\\) returned None.*no tensor"):
        graphopt.optimize(ReturnsNothing().eval(), (torch.randn(2, 3),))


def test_a_meta_device_model_is_blamed_not_its_inputs() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(graphopt.InvalidModelError, match="weight, bias are on the meta device.*to_empty"):
        graphopt.optimize(model.eval(), (torch.randn(2, 4),))


# --------------------------------------------------------------------------- degenerate outputs


def test_subnormal_outputs_are_diagnosed_and_rounding_is_not_a_mismatch() -> None:
    x = torch.randn(64, dtype=torch.float64) * 1e-40
    expected, actual = x.float(), (x * (1 + 1e-3)).float()  # one subnormal rounding apart
    assert compare(expected, actual).ok
    assert not compare(expected * 1e30, actual * 1e30 + 1e-12).ok  # normal numbers keep the relative rule

    class Vanishing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softmax(self.linear(x), -1) * 1e-39

    with pytest.warns(graphopt.VerificationWarning, match="output is subnormal: its largest magnitude is .*e-40.*cannot tell a correct rewrite"):
        optimized = graphopt.optimize(Vanishing().eval(), (torch.randn(4, 8),))
    assert "subnormal" in optimized.graphopt_report.warnings[0]


@pytest.mark.slow
def test_mobilevit_from_its_default_config_is_optimized_with_a_diagnosis() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MobileViTModel(transformers.MobileViTConfig()).eval()
    example = (torch.randn(2, 3, 64, 64),)
    with pytest.warns(graphopt.VerificationWarning, match="last_hidden_state'\\] is subnormal"):
        optimized = graphopt.optimize(model, example, memory_format="preserve", verify="strict")
    report = optimized.graphopt_report
    assert report["use_attention_kernel"].rewrites and not any(p.rolled_back for p in report.passes)
    other = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        assert compare(model(other), optimized(other)).ok

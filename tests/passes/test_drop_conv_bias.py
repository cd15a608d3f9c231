"""drop_conv_bias: exact in train and eval mode under plain SGD, gradients unchanged, guards recorded; opt-in."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.passes import REGISTRY
from graphopt.passes.drop_conv_bias import drop_conv_bias
from graphopt.pipeline import PRESETS
from tests.conftest import FRONTENDS, ConvOutputReused, assert_same_outputs, assert_trains_like, captured, context, randomize_batch_norms

LAYERS = {
    "conv1d": (lambda: nn.Conv1d(3, 4, 3), nn.BatchNorm1d, (4, 3, 9)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3), nn.BatchNorm2d, (4, 3, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(3, 4, 3), nn.BatchNorm3d, (4, 3, 5, 5, 5)),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d, (4, 3, 5, 5)),
    "grouped_conv2d": (lambda: nn.Conv2d(4, 4, 3, groups=2), nn.BatchNorm2d, (4, 4, 6, 6)),
    "linear": (lambda: nn.Linear(3, 4), nn.BatchNorm1d, (6, 3)),
}


def with_biases(model: nn.Module) -> nn.Module:
    """Large biases, so a wrong rewrite cannot hide behind rounding."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and module.bias is not None:
                module.bias.copy_(torch.randn_like(module.bias) * 3)
    return randomize_batch_norms(model)


def train_step(model: nn.Module, inputs: tuple, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad(set_to_none=True)
    out = model(*inputs)
    (out.square().mean() + out.mean()).backward()
    optimizer.step()


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("kind", LAYERS)
def test_bias_dropped_forward_and_gradients_match(kind: str, frontend: str) -> None:
    layer, norm, shape = LAYERS[kind]
    model = with_biases(nn.Sequential(layer(), norm(4), nn.ReLU())).train()
    inputs = (torch.randn(shape),)
    gm = captured(model, inputs, frontend)
    result = drop_conv_bias(gm, context(inputs, "training"))

    assert result.modified and len(result.report.rewrites) == 1
    assert sum(p.numel() for p in gm.parameters()) == sum(p.numel() for p in model.parameters()) - 4
    assert not [name for name, _ in gm.named_parameters() if name.endswith("0.bias")]

    assert_trains_like(model, gm, inputs)


@pytest.mark.parametrize("kind", LAYERS)
def test_exact_in_eval_mode_after_training_steps(kind: str) -> None:
    layer, norm, shape = LAYERS[kind]
    model = with_biases(nn.Sequential(layer(), norm(4), nn.ReLU())).train()
    inputs = (torch.randn(shape),)
    gm = captured(model, inputs, "fx")
    drop_conv_bias(gm, context(inputs, "training"))

    reference = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, gm)]
    for _ in range(3):
        step_inputs = (torch.randn(shape),)
        assert_trains_like(reference, gm, step_inputs, 1e-4)
        for trained, optimizer in zip((reference, gm), optimizers, strict=True):
            train_step(trained, step_inputs, optimizer)
    # running_mean carries the dropped bias: eval outputs still match
    reference.eval()
    gm.eval()
    assert_same_outputs(reference, gm, inputs, 1e-4)


def test_running_mean_absorbs_the_bias() -> None:
    model = with_biases(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    bias, running_mean = model[0].bias.detach().clone(), model[1].running_mean.clone()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, "fx")
    drop_conv_bias(gm, context(inputs, "training"))
    torch.testing.assert_close(gm.get_buffer("1.running_mean"), running_mean - bias)
    assert_same_outputs(model, gm, inputs)


def test_cumulative_moving_average_stays_exact() -> None:
    model = with_biases(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None))).train()
    inputs = (torch.randn(4, 3, 6, 6),)
    gm = captured(model, inputs, "fx")
    drop_conv_bias(gm, context(inputs, "training"))
    reference = copy.deepcopy(model)
    for _ in range(3):
        step = (torch.randn(4, 3, 6, 6),)
        reference(*step), gm(*step)
    reference.eval(), gm.eval()
    assert_same_outputs(reference, gm, inputs)


def test_batchnorm_without_running_stats_needs_no_adjustment() -> None:
    model = with_biases(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)))
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, "fx")
    assert drop_conv_bias(gm, context(inputs, "training")).modified
    assert_trains_like(model, gm, inputs)


def test_conv_without_bias_is_not_reported() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))
    inputs = (torch.randn(2, 3, 6, 6),)
    result = drop_conv_bias(captured(model, inputs, "fx"), context(inputs, "training"))
    assert not result.modified and result.report.rewrites == [] and result.report.skips == []


# --------------------------------------------------------------------------- guards


def assert_kept(model: nn.Module, inputs: tuple, reason: str, frontend: str = "fx") -> None:
    """The bias stays, for ``reason``, and the graph still trains like the model (`assert_trains_like`)."""
    gm = captured(model, inputs, frontend)
    before = sum(p.numel() for p in gm.parameters())
    report = drop_conv_bias(gm, context(inputs, "training")).report
    assert report.rewrites == []
    assert any(reason in skip.reason for skip in report.skips), report.skips
    assert sum(p.numel() for p in gm.parameters()) == before
    assert_trains_like(model, gm, inputs)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_guard_conv_output_with_other_users(frontend: str) -> None:
    assert_kept(with_biases(ConvOutputReused()), (torch.randn(2, 3, 6, 6),), "output has 2 users", frontend)


def test_guard_conv_module_called_twice() -> None:
    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(self.bn(self.conv(x)))

    assert_kept(with_biases(Reused()), (torch.randn(2, 3, 6, 6),), "called at 2 places")


def test_guard_running_mean_shared_between_batchnorms() -> None:
    class SharedStats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.other = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4)
            self.other.running_mean = self.bn.running_mean

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x)) + self.other(x[:, :1].expand(-1, 4, -1, -1)[:, :, 1:-1, 1:-1])

    assert_kept(with_biases(SharedStats()).eval(), (torch.randn(2, 3, 6, 6),), "running_mean is shared")


def test_functional_form_drops_the_parameter() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
            self.conv_bias = nn.Parameter(torch.randn(4) * 3)
            self.register_buffer("mean", torch.randn(4))
            self.register_buffer("var", torch.rand(4) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.conv2d(x, self.weight, self.conv_bias)
            return torch.nn.functional.batch_norm(y, self.mean, self.var, training=self.training)

    model = Functional().train()
    inputs = (torch.randn(2, 3, 6, 6),)
    gm = captured(model, inputs, "fx")
    assert drop_conv_bias(gm, context(inputs, "training")).modified
    assert "conv_bias" not in dict(gm.named_parameters())
    assert_trains_like(model, gm, inputs)


# --------------------------------------------------------------------------- opt-in: exact under plain SGD only


def two_convs() -> nn.Module:
    """Two conv -> BatchNorm pairs with large biases, and a linear head."""
    layers = [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU()]
    return with_biases(nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 4 * 4, 2)))


def test_the_training_preset_keeps_the_bias_so_adamw_trains_like_the_original() -> None:
    """AdamW moves the original's bias (its gradient, rounding noise, normalised into steps; the decay pulls it),
    which a dropped bias cannot follow: no preset drops it, and 8 identical steps leave eval outputs equal."""
    assert "drop_conv_bias" not in PRESETS["training"] and REGISTRY["drop_conv_bias"].presets == ()
    torch.manual_seed(0)
    model = two_convs().train()
    inputs = (torch.randn(8, 3, 8, 8),)
    optimized = graphopt.optimize(model, inputs, frontend="fx", memory_format="preserve")
    assert {name for name, _ in optimized.named_parameters()} == {name for name, _ in model.named_parameters()}

    reference = copy.deepcopy(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=1e-2) for m in (reference, optimized)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(8):
        step_inputs = (torch.randn(8, 3, 8, 8, generator=generator),)
        for trained, optimizer in zip((reference, optimized), optimizers, strict=True):
            train_step(trained, step_inputs, optimizer)
    reference.eval()
    optimized.eval()
    assert_same_outputs(reference, optimized, inputs, 1e-5)


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_opting_in_in_training_mode_reports_that_only_plain_sgd_stays_exact(mode: str) -> None:
    torch.manual_seed(0)
    model = two_convs().train(mode == "training")
    report = graphopt.optimize(model, (torch.randn(8, 3, 8, 8),), mode=mode, passes=["drop_conv_bias"]).graphopt_report
    assert len(report["drop_conv_bias"].rewrites) == 2
    caveat = [note for note in report["drop_conv_bias"].notes if "plain SGD without weight decay" in note]
    if mode == "training":
        assert caveat and "Adam" in caveat[0] and "weight decay" in caveat[0]
    else:
        assert not caveat

"""Checkpoints across optimization: original checkpoints load into optimized modules and back."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.checkpoint import DroppedBias, FoldedBatchNorm, to_optimized
from graphopt.models import REFERENCE_MODELS, resnet_small
from graphopt.pipeline import preset_with
from tests.conftest import FRONTENDS, randomize_batch_norms, relative_error

CNNS = ("resnet", "mobilenet_v2", "convnext")
# torch.export captures are slow: every CNN through fx, the ResNet through both frontends
MODELS_AND_FRONTENDS = [(name, "fx") for name in CNNS] + [("resnet", "export")]


def dropping_biases(channels_last: bool = True) -> list[str]:
    """The training preset with the opt-in drop_conv_bias: the pass that removes tensors in training mode."""
    return preset_with("training", ["drop_conv_bias"], low_precision=False, channels_last=channels_last)


def inputs(batch: int = 2) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch)),)


def other_weights(name: str) -> nn.Module:
    """A differently initialised model of the same class, with shifted BatchNorm statistics."""
    model = randomize_batch_norms(REFERENCE_MODELS[name].build(seed=1))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.add_(0.5)
                module.num_batches_tracked.fill_(7)
    return model


def outputs(model: nn.Module, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    torch.manual_seed(0)  # same dropout masks
    return model(*args)


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize(("name", "frontend"), MODELS_AND_FRONTENDS)
def test_checkpoints_go_both_ways(name: str, mode: str, frontend: str) -> None:
    model, checkpoint_model = REFERENCE_MODELS[name].build(seed=0), other_weights(name)
    passes = dropping_biases() if mode == "training" else None
    optimized = graphopt.optimize(model, inputs(), mode=mode, frontend=frontend, memory_format="channels_last", passes=passes)
    optimized.load_original_state_dict(checkpoint_model.state_dict())

    # the same state as optimizing the checkpoint's model directly: folds and drops re-applied exactly
    expected = graphopt.optimize(checkpoint_model, inputs(), mode=mode, frontend=frontend, memory_format="channels_last", passes=passes)
    assert_same_state(optimized.state_dict(), expected.state_dict())
    conv_weights = [p for p in optimized.parameters() if p.dim() == 4 and p.shape[-1] > 1]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in conv_weights), "loading keeps the layout"
    checkpoint_model.train(mode == "training")
    assert relative_error(outputs(checkpoint_model, inputs(4)), outputs(optimized, inputs(4))) < 1e-5

    # and back: the original model given this module's state computes the same
    state = optimized.original_state_dict()
    restored = REFERENCE_MODELS[name].build(seed=5)
    assert list(state) == list(restored.state_dict()), "the original model's keys, in its order"
    restored.load_state_dict(state)
    restored.train(mode == "training")
    assert relative_error(outputs(optimized, inputs(4)), outputs(restored, inputs(4))) < 1e-5
    if mode == "training" and frontend == "fx":  # dropped biases map back exactly: eval mode agrees too
        optimized.eval()
        restored.eval()
        assert relative_error(outputs(optimized, inputs(4)), outputs(restored, inputs(4))) < 1e-5


def test_trained_weights_go_to_the_original_model_and_back() -> None:
    model = randomize_batch_norms(REFERENCE_MODELS["resnet"].build()).train()
    optimized = graphopt.optimize(model, inputs(4), memory_format="channels_last", passes=dropping_biases())
    optimizer = torch.optim.SGD(optimized.parameters(), lr=0.1, momentum=0.9)  # no weight decay: dropping biases is exact
    labels = torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(optimized(*inputs(4)), labels).backward()
        optimizer.step()

    restored = REFERENCE_MODELS["resnet"].build(seed=5)
    restored.load_state_dict(optimized.original_state_dict())
    assert all(restored.get_parameter(key).abs().max() == 0 for key in ("stem_conv.bias", "layer1.conv1.bias")), "dropped biases come back as zeros"
    again = graphopt.optimize(model, inputs(4), memory_format="channels_last", passes=dropping_biases())
    again.load_original_state_dict(restored.state_dict())
    for key, value in optimized.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key

    for train in (True, False):
        optimized.train(train)
        restored.train(train)
        assert relative_error(outputs(optimized, inputs(4)), outputs(restored, inputs(4))) < 1e-5


def test_parameter_map_names_every_removed_and_rewritten_key() -> None:
    model = randomize_batch_norms(REFERENCE_MODELS["resnet"].build())
    training = graphopt.optimize(model.train(), inputs(), memory_format="preserve", passes=dropping_biases(channels_last=False))
    removed = set(model.state_dict()) - set(training.state_dict())
    mapping = training.parameter_map
    assert removed == {key for key, what in mapping.items() if what.startswith("dropped")}
    assert mapping["layer1.conv1.bias"] == "dropped: cancelled by the mean subtraction of layer1.bn1"
    assert mapping["layer1.bn1.running_mean"] == "lowered by layer1.conv1.bias (absorbs the dropped bias)"
    assert len(mapping) == 2 * len(removed) == 10
    assert all(isinstance(change, DroppedBias) for change in training.state_changes)

    inference = graphopt.optimize(model.eval(), inputs(), memory_format="preserve", precision="bf16")
    mapping = inference.parameter_map
    removed = set(model.state_dict()) - set(inference.state_dict())
    assert removed == {key for key, what in mapping.items() if what.startswith("folded into")}
    assert mapping["layer1.bn1.running_var"] == "folded into layer1.conv1.weight and layer1.conv1.bias"
    assert mapping["layer1.conv2.bias"] == "created by folding the BatchNorm; stored in bfloat16 (fp32 value: fp32_weights())"
    assert mapping["fc.weight"] == "stored in bfloat16 (fp32 value: fp32_weights())"
    assert {key for key in inference.state_dict() if key not in model.state_dict()} <= set(mapping)


def test_state_changes_are_in_the_report() -> None:
    optimized = graphopt.optimize(randomize_batch_norms(REFERENCE_MODELS["resnet"].build()).eval(), inputs(), memory_format="preserve")
    folds = optimized.graphopt_report["fold_conv_bn"].state_changes
    assert len(folds) == 12 and all(isinstance(change, FoldedBatchNorm) for change in folds)
    assert folds[0] == FoldedBatchNorm(
        kind="conv", weight="stem_conv.weight", bias="stem_conv.bias", folded_bias="stem_conv.bias",
        running_mean="stem_bn.running_mean", running_var="stem_bn.running_var", batch_norm_weight="stem_bn.weight",
        batch_norm_bias="stem_bn.bias", num_batches_tracked="stem_bn.num_batches_tracked", eps=1e-5,
    )
    data = json.loads(optimized.graphopt_report.to_json())
    fold = next(p for p in data["passes"] if p["name"] == "fold_conv_bn")
    assert fold["state_changes"][0]["running_var"] == "stem_bn.running_var"


class FunctionalBatchNorm(nn.Module):
    """F.conv2d/F.batch_norm on plain attributes, a bias-free conv, a non-affine BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.register_buffer("mean", torch.randn(4))
        self.register_buffer("var", torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(F.conv2d(x, self.weight), self.mean, self.var, eps=1e-3)


FORMS = {
    "conv_transpose": lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d(4)),
    "linear": lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 5), nn.BatchNorm1d(5)),
    "conv_without_bias": lambda: nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4, affine=False)),
    "functional": FunctionalBatchNorm,
}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_folded_form_reloads_and_unfolds(form: str, frontend: str) -> None:
    args = (torch.randn(4, 3, 6, 6),)
    model, checkpoint_model = randomize_batch_norms(FORMS[form]()).eval(), randomize_batch_norms(FORMS[form]()).eval()
    optimized = graphopt.optimize(model, args, frontend=frontend, memory_format="preserve", passes=["drop_conv_bias", "fold_conv_bn"])
    assert any(isinstance(change, FoldedBatchNorm) for change in optimized.state_changes)
    optimized.load_original_state_dict(checkpoint_model.state_dict())
    expected = graphopt.optimize(checkpoint_model, args, frontend=frontend, memory_format="preserve", passes=["drop_conv_bias", "fold_conv_bn"])
    assert_same_state(optimized.state_dict(), expected.state_dict())
    assert relative_error(checkpoint_model(*args), optimized(*args)) < 1e-5

    restored = FORMS[form]().eval()
    restored.load_state_dict(optimized.original_state_dict())
    assert relative_error(optimized(*args), restored(*args)) < 1e-5


def test_low_precision_weights_reload_in_fp32() -> None:
    model, checkpoint_model = randomize_batch_norms(REFERENCE_MODELS["resnet"].build()).eval(), other_weights("resnet").eval()
    optimized = graphopt.optimize(model, inputs(), memory_format="preserve", precision="bf16")
    optimized.load_original_state_dict(checkpoint_model.state_dict())
    expected = graphopt.optimize(checkpoint_model, inputs(), memory_format="preserve", precision="bf16")
    assert_same_state(optimized.fp32_weights(), expected.fp32_weights())
    assert_same_state(optimized.state_dict(), expected.state_dict())
    back = optimized.original_state_dict()
    assert {value.dtype for value in back.values() if value.is_floating_point()} == {torch.float32}
    torch.testing.assert_close(back["fc.weight"], checkpoint_model.fc.weight.detach())

    # weights loaded behind graphopt's back (plain load_state_dict) are not replaced by stale fp32 values
    changed = {**optimized.state_dict(), "fc.weight": torch.zeros_like(optimized.get_parameter("fc.weight"))}
    optimized.load_state_dict(changed)
    assert optimized.original_state_dict()["fc.weight"].abs().max() == 0


class UnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.unused = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def test_tensors_forward_never_reads_are_accepted_and_left_out() -> None:
    args = (torch.randn(2, 3, 6, 6),)
    optimized = graphopt.optimize(UnusedHead().train(), args, frontend="fx", memory_format="preserve")
    checkpoint_model = randomize_batch_norms(UnusedHead()).train()
    optimized.load_original_state_dict(checkpoint_model.state_dict())
    assert relative_error(checkpoint_model(*args), optimized(*args)) < 1e-5
    assert set(checkpoint_model.state_dict()) - set(optimized.original_state_dict()) == {"unused.weight", "unused.bias"}


def test_wrong_checkpoints_are_refused_with_the_keys() -> None:
    model = REFERENCE_MODELS["resnet"].build()
    optimized = graphopt.optimize(model.eval(), inputs(), memory_format="preserve")
    incomplete = {key: value for key, value in model.state_dict().items() if key != "stem_bn.running_var"}
    with pytest.raises(graphopt.CheckpointError, match=r"missing keys \['stem_bn.running_var'\], unexpected keys \[\]"):
        optimized.load_original_state_dict(incomplete)
    with pytest.raises(graphopt.CheckpointError, match=r"unexpected keys \['head.weight'\].*original_model.state_dict\(\)"):
        optimized.load_original_state_dict({**model.state_dict(), "head.weight": torch.zeros(1)})
    with pytest.raises(graphopt.CheckpointError, match="unexpected keys"):
        optimized.load_original_state_dict(optimized.state_dict())  # its own keys belong to load_state_dict
    assert issubclass(graphopt.CheckpointError, ValueError)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_tensors_of_other_shapes_are_refused(mode: str) -> None:
    optimized = graphopt.optimize(REFERENCE_MODELS["resnet"].build(), inputs(), mode=mode, memory_format="preserve")
    before = {key: value.clone() for key, value in optimized.state_dict().items()}
    narrower = resnet_small(width=8)  # the same keys, other shapes
    with pytest.raises(graphopt.CheckpointError, match=r"do not fit this model \(.*\): pass the state_dict .* same configuration"):
        optimized.load_original_state_dict(narrower.state_dict())
    after = optimized.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items()), "nothing was loaded"

    inconsistent = {**REFERENCE_MODELS["resnet"].build().state_dict(), "stem_bn.running_var": torch.ones(3)}
    with pytest.raises(graphopt.CheckpointError, match="do not fit this model"):
        optimized.load_original_state_dict(inconsistent)  # a BatchNorm of 3 features after a conv of 16 channels


def test_conversion_names_a_key_it_needs() -> None:
    optimized = graphopt.optimize(REFERENCE_MODELS["resnet"].build().eval(), inputs(), memory_format="preserve")
    state = optimized.state_dict()  # already folded: the BatchNorm tensors are gone
    with pytest.raises(graphopt.CheckpointError, match="no 'stem_bn.running_mean'.*full state_dict"):
        to_optimized(state, optimized.state_changes)

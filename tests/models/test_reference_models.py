"""Tests for the reference models in graphopt.models.

Every model must run in eval and train mode, build deterministically,
survive torch.fx.symbolic_trace and torch.export with a dynamic batch
dimension, and contain the patterns that graphopt's passes rewrite.
"""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from graphopt.models import REFERENCE_MODELS, ReferenceModel, get_reference_model

MODEL_NAMES = sorted(REFERENCE_MODELS)
# The transformer's position embedding fixes its input size.
CONVOLUTIONAL_MODEL_NAMES = [name for name in MODEL_NAMES if name != "transformer"]
NUM_CLASSES = 10
SMALL_BATCH = 2


@pytest.fixture(params=MODEL_NAMES)
def reference(request: pytest.FixtureRequest) -> ReferenceModel:
    return REFERENCE_MODELS[request.param]


def _modules_of_type(model: nn.Module, module_type: type[nn.Module]) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, module_type)]


def _module_pairs(
    model: nn.Module, first_type: type[nn.Module], second_type: type[nn.Module]
) -> list[fx.Node]:
    """Return fx nodes calling a ``first_type`` module whose only user calls a ``second_type`` module."""
    traced = fx.symbolic_trace(model)
    modules = dict(traced.named_modules())
    pairs = []
    for node in traced.graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], first_type):
            continue
        users = list(node.users)
        if (
            len(users) == 1
            and users[0].op == "call_module"
            and isinstance(modules[users[0].target], second_type)
        ):
            pairs.append(node)
    return pairs


def _called_functions(model: nn.Module) -> set[object]:
    return {node.target for node in fx.symbolic_trace(model).graph.nodes if node.op == "call_function"}


def test_registry_names_match_keys() -> None:
    assert MODEL_NAMES == sorted(["resnet", "mobilenet_v2", "convnext", "transformer"])
    for name, reference in REFERENCE_MODELS.items():
        assert reference.name == name
        assert get_reference_model(name) is reference


def test_unknown_name_raises_value_error_listing_valid_names() -> None:
    with pytest.raises(ValueError) as error_info:
        get_reference_model("no_such_model")
    for name in MODEL_NAMES:
        assert name in str(error_info.value)


def test_build_returns_model_in_train_mode(reference: ReferenceModel) -> None:
    assert reference.build().training


def test_model_is_small(reference: ReferenceModel) -> None:
    num_parameters = sum(parameter.numel() for parameter in reference.build().parameters())
    assert num_parameters < 1_500_000


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_forward_shape_and_finite(reference: ReferenceModel, train: bool) -> None:
    model = reference.build().train(train)
    (inputs,) = reference.example_inputs(batch_size=SMALL_BATCH)
    with torch.no_grad():
        logits = model(inputs)
    assert logits.shape == (SMALL_BATCH, NUM_CLASSES)
    assert torch.isfinite(logits).all()


def test_eval_logits_have_meaningful_scale(reference: ReferenceModel) -> None:
    model = reference.build().eval()
    (inputs,) = reference.example_inputs(batch_size=SMALL_BATCH)
    with torch.no_grad():
        logits = model(inputs)
    assert logits.std().item() > 1e-3


@pytest.mark.parametrize("name", CONVOLUTIONAL_MODEL_NAMES)
@pytest.mark.parametrize("spatial_size", [32, 96])
def test_convolutional_models_accept_other_spatial_sizes(name: str, spatial_size: int) -> None:
    model = get_reference_model(name).build().eval()
    inputs = torch.randn(SMALL_BATCH, 3, spatial_size, spatial_size)
    with torch.no_grad():
        logits = model(inputs)
    assert logits.shape == (SMALL_BATCH, NUM_CLASSES)
    assert torch.isfinite(logits).all()


def test_build_is_deterministic(reference: ReferenceModel) -> None:
    first = reference.build(seed=3).state_dict()
    second = reference.build(seed=3).state_dict()
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)


def test_different_seeds_give_different_parameters(reference: ReferenceModel) -> None:
    first = reference.build(seed=0).state_dict()
    second = reference.build(seed=1).state_dict()
    assert any(not torch.equal(first[key], second[key]) for key in first)


def test_example_inputs_are_deterministic_with_default_shape(reference: ReferenceModel) -> None:
    (first,) = reference.example_inputs(seed=5)
    (second,) = reference.example_inputs(seed=5)
    (other_seed,) = reference.example_inputs(seed=6)
    assert first.shape == reference.input_shape
    assert torch.equal(first, second)
    assert not torch.equal(first, other_seed)
    (resized,) = reference.example_inputs(batch_size=3)
    assert resized.shape == (3, *reference.input_shape[1:])


def test_fx_trace_matches_eager(reference: ReferenceModel) -> None:
    model = reference.build().eval()
    traced = fx.symbolic_trace(model)
    (inputs,) = reference.example_inputs(batch_size=SMALL_BATCH)
    with torch.no_grad():
        torch.testing.assert_close(traced(inputs), model(inputs))


def test_export_with_dynamic_batch_matches_eager(reference: ReferenceModel) -> None:
    model = reference.build().eval()
    (inputs,) = reference.example_inputs(batch_size=SMALL_BATCH)
    exported = torch.export.export(
        model, (inputs,), dynamic_shapes=({0: torch.export.Dim.AUTO},)
    ).module()
    (other_batch_inputs,) = reference.example_inputs(batch_size=SMALL_BATCH + 1, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(exported(inputs), model(inputs))
        torch.testing.assert_close(exported(other_batch_inputs), model(other_batch_inputs))


@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2"])
def test_batchnorm_models_have_conv_bn_pairs_and_dropout(name: str) -> None:
    model = get_reference_model(name).build()
    assert _module_pairs(model, nn.Conv2d, nn.BatchNorm2d)
    assert _modules_of_type(model, nn.Dropout)


def test_resnet_has_biased_conv_before_batchnorm() -> None:
    model = get_reference_model("resnet").build()
    modules = dict(model.named_modules())
    conv_bn_pairs = _module_pairs(model, nn.Conv2d, nn.BatchNorm2d)
    biased_pairs = [node for node in conv_bn_pairs if modules[node.target].bias is not None]
    assert biased_pairs


def test_resnet_uses_relu_modules_functions_and_operator_add() -> None:
    model = get_reference_model("resnet").build()
    called = _called_functions(model)
    assert _modules_of_type(model, nn.ReLU)
    assert F.relu in called
    assert torch.relu in called
    assert operator.add in called


def test_mobilenet_has_depthwise_conv_and_hardswish() -> None:
    model = get_reference_model("mobilenet_v2").build()
    convs = _modules_of_type(model, nn.Conv2d)
    assert any(conv.groups > 1 and conv.groups == conv.in_channels for conv in convs)
    assert _modules_of_type(model, nn.Hardswish)


def test_convnext_has_depthwise_7x7_conv_layernorm_and_gelu() -> None:
    model = get_reference_model("convnext").build()
    depthwise_7x7 = [
        conv
        for conv in _modules_of_type(model, nn.Conv2d)
        if conv.kernel_size == (7, 7) and conv.groups == conv.in_channels == conv.out_channels
    ]
    assert depthwise_7x7
    assert _modules_of_type(model, nn.LayerNorm)
    assert F.layer_norm in _called_functions(model)
    assert _modules_of_type(model, nn.GELU)


def test_transformer_has_attention_layernorm_and_gelu() -> None:
    model = get_reference_model("transformer").build()
    assert F.scaled_dot_product_attention in _called_functions(model)
    assert _modules_of_type(model, nn.LayerNorm)
    assert _modules_of_type(model, nn.GELU)
    assert _modules_of_type(model, nn.Dropout)

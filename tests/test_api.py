"""graphopt.optimize end to end: the acceptance criteria of the core, on the reference models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.models import REFERENCE_MODELS
from graphopt.ops import batch_norm_view, dropout_view
from graphopt.pipeline import PRESETS, preset
from tests.test_capture import CountsCalls
from tests.conftest import FRONTENDS, assert_trains_like, model_state, ConvOutputReused, ShapeBranch, randomize_batch_norms, relative_error


def resnet(seed: int = 0) -> nn.Module:
    return randomize_batch_norms(REFERENCE_MODELS["resnet"].build(seed))


def resnet_inputs(batch: int = 2) -> tuple[torch.Tensor]:
    # 32x32 is the smallest input the ResNet takes: keeps the suite fast
    return (torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch)),)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_resnet_inference_acceptance(frontend: str) -> None:
    model = resnet().eval()
    inputs = resnet_inputs(2)
    before = model_state(model)

    optimized = graphopt.optimize(model, inputs, frontend=frontend)

    gm = optimized.graph_module
    assert not [n for n in gm.graph.nodes if batch_norm_view(gm, n) is not None]
    assert not [n for n in gm.graph.nodes if dropout_view(gm, n) is not None]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in optimized.modules())
    assert relative_error(model(*inputs), optimized(*inputs)) < 1e-5
    other = resnet_inputs(5)
    assert relative_error(model(*other), optimized(*other)) < 1e-5
    assert model_state(model) == before
    assert not model.training
    report = optimized.graphopt_report
    assert report.frontend == frontend and report.mode == "inference"
    assert len(report["fold_conv_bn"].rewrites) == 12


@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_every_reference_model_optimizes_and_matches(name: str) -> None:
    reference = REFERENCE_MODELS[name]
    model = reference.build().eval()
    inputs = reference.example_inputs(batch_size=2)
    optimized = graphopt.optimize(model, inputs)
    assert relative_error(model(*inputs), optimized(*inputs)) < 1e-5
    assert optimized.graphopt_report.frontend == "fx"


def test_mode_follows_the_model_when_not_given() -> None:
    inputs = resnet_inputs(2)
    assert graphopt.optimize(resnet().eval(), inputs).graphopt_report.mode == "inference"
    assert graphopt.optimize(resnet().train(), inputs).graphopt_report.mode == "training"


def test_explicit_inference_mode_on_a_training_model_uses_eval_semantics() -> None:
    model = resnet().train()
    inputs = resnet_inputs(2)
    optimized = graphopt.optimize(model, inputs, mode="inference")
    assert model.training, "the user's model keeps its mode"
    assert relative_error(copy.deepcopy(model).eval()(*inputs), optimized(*inputs)) < 1e-5


def test_inference_module_runs_without_autograd_and_refuses_training() -> None:
    optimized = graphopt.optimize(resnet().eval(), resnet_inputs(2))
    out = optimized(*resnet_inputs(2))
    assert torch.is_inference(out) and not out.requires_grad
    optimized.eval()  # allowed: already eval
    with pytest.raises(graphopt.ModeSwitchError, match="mode='training'"):
        optimized.train()


CASTS = {
    ".double()": lambda module: module.double(),
    ".half()": lambda module: module.half(),
    ".bfloat16()": lambda module: module.bfloat16(),
    ".to(torch.float64)": lambda module: module.to(torch.float64),
    ".to('cpu', torch.float16)": lambda module: module.to("cpu", torch.float16),
    ".type(torch.float64)": lambda module: module.type(torch.float64),
}
ADVICE = {".half()": "precision='fp16'", ".bfloat16()": "precision='bf16'", ".to('cpu', torch.float16)": "precision='fp16'"}


@pytest.mark.parametrize("cast", CASTS)
def test_a_dtype_cast_of_an_optimized_module_is_refused_and_leaves_it_working(cast: str) -> None:
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval(), torch.randn(3, 4)
    fast = graphopt.optimize(model, x)
    advice = ADVICE.get(cast, r"graphopt.optimize\(model.to\(torch.float64\), inputs in float64\)")
    with pytest.raises(graphopt.ModeSwitchError, match=rf"would cast this optimized module's float32 parameters and buffers to .*{advice}"):
        CASTS[cast](fast)
    assert {t.dtype for t in fast.parameters()} == {torch.float32}
    torch.testing.assert_close(fast(x), model(x))


def test_casts_that_change_no_dtype_and_device_moves_keep_working() -> None:
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).eval(), torch.randn(3, 4)
    fast = graphopt.optimize(model, x)
    for keep in (lambda m: m.to("cpu"), lambda m: m.to(torch.device("cpu")), lambda m: m.to(torch.float32), lambda m: m.float(), lambda m: m.cpu()):
        assert keep(fast) is fast
        torch.testing.assert_close(fast(x), model(x))
    wide = graphopt.optimize(copy.deepcopy(model).double(), x.double())  # a module optimized in float64: .float() would change it
    with pytest.raises(graphopt.ModeSwitchError, match=r".float\(\) would cast this optimized module's float64 parameters and buffers to float32"):
        wide.float()
    assert wide.double() is wide


def test_inference_outputs_can_be_training_targets_with_no_grad() -> None:
    teacher = graphopt.optimize(resnet().eval(), resnet_inputs(2))
    teacher.inference_mode = False
    target = teacher(*resnet_inputs(2))
    assert not torch.is_inference(target) and not target.requires_grad
    student = nn.Linear(10, 10)
    nn.functional.mse_loss(student(target), target).backward()  # an inference tensor would raise here
    assert student.weight.grad is not None


def test_inference_module_uses_no_grad_when_the_graph_updates_state() -> None:
    optimized = graphopt.optimize(CountsCalls().eval(), torch.randn(2, 3))
    assert optimized.graphopt_report.frontend == "export" and not optimized.inference_mode
    out = optimized(torch.randn(2, 3))
    assert not torch.is_inference(out) and not out.requires_grad
    assert not torch.is_inference(optimized.get_buffer("calls"))
    assert int(optimized.get_buffer("calls")) == 1


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_training_acceptance(frontend: str) -> None:
    model = resnet().train()
    inputs = resnet_inputs(4)
    optimized = graphopt.optimize(model, inputs, frontend=frontend)
    assert optimized.graphopt_report.mode == "training"
    assert optimized.training

    # drop_conv_bias is opt-in (exact under plain SGD only): the training preset keeps every parameter
    assert {name for name, _ in optimized.named_parameters()} == {name for name, _ in model.named_parameters()}
    assert set(optimized.state_dict()) == set(model.state_dict())

    assert_trains_like(model, optimized, inputs)


def test_training_module_trains_and_switches_to_eval_with_fx() -> None:
    model = resnet().train()
    inputs = resnet_inputs(4)
    labels = torch.tensor([0, 1, 2, 3])
    optimized = graphopt.optimize(model, inputs, frontend="fx")
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, optimized)]
    losses = []
    for step in range(5):
        step_losses = []
        for module, optimizer in zip((reference, optimized), optimizers):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss = nn.functional.cross_entropy(module(*inputs), labels)
            loss.backward()
            optimizer.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
    assert losses[-1][1] < losses[0][1], "the optimized model learns"
    assert abs(losses[-1][0] - losses[-1][1]) < 1e-3 * abs(losses[-1][0])
    reference.eval()
    optimized.eval()
    assert relative_error(reference(*inputs), optimized(*inputs)) < 1e-4


def test_export_captured_training_module_refuses_eval() -> None:
    optimized = graphopt.optimize(resnet().train(), resnet_inputs(2), frontend="export")
    with pytest.raises(graphopt.ModeSwitchError, match="torch.export"):
        optimized.eval()


def test_training_optimize_does_not_advance_the_models_statistics() -> None:
    model = resnet().train()
    before = model_state(model)
    graphopt.optimize(model, resnet_inputs(2))
    assert model_state(model) == before


def test_passes_and_disable_choose_what_runs() -> None:
    model, inputs = resnet().eval(), resnet_inputs(2)
    only = graphopt.optimize(model, inputs, passes=["fold_conv_bn"]).graphopt_report
    assert [p.name for p in only.passes] == ["fold_conv_bn"]
    without = graphopt.optimize(model, inputs, disable=["fold_conv_bn"]).graphopt_report
    assert [p.name for p in without.passes] == [name for name in PRESETS["inference"] if name != "fold_conv_bn"]
    preserved = graphopt.optimize(model, inputs, memory_format="preserve").graphopt_report
    assert [p.name for p in preserved.passes] == [name for name in preset("inference", measure=False) if name != "to_channels_last"]
    exact_in_inference = graphopt.optimize(model, inputs, passes=["drop_conv_bias"]).graphopt_report
    assert len(exact_in_inference["drop_conv_bias"].rewrites) == 5


def test_verify_false_skips_the_numeric_checks() -> None:
    report = graphopt.optimize(resnet().eval(), resnet_inputs(2), verify=False).graphopt_report
    assert not report.verified
    assert all(p.max_error is None for p in report.passes)
    assert "verify: off" in str(report)


def test_report_contents_and_renderings() -> None:
    report = graphopt.optimize(resnet().eval(), resnet_inputs(2)).graphopt_report
    fold = report["fold_conv_bn"]
    duration = fold.seconds  # recorded, never compared with a time
    assert fold.modified and isinstance(duration, float) and fold.max_error is not None and fold.max_error < 1e-5
    assert report.max_error == max(p.max_error for p in report.passes if p.max_error is not None)
    erased = [change.target for change in fold.erased]
    assert "layer1.bn1" in erased and "stem_bn" in erased and len(erased) == 12
    assert fold.created == []
    data = json.loads(report.to_json())
    assert data["frontend"] == "fx" and "fold_conv_bn" in [p["name"] for p in data["passes"]]
    text = str(report)
    assert "fold_conv_bn" in text and "remove_dropout" in text and "frontend: fx" in text
    assert "<table>" in report._repr_html_() and "fold_conv_bn" in report._repr_html_()
    assert report.why("layer1.bn1") and "folded" in report.why("layer1.conv1")[0]
    with pytest.raises(KeyError, match="ran: " + ", ".join(PRESETS["inference"])):
        report["drop_conv_bias"]


def test_report_explains_a_skip() -> None:
    report = graphopt.optimize(ConvOutputReused().eval(), torch.randn(2, 3, 6, 6)).graphopt_report
    assert report.why("bn")[0] == "fold_conv_bn: skipped bn: conv2d output has 2 users; a rewrite would change the others"
    assert "skipped bn: conv2d output has 2 users" in str(report)


def test_shape_dependent_model_is_optimized_through_export() -> None:
    model = randomize_batch_norms(ShapeBranch()).eval()
    optimized = graphopt.optimize(model, torch.randn(2, 3, 6, 6))
    report = optimized.graphopt_report
    assert report.frontend == "export" and "TraceError" in report.capture_attempts["fx"]
    assert "frontend: export (fx failed: TraceError" in str(report)
    assert len(report["fold_conv_bn"].rewrites) == 1
    other = torch.randn(3, 3, 6, 6)
    assert relative_error(model(other), optimized(other)) < 1e-5


def test_state_dict_keys_are_the_models_own() -> None:
    model = resnet().eval()
    optimized = graphopt.optimize(model, resnet_inputs(2))
    keys, original = set(optimized.state_dict()), set(model.state_dict())
    assert len(keys & original) > 10
    # folding gives bias-free convs a bias, named like nn.Conv2d's own
    assert all(key.endswith(".bias") and key.replace(".bias", ".weight") in original for key in keys - original)
    assert not any(key.startswith("graph_module") for key in keys)
    assert "graph_module" not in dict(optimized.named_children())


def test_concurrent_optimize_calls_on_different_models() -> None:
    import threading

    names = ["resnet", "mobilenet_v2", "convnext", "transformer"]
    models = {name: REFERENCE_MODELS[name].build().eval() for name in names}
    inputs = {name: REFERENCE_MODELS[name].example_inputs(batch_size=2) for name in names}
    results: dict[str, object] = {}

    def work(name: str) -> None:
        try:
            results[name] = graphopt.optimize(models[name], inputs[name], memory_format="preserve")
        except Exception as error:  # reported below, with the model's name
            results[name] = error

    threads = [threading.Thread(target=work, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in names:
        optimized = results[name]
        assert isinstance(optimized, graphopt.OptimizedModule), (name, optimized)
        assert relative_error(models[name](*inputs[name]), optimized(*inputs[name])) < 1e-5


def test_an_inference_result_of_either_frontend_is_optimized_again_for_inference() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    inputs = (torch.randn(2, 8),)
    for frontend in FRONTENDS:
        fast = graphopt.optimize(model, inputs, frontend=frontend, progress=False)
        again = graphopt.optimize(fast, inputs, progress=False)  # torch.export's graph module says training=True
        assert again.graphopt_report.mode == "inference"

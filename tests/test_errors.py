"""Bad input: every error is a GraphoptError subclass whose message says what to do."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphopt


def model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()


def inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, 6, 6),)


def test_not_a_module() -> None:
    with pytest.raises(graphopt.InvalidModelError, match="expected a torch.nn.Module.*got function"):
        graphopt.optimize(lambda x: x, inputs())
    assert issubclass(graphopt.InvalidModelError, TypeError)


@pytest.mark.parametrize("bad", [3, "tensor"])
def test_example_inputs_of_the_wrong_kind(bad) -> None:
    with pytest.raises(graphopt.InvalidInputsError, match="must be a tensor, a tuple of the positional arguments of forward.. or a dict"):
        graphopt.optimize(model(), bad)


def test_keyword_inputs_that_forward_does_not_take() -> None:
    with pytest.raises(graphopt.InvalidInputsError, match=r"\['x'\] do not fit Sequential.forward\(input\) \(no parameter named 'x'\)"):
        graphopt.optimize(model(), {"x": torch.randn(2, 3, 6, 6)})


def test_example_inputs_without_a_tensor() -> None:
    with pytest.raises(graphopt.InvalidInputsError, match="contain no tensor"):
        graphopt.optimize(model(), (1, 2))


def test_example_inputs_the_model_rejects() -> None:
    with pytest.raises(graphopt.InvalidInputsError) as info:
        graphopt.optimize(model(), (torch.randn(2, 5, 6, 6),))
    message = str(info.value)
    assert "Sequential raised RuntimeError" in message and "Tensor[2, 5, 6, 6] float32 cpu" in message
    assert "Pass example inputs that model(*example_inputs) accepts" in message


def test_wrong_dtype_is_named() -> None:
    with pytest.raises(graphopt.InvalidInputsError, match="inputs are torch.float64 but the parameters are torch.float32"):
        graphopt.optimize(model(), (torch.randn(2, 3, 6, 6, dtype=torch.float64),))


def test_inputs_on_another_device() -> None:
    with pytest.raises(graphopt.InvalidInputsError, match="parameters are on cpu but example inputs .* are on meta"):
        graphopt.optimize(model(), (torch.randn(2, 3, 6, 6, device="meta"),))


def test_model_that_raises_in_forward() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("no forward for you")

    with pytest.raises(graphopt.InvalidInputsError, match="Broken raised ValueError .*no forward for you"):
        graphopt.optimize(Broken(), inputs())


@pytest.mark.parametrize("option", ["passes", "disable"])
def test_unknown_pass_name_suggests_the_close_one(option: str) -> None:
    with pytest.raises(graphopt.UnknownPassError) as info:
        graphopt.optimize(model(), inputs(), **{option: ["fold_conv_nb"]})
    message = str(info.value)
    assert f"unknown pass 'fold_conv_nb' in {option}=" in message and "Did you mean 'fold_conv_bn'?" in message
    assert "graphopt.list_passes()" in message


def test_a_misspelt_option_suggests_the_close_one() -> None:
    with pytest.raises(graphopt.InvalidOptionError, match=r"optimize\(\) takes no option 'precison'; 'precison': did you mean 'precision'\?") as error:
        graphopt.optimize(model(), inputs(), precison="bf16")
    assert isinstance(error.value, TypeError)  # what Python raises for an unknown keyword: handlers of it keep working
    with pytest.raises(graphopt.InvalidOptionError, match=r"save\(\) takes no option 'overwrit'; 'overwrit': did you mean 'overwrite'\?"):
        graphopt.save(None, "model.pt2", overwrit=True)  # every public call, before anything runs


def test_graphopts_warnings_point_at_the_callers_line() -> None:
    """The option check and the lock are one wrapper: a warning's stacklevel lands on the line that called optimize."""

    class Talks(nn.Module):
        def forward(self, x):
            print("called")  # a side effect graphopt warns about
            return x * 2

    with pytest.warns(graphopt.SideEffectWarning) as caught:
        graphopt.optimize(Talks().eval(), (torch.randn(2, 3),))
    assert {Path(warning.filename).name for warning in caught} == {Path(__file__).name}


@pytest.mark.parametrize("options", [{"accuracy": 3e-2}, {"accuracy": 3e-2, "precision": "bf16"}])
def test_accuracy_without_tune_or_int8_is_refused_not_ignored(options) -> None:
    with pytest.raises(graphopt.InvalidOptionError, match=r"accuracy=0.03 applies with tune=True .* or precision='int8'"):
        graphopt.optimize(model(), inputs(), **options)


def test_pass_names_must_be_a_list() -> None:
    with pytest.raises(graphopt.UnknownPassError, match="take a list of pass names"):
        graphopt.optimize(model(), inputs(), passes="fold_conv_bn")


def test_unknown_frontend() -> None:
    with pytest.raises(graphopt.InvalidOptionError, match="unknown frontend 'jit': use one of 'auto', 'fx', 'export'"):
        graphopt.optimize(model(), inputs(), frontend="jit")
    with pytest.raises(graphopt.InvalidOptionError, match="unknown frontend"):
        graphopt.capture(model(), inputs(), frontend="jit")


def test_unknown_mode() -> None:
    with pytest.raises(graphopt.InvalidOptionError, match="unknown mode 'eval'.*'inference', 'training'"):
        graphopt.optimize(model(), inputs(), mode="eval")


def test_pass_in_the_wrong_mode() -> None:
    with pytest.raises(graphopt.PassModeError) as info:
        graphopt.optimize(model(), inputs(), mode="training", passes=["fold_conv_bn"])
    message = str(info.value)
    assert "'fold_conv_bn' applies to inference mode, not training" in message
    assert "mode='inference'" in message


def test_model_that_cannot_be_copied() -> None:
    class Locked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    with pytest.raises(graphopt.InvalidModelError, match="could not copy Locked.*deep-copyable"):
        graphopt.optimize(Locked(), torch.randn(2, 2))


def test_every_error_is_a_graphopt_error() -> None:
    for name in graphopt.__all__:
        value = getattr(graphopt, name)
        if isinstance(value, type) and issubclass(value, Warning):
            assert issubclass(value, UserWarning), name  # shown by default, filterable by class
        elif isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, graphopt.GraphoptError), name


def test_disable_must_be_a_list_too() -> None:
    with pytest.raises(graphopt.UnknownPassError, match="take a list of pass names"):
        graphopt.optimize(model(), inputs(), disable="fold_conv_bn")


def test_outputs_without_finite_values_cannot_be_verified() -> None:
    class Divides(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / 0

    with pytest.raises(graphopt.InvalidInputsError, match="holds NaN or no finite value.*finite numbers"):
        graphopt.optimize(Divides(), torch.randn(2, 3))


def test_data_parallel_is_unwrapped_with_advice() -> None:
    inner = nn.Sequential(nn.Linear(3, 3), nn.ReLU()).eval()
    with pytest.warns(UserWarning, match="DistributedDataParallel.*torchrun"):
        optimized = graphopt.optimize(nn.DataParallel(inner), torch.randn(2, 3))
    x = torch.randn(4, 3)
    torch.testing.assert_close(optimized(x), inner(x))
    assert set(optimized.state_dict()) == set(inner.state_dict())


def test_optimizing_an_optimized_module_again() -> None:
    original = model()
    x = torch.randn(2, 3, 6, 6)
    once = graphopt.optimize(original, x, memory_format="preserve")
    twice = graphopt.optimize(once, x, memory_format="channels_last")
    torch.testing.assert_close(twice(x), original(x), rtol=1e-4, atol=1e-5)
    assert twice.graphopt_report["fold_conv_bn"].rewrites == [], "already folded"
    with pytest.raises(graphopt.ModeSwitchError, match="cannot be optimized for training"):
        graphopt.optimize(once, x, mode="training")


def test_a_model_without_parameters_is_fine() -> None:
    model = nn.Sequential(nn.ReLU(), nn.MaxPool2d(2))
    x = torch.randn(2, 3, 6, 6)
    optimized = graphopt.optimize(model, x)
    torch.testing.assert_close(optimized(x), model(x))
    assert all(not p.rewrites for p in optimized.graphopt_report.passes)

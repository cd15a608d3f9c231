"""Training with the optimized module: the same losses, weights and statistics as the original, step by step."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.checkpoint import to_optimized
from graphopt.models import REFERENCE_MODELS
from graphopt.pipeline import preset_with
from graphopt.verify import tolerance_for
from tests.conftest import randomize_batch_norms, relative_error
from tests.ddp_training_worker import MODELS, STEPS as DDP_STEPS, WORLD_SIZE

CNNS = ("resnet", "mobilenet_v2", "convnext")
REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def batches(steps: int = STEPS, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches in turn: statistics see different data, and the loss on each falls as the model fits them."""
    generator = torch.Generator().manual_seed(7)
    pair = [(torch.randn(size, 3, 32, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator)) for _ in range(2)]
    return [pair[step % 2] for step in range(steps)]


def train(module: nn.Module, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[float]:
    """SGD with momentum over `batches`; the same dropout masks for every module (seeded per step)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for step, (images, labels) in enumerate(batches()):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss = F.cross_entropy(forward(module, images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def eager(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
    return module(images)


def autocast_bf16_channels_last(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The playbook by hand: channels_last inputs (the module converted too) under bf16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return module(images.contiguous(memory_format=torch.channels_last)).float()


def assert_same_state(optimized: graphopt.OptimizedModule, reference: nn.Module, tolerance: float) -> None:
    """Every parameter and BatchNorm statistic, the reference's mapped into the optimized module's form."""
    expected_state = to_optimized(reference.state_dict(), optimized.state_changes)
    for key, value in optimized.state_dict().items():
        expected = expected_state[key]
        if value.is_floating_point():
            assert relative_error(expected, value) < tolerance, key
        else:
            assert torch.equal(value, expected), key  # num_batches_tracked counts the same steps


@pytest.mark.parametrize("name", CNNS)
def test_sgd_steps_match_the_original_in_float64(name: str) -> None:
    """The training preset (channels_last) with the opt-in drop_conv_bias gives the original's losses, weights and
    statistics under SGD without weight decay (where dropping the bias is exact).

    In float64: in float32 the two layouts round differently, and a ReLU input nearer 0
    than that rounding falls on either side, which changes whole channels' gradients after
    a BatchNorm by percents (tests/ddp_training_worker.py has figures); over several
    steps the trajectories part, by how much depending on the CPU's kernels. Float64's
    rounding is 2^29 times finer, so any difference here is the rewrite's.
    """
    model = randomize_batch_norms(REFERENCE_MODELS[name].build()).train().double()
    passes = preset_with("training", ["drop_conv_bias"], low_precision=False, channels_last=True)
    optimized = graphopt.optimize(model, (batches()[0][0].double(),), frontend="fx", memory_format="channels_last", passes=passes)
    assert optimized.graphopt_report["to_channels_last"].rewrites
    reference = copy.deepcopy(model)

    def in_float64(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
        return module(images.double())

    expected_losses, losses = train(reference, in_float64), train(optimized, in_float64)
    assert losses[-2] < losses[0] and losses[-1] < losses[1], f"the optimized model learns: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-10, atol=0)
    assert_same_state(optimized, reference, 1e-10)

    reference.eval()
    optimized.eval()
    images = batches()[0][0].double()
    assert relative_error(reference(images), optimized(images)) < 1e-10


@pytest.mark.parametrize("name", CNNS)
def test_bf16_sgd_steps_match_autocast(name: str) -> None:
    """graphopt's bf16 casts train like torch.autocast on the same layout, within bf16's tolerance.

    The preset, without the opt-in drop_conv_bias: see the next test.
    """
    model = REFERENCE_MODELS[name].build().train()
    optimized = graphopt.optimize(model, (batches()[0][0],), frontend="fx", memory_format="channels_last", precision="bf16")
    reference = copy.deepcopy(model).to(memory_format=torch.channels_last)

    expected_losses, losses = train(reference, autocast_bf16_channels_last), train(optimized, eager)
    assert losses[-2] < losses[0] and losses[-1] < losses[1], f"the optimized model learns: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-2, atol=0)
    assert all(p.dtype == torch.float32 for p in optimized.parameters()), "fp32 weights, gradients and optimizer state"
    assert_same_state(optimized, reference, tolerance_for(torch.bfloat16))


def test_bf16_training_preset_computes_autocast_losses_at_each_step() -> None:
    """With drop_conv_bias opted in, each step's loss is autocast's at the same weights.

    bf16 rounds the conv output without its bias (autocast rounds conv + bias), so the
    gradients differ by bf16 rounding (as close to fp32 as autocast's: see
    test_use_low_precision) and the trajectories part after a few steps, by how much
    depending on the CPU's bf16 kernels. So the reference is synchronised: before each
    step it takes the optimized module's weights (``original_state_dict``).
    """
    model = REFERENCE_MODELS["resnet"].build().train()
    passes = preset_with("training", ["drop_conv_bias"], low_precision=True, channels_last=True)
    optimized = graphopt.optimize(model, (batches()[0][0],), frontend="fx", memory_format="channels_last", precision="bf16", passes=passes)
    assert len(optimized.graphopt_report["drop_conv_bias"].rewrites) == 5
    reference = copy.deepcopy(model).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(optimized.parameters(), lr=0.02, momentum=0.9)
    losses, expected_losses = [], []
    for step, (images, labels) in enumerate(batches()):
        reference.load_state_dict(optimized.original_state_dict())
        torch.manual_seed(step)
        with torch.no_grad():
            expected_losses.append(F.cross_entropy(autocast_bf16_channels_last(reference, images), labels).item())
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss = F.cross_entropy(optimized(images), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-2] < losses[0] and losses[-1] < losses[1], f"the optimized model learns: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-2, atol=0)


class FunctionalDropout(nn.Module):
    """Dropout by ``F.dropout(..., training=self.training)``: the flag is read by forward(), not by a module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.5, training=self.training)


class AuxiliaryHead(nn.Module):
    """torchvision GoogLeNet/Inception's ``(out, aux) if self.training else out``, behind a block that reads its flag."""

    def __init__(self) -> None:
        super().__init__()
        self.block = FunctionalDropout()
        self.head, self.aux = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Any:
        hidden = self.block(x)
        return (self.head(hidden), self.aux(hidden)) if self.training else self.head(hidden)


class ModuleDropout(nn.Module):
    """Reads no flag itself: nn.Dropout and nn.BatchNorm1d read theirs at run time; the stochastic depth reads
    ``self.training`` only where its rate is 0, which gives the same graph in both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.dropout = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)
        self.rate = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.bn(self.fc(x)))
        if not self.training or self.rate == 0.0:
            return x
        return x * torch.rand_like(x).ge(self.rate)


def _seeded(module: nn.Module, x: torch.Tensor) -> Any:
    torch.manual_seed(0)
    return module(x)


def _assert_same(expected: Any, actual: Any) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("switch", ["eval", "train(False)"])
@pytest.mark.parametrize(("model_class", "readers"), [(FunctionalDropout, "the model itself"), (AuxiliaryHead, "'block', the model itself")])
def test_a_forward_that_reads_self_training_refuses_eval_and_keeps_training(model_class: type[nn.Module], readers: str, switch: str) -> None:
    """symbolic_trace fixes forward()'s reads of ``self.training``: switching the whole module to eval is refused
    (it would keep dropout active, or return the training tuple), saying which modules read it; nothing changed."""
    model = model_class().train()
    x = torch.randn(4, 8)
    fast = graphopt.optimize(model, x, mode="training")
    assert fast.graphopt_report.frontend == "fx"
    with pytest.raises(graphopt.ModeSwitchError, match=rf"\(self\.training\) of {readers}, e\.g\. F\.dropout"):
        fast.eval() if switch == "eval" else fast.train(False)
    assert all(module.training for module in fast.modules())
    _assert_same(_seeded(model, x), _seeded(fast, x))
    with pytest.raises(graphopt.ModeSwitchError, match="cannot switch to eval mode"):
        graphopt.optimize(fast, x, mode="inference")
    again = graphopt.optimize(fast, x)  # its graph reads no flag: the flags fixed by the first capture stay fixed
    with pytest.raises(graphopt.ModeSwitchError, match=readers):
        again.eval()


def test_a_submodule_switched_to_eval_is_refused_at_the_call_and_train_restores_it() -> None:
    """``fast.block.eval()`` does not go through the optimized module: the next call refuses to run the graph,
    which would keep the block's dropout active; ``fast.block.train()`` makes the calls train as before."""
    model = AuxiliaryHead().train()
    x = torch.randn(4, 8)
    fast = graphopt.optimize(model, x, mode="training")
    fast.block.eval()
    with pytest.raises(graphopt.ModeSwitchError, match="'block' switched to eval mode.*Switch it back"):
        fast(x)
    fast.block.train()
    _assert_same(_seeded(model, x), _seeded(fast, x))


def test_an_inference_module_whose_forward_reads_self_training_computes_eval() -> None:
    """Traced in eval mode, the graph's flags say eval (fx creates the block's container in train mode): calls run."""
    model = AuxiliaryHead().eval()
    x, second = torch.randn(4, 8), torch.randn(6, 8)
    fast = graphopt.optimize(model, x)
    assert not fast.block.training
    _assert_same(model(second), fast(second))


def test_a_forward_that_reads_no_mode_switches_freely() -> None:
    """Dropout and BatchNorm as modules follow .eval()/.train() of the whole module or of one submodule."""
    model = ModuleDropout().train()
    x, second = torch.randn(4, 8), torch.randn(6, 8)
    fast = graphopt.optimize(model, x, mode="training")
    reference = copy.deepcopy(model)
    _assert_same(_seeded(reference, x), _seeded(fast, x))
    fast.eval()
    reference.eval()
    _assert_same(reference(second), fast(second))
    fast.train()
    reference.train()
    _assert_same(_seeded(reference, second), _seeded(fast, second))
    fast.dropout.eval()
    reference.dropout.eval()
    _assert_same(_seeded(reference, second), _seeded(fast, second))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_ddp_gradients_match_one_process_on_the_full_batch(tmp_path: Path) -> None:
    """Two gloo ranks train the optimized (channels_last, bias-dropped) model with DDP, no stride warnings."""
    output, port = tmp_path / "gradients.pt", _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    worker = [sys.executable, "-m", "tests.ddp_training_worker"]
    ranks = [
        subprocess.Popen([*worker, str(rank), str(port), str(output)], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
        for rank in range(WORLD_SIZE)
    ]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], errors
    assert "do not match bucket view strides" not in "".join(errors)

    # the reference is the same optimized module trained alone in rank 0's process (why not
    # the original model: see tests/ddp_training_worker.py); it matches the original elsewhere
    saved = torch.load(output)
    dropped = {"resnet": {"stem_conv.bias", "layer1.conv1.bias", "layer2.conv1.bias", "layer3.conv1.bias", "layer4.conv1.bias"}, "convnext": set()}
    for name in MODELS:
        original_keys = {key for key, _ in REFERENCE_MODELS[name].build(seed=0).named_parameters()}
        assert len(saved["ddp"][name]) == len(saved["one_process"][name]) == DDP_STEPS
        for step, (expected, actual) in enumerate(zip(saved["one_process"][name], saved["ddp"][name], strict=True)):
            assert set(expected) == set(actual) and original_keys - set(actual) == dropped[name]
            for key, gradient in actual.items():
                assert gradient.stride() == expected[key].stride(), f"{name} step {step}: {key}"
                torch.testing.assert_close(gradient, expected[key], rtol=1e-3, atol=1e-6, msg=f"{name} step {step}: {key}")

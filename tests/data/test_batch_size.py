"""graphopt.data.batch_size: the largest batch that fits.

On CPU the memory estimate is computed from tensor sizes and so is exact; the CUDA
search is checked on a predicate instead of a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from graphopt.data import max_batch_size
from graphopt.data.batch_size import _largest_fitting, _too_big
from graphopt.errors import GraphoptError, InvalidInputsError, InvalidModelError, InvalidOptionError

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour without CUDA")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# Per sample, the MLP's estimate counts the input (16 floats), Linear (32), ReLU (32) and
# Linear (4): 84 floats = 336 bytes. Training adds the gradients of its 676 parameters.
MLP_SAMPLE_BYTES = (16 + 32 + 32 + 4) * 4
MLP_GRAD_BYTES = (16 * 32 + 32 + 32 * 4 + 4) * 4


def test_mlp_inference_estimate_is_exact() -> None:
    budget = MLP_SAMPLE_BYTES * 43  # room for 43 samples: the largest multiple of 8 is 40
    assert max_batch_size(mlp(), torch.randn(3, 16), memory_budget_bytes=budget) == 40
    assert max_batch_size(mlp(), torch.randn(3, 16), memory_budget_bytes=budget, multiple=1) == 43


def test_mlp_training_estimate_adds_gradients() -> None:
    budget = MLP_GRAD_BYTES + MLP_SAMPLE_BYTES * 31
    assert max_batch_size(mlp(), torch.randn(1, 16), mode="training", memory_budget_bytes=budget) == 24
    assert max_batch_size(mlp(), torch.randn(1, 16), mode="inference", memory_budget_bytes=budget) == 32


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_conv_net_results_are_multiples_within_limit_and_grow_with_budget(mode: str) -> None:
    model, example = SmallConvNet(), torch.randn(2, 3, 16, 16)
    results = [
        max_batch_size(model, example, mode=mode, memory_budget_bytes=budget, limit=1000)
        for budget in (2**18, 2**19, 2**20, 2**22, 2**24, 2**30)
    ]
    assert all(result % 8 == 0 and 8 <= result <= 1000 for result in results)
    assert results == sorted(results)
    assert results[-1] == 1000 // 8 * 8
    assert results[0] < results[-1]


def test_limit_caps_the_result_at_a_multiple() -> None:
    assert max_batch_size(mlp(), torch.randn(2, 16), limit=100, memory_budget_bytes=2**30) == 96
    assert max_batch_size(mlp(), torch.randn(2, 16), limit=100, multiple=1, memory_budget_bytes=2**30) == 100
    assert max_batch_size(mlp(), torch.randn(2, 16), limit=4096) == 4096  # default budget: half of the free RAM


def state(model: nn.Module) -> tuple[dict, dict, dict, dict]:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        {n: m.training for n, m in model.named_modules()},
        {n: p.requires_grad for n, p in model.named_parameters()},
    )


def assert_same_state(before: tuple, after: tuple) -> None:
    tensors_before, grads_before, modes_before, requires_before = before
    tensors_after, grads_after, modes_after, requires_after = after
    assert tensors_before.keys() == tensors_after.keys()
    for name in tensors_before:
        assert torch.equal(tensors_before[name], tensors_after[name]), name
    assert grads_before.keys() == grads_after.keys()
    for name, grad in grads_before.items():
        assert (grad is None) == (grads_after[name] is None), name
        assert grad is None or torch.equal(grad, grads_after[name]), name
    assert modes_before == modes_after
    assert requires_before == requires_after


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_model_grads_mode_buffers_and_rng_are_left_alone(mode: str) -> None:
    model, example = SmallConvNet(), torch.randn(2, 3, 8, 8)
    model(example).sum().backward()  # some gradients exist, the BatchNorm has moved its statistics
    model.head[3].bias.grad = None  # ... and one parameter has none
    model.features.eval()  # mixed modes
    before = state(model)
    rng = torch.get_rng_state()
    assert max_batch_size(model, example, mode=mode, memory_budget_bytes=2**22) % 8 == 0
    assert_same_state(before, state(model))
    assert torch.equal(rng, torch.get_rng_state())
    model.eval()
    before = state(model)
    max_batch_size(model, example, mode=mode, memory_budget_bytes=2**22)
    assert_same_state(before, state(model))


def test_training_estimate_of_a_copy_matches_the_model() -> None:
    model = SmallConvNet()
    clone = copy.deepcopy(model)
    example = torch.randn(1, 3, 8, 8)
    kwargs = {"mode": "training", "memory_budget_bytes": 2**20}
    assert max_batch_size(model, example, **kwargs) == max_batch_size(clone, example, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((lambda x: x, torch.randn(1, 16)), {}, InvalidModelError, r"needs a torch.nn.Module, got function"),
        ((nn.Linear(16, 4), [1.0] * 16), {}, InvalidInputsError, r"example_input must be one batch as a tensor, got list"),
        ((nn.Linear(16, 4), torch.tensor(1.0)), {}, InvalidInputsError, r"needs a batch dimension first"),
        ((nn.Linear(16, 4), torch.randn(0, 16)), {}, InvalidInputsError, r"needs a batch dimension first"),
        ((nn.Linear(16, 4), torch.randn(1, 16)), {"multiple": 0}, InvalidOptionError, r"multiple must be an integer >= 1, got 0"),
        ((nn.Linear(16, 4), torch.randn(1, 16)), {"limit": 4}, InvalidOptionError, r"limit=4 is below multiple=8"),
        ((nn.Linear(16, 4), torch.randn(1, 16)), {"mode": "train"}, InvalidOptionError, r"mode must be 'inference' or 'training'"),
        ((nn.Linear(16, 4), torch.randn(1, 16)), {"memory_budget_bytes": 0}, InvalidOptionError, r"memory_budget_bytes must be a positive"),
        ((nn.Linear(16, 4), torch.randn(1, 16)), {"memory_budget_bytes": 1.5e9}, InvalidOptionError, r"memory_budget_bytes must be a positive"),
        ((nn.Linear(16, 4), torch.randn(1, 16)), {"device": "nonsense"}, InvalidOptionError, r"is not a torch device"),
        ((nn.Linear(16, 4), torch.randn(1, 5)), {}, InvalidInputsError, r"repeated to a batch of 8\) failed with RuntimeError"),
    ],
)
def test_max_batch_size_rejects_bad_input(args: tuple, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as raised:
        max_batch_size(*args, **kwargs)
    assert isinstance(raised.value, GraphoptError)


def test_budget_below_the_smallest_batch_says_what_to_do() -> None:
    with pytest.raises(InvalidInputsError, match=r"a batch of 8 is estimated at .* over the budget .* no batch size fits; lower multiple"):
        max_batch_size(mlp(), torch.randn(1, 16), memory_budget_bytes=MLP_SAMPLE_BYTES * 7)


def test_training_needs_something_to_backpropagate() -> None:
    frozen = mlp().requires_grad_(False)
    with pytest.raises(InvalidInputsError, match=r"no output of the model requires grad"):
        max_batch_size(frozen, torch.randn(1, 16), mode="training", memory_budget_bytes=2**20)
    assert max_batch_size(frozen, torch.randn(1, 16), memory_budget_bytes=MLP_SAMPLE_BYTES * 8) == 8


@needs_no_cuda
def test_max_batch_size_cuda_without_cuda() -> None:
    with pytest.raises(InvalidOptionError, match=r"CUDA is not available: use device='cpu'"):
        max_batch_size(mlp(), torch.randn(1, 16), device="cuda")


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 37, 64, 99, 100, 500])
def test_search_finds_the_largest_fitting_multiple(threshold: int) -> None:
    """The doubling-then-bisection search the CUDA path uses, on a predicate instead of a GPU."""
    tried: list[int] = []

    def fits(k: int) -> bool:
        tried.append(k)
        return k <= threshold

    assert _largest_fitting(fits, 100, on_none=lambda: pytest.fail("1 fits")) == min(threshold, 100)
    assert all(1 <= k <= 100 for k in tried) and len(tried) <= 2 * 7 + 1


def test_search_reports_when_nothing_fits() -> None:
    with pytest.raises(InvalidInputsError, match=r"runs out of memory"):
        _largest_fitting(lambda k: False, 10, on_none=lambda: _too_big("a batch of 8 runs out of memory", 8))

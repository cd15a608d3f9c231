"""graphopt.data: DataLoader tuning and the largest batch that fits.

Times are never asserted on (they are noise on a shared machine): only structure, the
rules that pick ``best`` from the table, warnings, messages and the CPU memory estimate,
which is computed from tensor sizes and so is exact.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from graphopt import data
from graphopt.data import Candidate, LoaderTuning, max_batch_size, tune_loader
from graphopt.errors import GraphoptError, InvalidInputsError, InvalidModelError, InvalidOptionError

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour without CUDA")


class Ranges(Dataset):
    """``n`` samples: (arange(4) + 4 * i as float, i)."""

    def __init__(self, n: int = 256) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.arange(4, dtype=torch.float32) + 4 * i, i


class Stream(IterableDataset):
    """``n`` samples of arange(3) + i, with no __len__."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.arange(3) + i


class Broken(Ranges):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        raise KeyError(f"sample {i} is missing")


def samples(loader: DataLoader) -> list[tuple[list[float], int]]:
    return [(x.tolist(), int(i)) for xs, indices in loader for x, i in zip(xs, indices)]


# ------------------------------------------------------------------ tune_loader


@pytest.fixture(scope="module")
def tuned() -> tuple[Ranges, LoaderTuning]:
    """The one tuning run with a worker: 0 workers, then 1 worker with each default prefetch_factor."""
    dataset = Ranges(256)
    return dataset, tune_loader(dataset, 16, num_workers=(0, 1), pin_memory=False, batches=3, progress=False)


def test_one_row_per_candidate_with_its_kwargs(tuned: tuple[Ranges, LoaderTuning]) -> None:
    _, tuning = tuned
    assert [row.kwargs for row in tuning.table] == [
        {"batch_size": 16, "num_workers": 0, "pin_memory": False},
        {"batch_size": 16, "num_workers": 1, "pin_memory": False, "prefetch_factor": 2, "persistent_workers": True},
        {"batch_size": 16, "num_workers": 1, "pin_memory": False, "prefetch_factor": 4, "persistent_workers": True},
    ]
    for row in tuning.table:
        assert row.batches == 3 and row.samples == 48
        recorded = (row.samples_per_s, row.seconds, row.first_batch_s)  # filled in, never compared with a time
        assert all(isinstance(value, float) for value in recorded)
        assert row.rss_growth_mb is None or row.rss_growth_mb >= 0
    assert tuning.warnings == []
    assert tuning.batches == 3


def test_best_is_the_fastest_row(tuned: tuple[Ranges, LoaderTuning]) -> None:
    _, tuning = tuned
    assert tuning.best in [row.kwargs for row in tuning.table]
    fastest = max(row.samples_per_s for row in tuning.table)
    assert next(row for row in tuning.table if row.kwargs == tuning.best).samples_per_s == fastest
    assert tuning.best is not tuning.ranked()[0].kwargs  # a copy: editing it leaves the table alone


def test_best_loader_yields_the_same_samples_in_order(tuned: tuple[Ranges, LoaderTuning]) -> None:
    dataset, tuning = tuned
    expected = samples(DataLoader(dataset, batch_size=16))
    assert len(expected) == 256
    assert samples(DataLoader(dataset, **tuning.best)) == expected


def test_str_lists_rows_fastest_first_with_rule_of_thumb(tuned: tuple[Ranges, LoaderTuning]) -> None:
    _, tuning = tuned
    text = str(tuning)
    assert "4 x the number of GPUs" in text
    assert "best: DataLoader(dataset, batch_size=16" in text
    body = text.splitlines()[2:5]
    speeds = [row.samples_per_s for row in tuning.ranked()]
    assert speeds == sorted(speeds, reverse=True)
    assert [line.split()[0] for line in body] == [str(row.kwargs["num_workers"]) for row in tuning.ranked()]


def test_str_of_a_synthetic_table_orders_by_speed_and_shows_warnings() -> None:
    slow = Candidate({"batch_size": 8, "num_workers": 0, "pin_memory": False}, 100.0, 0.5, 1.0, 3, 24, 0.1)
    fast = Candidate(
        {"batch_size": 8, "num_workers": 2, "pin_memory": False, "prefetch_factor": 4, "persistent_workers": True},
        900.0, 0.1, None, 3, 24, 0.3,
    )
    tuning = LoaderTuning(best=dict(fast.kwargs), table=[slow, fast], warnings=["look out"], batches=3)
    lines = str(tuning).splitlines()
    assert lines[2].split()[:4] == ["2", "False", "4", "True"] and "n/a" in lines[2]
    assert lines[3].split()[:4] == ["0", "False", "-", "-"] and "+1.0 MB" in lines[3]
    assert lines[-2:] == ["warnings:", "  - look out"]
    assert tuning.ranked() == [fast, slow]


def test_progress_is_one_line_per_candidate_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    tune_loader(Ranges(64), 8, num_workers=0, pin_memory=(False,), batches=2, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert re.match(r"\[tune_loader 1/1\] batch_size=8, num_workers=0, pin_memory=False: [\d,]+ samples/s", lines[0])
    tune_loader(Ranges(64), 8, num_workers=0, pin_memory=False, batches=2, progress=False)
    assert capsys.readouterr().err == ""


def test_too_small_dataset_measures_what_exists_and_says_so() -> None:
    tuning = tune_loader(Ranges(40), 16, num_workers=0, pin_memory=False, batches=5, progress=False)
    (row,) = tuning.table
    assert row.batches == 2 and row.samples == 24  # 16 + 8 after the warm-up batch of 16
    assert len(tuning.warnings) == 1
    assert "of 40 samples yields only 3 batch(es) of batch_size=16" in tuning.warnings[0]
    assert "measured the 2 batch(es) after the warm-up batch instead of batches=5" in tuning.warnings[0]


def test_a_single_batch_is_measured_with_start_up() -> None:
    tuning = tune_loader(Ranges(10), 16, num_workers=0, pin_memory=False, batches=3, progress=False)
    (row,) = tuning.table
    assert row.batches == 0 and row.samples == 10 and row.samples_per_s > 0
    assert "yields only 1 batch(es)" in tuning.warnings[0] and "single batch" in tuning.warnings[0]


def test_iterable_dataset_counts_samples_and_warns_when_short() -> None:
    tuning = tune_loader(Stream(20), 4, num_workers=(0,), pin_memory=False, batches=10, progress=False)
    (row,) = tuning.table
    assert row.kwargs == {"batch_size": 4, "num_workers": 0, "pin_memory": False}
    assert row.batches == 4 and row.samples == 16
    assert "the dataset yields only 5 batch(es) of batch_size=4" in tuning.warnings[0]


def test_iterable_dataset_with_workers_warns_about_duplicates() -> None:
    dataset = Stream(64)
    tuning = tune_loader(dataset, 8, num_workers=1, pin_memory=False, prefetch_factor=2, batches=2, progress=False)
    assert [row.kwargs["num_workers"] for row in tuning.table] == [1]
    assert any("get_worker_info()" in warning for warning in tuning.warnings)
    assert [batch.tolist() for batch in DataLoader(dataset, **tuning.best)] == [
        batch.tolist() for batch in DataLoader(dataset, batch_size=8)
    ]


def test_loader_kwargs_go_to_every_candidate_and_into_best() -> None:
    tuning = tune_loader(Ranges(64), 8, num_workers=0, pin_memory=False, batches=2, progress=False,
                         loader_kwargs={"drop_last": True})
    assert tuning.best == {"batch_size": 8, "num_workers": 0, "pin_memory": False, "drop_last": True}


@needs_no_cuda
def test_pin_memory_true_is_skipped_without_an_accelerator() -> None:
    if data._has_accelerator():
        pytest.skip("an accelerator is available")
    tuning = tune_loader(Ranges(64), 8, num_workers=0, pin_memory=(False, True), batches=2, progress=False)
    assert [row.kwargs["pin_memory"] for row in tuning.table] == [False]
    assert any("pin_memory=True was not tried" in warning for warning in tuning.warnings)


@pytest.mark.parametrize("cpus, expected", [(1, (0, 1)), (2, (0, 1, 2)), (6, (0, 1, 2, 4, 6)), (8, (0, 1, 2, 4, 8))])
def test_default_worker_counts_double_up_to_the_cpu_count(monkeypatch: pytest.MonkeyPatch, cpus: int, expected: tuple[int, ...]) -> None:
    monkeypatch.setattr(data.os, "cpu_count", lambda: cpus)
    assert data._default_workers() == expected


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"batch_size": 0}, InvalidOptionError, r"batch_size must be an integer >= 1, got 0"),
        ({"batch_size": True}, InvalidOptionError, r"batch_size must be an integer >= 1, got True"),
        ({"batch_size": 8, "batches": 0}, InvalidOptionError, r"batches must be an integer >= 1, got 0"),
        ({"batch_size": 8, "num_workers": -1}, InvalidOptionError, r"num_workers must be an integer >= 0"),
        ({"batch_size": 8, "num_workers": (0, -2)}, InvalidOptionError, r"num_workers must be an integer >= 0"),
        ({"batch_size": 8, "num_workers": ()}, InvalidOptionError, r"non-empty sequence"),
        ({"batch_size": 8, "num_workers": "2"}, InvalidOptionError, r"num_workers must be"),
        ({"batch_size": 8, "pin_memory": "yes"}, InvalidOptionError, r"pin_memory must be True, False"),
        ({"batch_size": 8, "prefetch_factor": 0}, InvalidOptionError, r"prefetch_factor must be an integer >= 1"),
        ({"batch_size": 8, "persistent_workers": 1}, InvalidOptionError, r"persistent_workers must be True, False"),
        ({"batch_size": 8, "device": "nonsense"}, InvalidOptionError, r"is not a torch device"),
        ({"batch_size": 8, "loader_kwargs": {"num_workers": 2}}, InvalidOptionError, r"tune_loader chooses itself"),
    ],
)
def test_tune_loader_rejects_bad_options(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as raised:
        tune_loader(Ranges(32), progress=False, **kwargs)
    assert isinstance(raised.value, GraphoptError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize("dataset", [object(), iter(range(10)), 42])
def test_tune_loader_rejects_what_is_not_a_dataset(dataset: object) -> None:
    with pytest.raises(InvalidInputsError, match=r"map-style \(define __len__ and __getitem__\) or a torch.utils.data.IterableDataset"):
        tune_loader(dataset, 8, progress=False)


def test_tune_loader_rejects_empty_and_failing_datasets() -> None:
    with pytest.raises(InvalidInputsError, match=r"the dataset is empty"):
        tune_loader(Ranges(0), 8, progress=False)
    with pytest.raises(InvalidInputsError, match=r"yields no batch at all"):
        tune_loader(Stream(0), 8, num_workers=0, pin_memory=False, progress=False)
    with pytest.raises(InvalidInputsError, match=r"num_workers=0.* failed with KeyError: .sample 0 is missing"):
        tune_loader(Broken(32), 8, num_workers=0, pin_memory=False, progress=False)


def test_tune_loader_wraps_settings_the_dataloader_rejects() -> None:
    with pytest.raises(InvalidOptionError, match=r"DataLoader rejects these settings .*shuffle"):
        tune_loader(Stream(32), 8, num_workers=0, pin_memory=False, progress=False, loader_kwargs={"shuffle": True})


@needs_no_cuda
def test_tune_loader_cuda_device_without_cuda() -> None:
    with pytest.raises(InvalidOptionError, match=r"CUDA is not available: leave device=None"):
        tune_loader(Ranges(32), 8, device="cuda", progress=False)


# ------------------------------------------------------------------ max_batch_size


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

    assert data._largest_fitting(fits, 100, on_none=lambda: pytest.fail("1 fits")) == min(threshold, 100)
    assert all(1 <= k <= 100 for k in tried) and len(tried) <= 2 * 7 + 1


def test_search_reports_when_nothing_fits() -> None:
    with pytest.raises(InvalidInputsError, match=r"runs out of memory"):
        data._largest_fitting(lambda k: False, 10, on_none=lambda: data._too_big("a batch of 8 runs out of memory", 8))


def test_default_budget_is_positive() -> None:
    assert data._default_budget() > 0

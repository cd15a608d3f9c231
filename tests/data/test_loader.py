"""graphopt.data.loader: DataLoader tuning.

Times are never asserted on (they are noise on a shared machine): only structure, the
rules that pick ``best`` from the table, warnings and messages.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from graphopt.data import LoaderCandidate, LoaderTuning, tune_loader
from graphopt.data.loader import _default_workers, _has_accelerator
from graphopt.errors import GraphoptError, InvalidInputsError, InvalidOptionError

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
    slow = LoaderCandidate({"batch_size": 8, "num_workers": 0, "pin_memory": False}, 100.0, 0.5, 1.0, 3, 24, 0.1)
    fast = LoaderCandidate(
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
    if _has_accelerator():
        pytest.skip("an accelerator is available")
    tuning = tune_loader(Ranges(64), 8, num_workers=0, pin_memory=(False, True), batches=2, progress=False)
    assert [row.kwargs["pin_memory"] for row in tuning.table] == [False]
    assert any("pin_memory=True was not tried" in warning for warning in tuning.warnings)


@pytest.mark.parametrize("cpus, expected", [(1, (0, 1)), (2, (0, 1, 2)), (6, (0, 1, 2, 4, 6)), (8, (0, 1, 2, 4, 8))])
def test_default_worker_counts_double_up_to_the_cpu_count(monkeypatch: pytest.MonkeyPatch, cpus: int, expected: tuple[int, ...]) -> None:
    monkeypatch.setattr("graphopt.data.loader.os.cpu_count", lambda: cpus)
    assert _default_workers() == expected


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

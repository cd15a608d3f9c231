"""Input-pipeline helpers: tune a DataLoader's settings, find the largest batch that fits.

    from graphopt.data import tune_loader, max_batch_size

    tuning = tune_loader(dataset, batch_size=64, device="cuda")
    print(tuning)                                   # table, fastest first
    loader = DataLoader(dataset, **tuning.best)     # the fastest settings measured

    batch = max_batch_size(model, torch.randn(1, 3, 224, 224), mode="training")

    for inputs, labels in DevicePrefetcher(loader, "cuda"):  # next batch copied while this one runs
        ...

`tune_loader` measures; it does not predict. Its numbers hold for this machine, this
dataset and this moment: other load on the machine shifts them, so rerun it where the
training runs. `max_batch_size` searches by running the model on CUDA (out-of-memory is
a reliable signal there) and estimates from tensor sizes elsewhere (see its docstring
for exactly how).

The package owns these tools; each concern has its module: ``loader.py`` (`tune_loader`
and its table), ``batch_size.py`` (`max_batch_size`), ``memory.py`` (the operating
system's memory numbers both use) and ``options.py`` (their shared argument checks).
`DevicePrefetcher` lives in `graphopt.prefetch` and is re-exported here.
"""

from __future__ import annotations

from graphopt.data.batch_size import max_batch_size
from graphopt.data.loader import LoaderCandidate, LoaderTuning, tune_loader
from graphopt.prefetch import DevicePrefetcher

# The name before LoaderCandidate (it was in __all__): graphopt.tuning has a Candidate of its own.
Candidate = LoaderCandidate

__all__ = ["Candidate", "DevicePrefetcher", "LoaderCandidate", "LoaderTuning", "max_batch_size", "tune_loader"]

"""``optimize(..., tune=True)``: build candidate configurations, time them, return the fastest accurate one.

Every rule of thumb has exceptions (channels_last loses on grouped convs and transformers,
torch.compile on CPU can lose to eager bf16, ...), so graphopt measures on the example
inputs, on the target device:

1. Candidates: the captured graph with no passes (what eager runs), the exact fp32
   passes in each memory format, each low precision the accuracy budget and the device
   allow, for CPU inference each of those with oneDNN's fused, prepacked kernels
   (`use_onednn_kernels`), with ``calibration=`` int8 (`quantize_int8`, within the same
   accuracy budget), and, when the budget is large enough, pointwise fusion and the whole
   graph handed to torch.compile. Options the caller set explicitly are not tuned.
2. Each candidate is built with `graphopt.optimize` (verified against the original: its
   error, the largest on the example and on the second input, is measured, not assumed;
   ``optimize`` refuses ``tune=True`` with ``verify=False``); candidates over the accuracy
   budget are rejected.
3. The accurate candidates are timed together after a warm-up, in rounds whose order
   is shuffled (A B C, C A B, B C A, ...), until the fastest is clear of the runner-up beyond the
   measurement noise or the rest of the budget is spent (`graphopt.timing.rank_latencies`:
   the interval of the paired per-round ratios; other processes' CPU load is measured).
4. The lowest median wins; ``report.tune`` lists every candidate, its time and error, and
   why the winner won, flagging a "close" ranking (winner and runner-up as fast within the
   noise) or a "disturbed" one (other processes kept the CPU busy: that choice is not
   cached). The captured graph with no passes is always a candidate, so the result is
   never slower than eager beyond measurement noise.

``tune_target="throughput"`` (``tune``'s ``batch_size``, optimize's ``tune_batch_size``): the candidates are built
and verified on the example inputs as always, then run and timed on `graphopt.inputs.at_batch_size`'s, the example's
rows repeated to that batch in the batch dimension. A candidate that refuses that batch (its batch dimension fixed:
torch.export specialised it, or verification could not vary it) fails with the reason, so the module returned always
runs at it; where none accepts it, `InvalidOptionError`. Every candidate runs the same batch, so the fastest call is
the most samples per second, which the report gives (``report.tune.batch_size``, ``report.tune.target``).

``tune_budget_s`` bounds the work beyond each precision class's first candidate on each engine
(always built, the float classes before int8: `candidates`): the others are built likeliest winner
first until half the budget is spent, and graphopt's own compiling candidates (``fuse=``) only when
the budget allows them; what was left out is listed with the reason. Results are
cached per (model structure, input shapes and dtypes, device, options, the target and its batch, candidates and
their pass lists, torch's, graphopt's and each engine's versions, the CPU model and its instruction sets) in this process and in ``$GRAPHOPT_CACHE_DIR/tune.json`` (default
``~/.cache/graphopt``), so a second call builds the winner without measuring. The key leaves
the weights out (they do not change which candidate is fastest), but they can change a
candidate's error: the cached choice is verified against ``accuracy`` like a fresh candidate,
and one over it (or failing to build) is tuned again, the report saying why.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn as nn

from graphopt import archive_metadata, progress, timing
from graphopt.backends import EngineInfo
from graphopt.errors import GraphoptError, InputMismatchError, InvalidOptionError, error_summary
from graphopt.inputs import at_batch_size
from graphopt.pipeline import cpu_kernel_passes
from graphopt.report import Report, TuneCandidate, TuneReport
from graphopt.timing import Ranking, rank_latencies, remeasure_requested
from graphopt.verify import tolerance_for

# A low precision is a candidate only when the accuracy budget admits its documented error bound.
LOW_PRECISION_BOUNDS = {"bf16": 3e-2, "fp16": 1e-2}
DEFAULT_BUDGET_S = 60.0
COMPILE_BUDGET_S = 120.0  # below this budget, graphopt's own candidates that compile (fuse=) are left out

# The timer and the clock the budget is spent by are module attributes so that tests can replace them with deterministic ones.
measure_latencies: Callable[..., Ranking] = rank_latencies
clock: Callable[[], float] = time.perf_counter

_memory_cache: dict[str, dict[str, Any]] = {}


@dataclass(frozen=True)
class Candidate:
    name: str
    options: dict[str, Any] = field(default_factory=dict)  # graphopt.optimize options
    # built whatever the budget: the reference, the default call tune must not lose to, each precision class's first
    # candidate on each engine
    required: bool = False


def candidates(
    model: nn.Module,
    fixed: Mapping[str, Any],
    accuracy: float,
    low_precisions: list[str],
    budget_s: float,
    onednn: bool = False,
    emulated: Mapping[str, str] | None = None,
    int8: bool = False,
    engines: Sequence[EngineInfo] = (),
) -> tuple[list[Candidate], list[TuneCandidate]]:
    """The candidates to build, and the ones left out with the reason.

    Two tiers. First, built whatever the budget: the graph with no passes (the report's
    reference), then every precision class ``accuracy`` admits on every engine, each by its
    likeliest winner, the float classes (lowest precision first) before int8, whose builds
    calibrate and cost the most: each engine other than PyTorch in each float precision it
    computes in, the default call itself (``optimize(model, inputs)``, whenever no option is
    fixed: the result is never slower than it beyond measurement noise), PyTorch's first
    candidate in each other precision, then each engine's int8 and PyTorch's int8. So a budget
    spent on int8 never leaves a float class unbuilt (nor the reverse). Then the rest, likeliest
    winner first (channels_last before preserve, oneDNN kernels before the same without them),
    until half the budget is spent: on large models the cut drops the least promising ones.
    Candidates that compile (an engine that does, as Inductor; graphopt's own ``fuse=``) are
    among the rest, and only with a budget of `COMPILE_BUDGET_S` or more.
    ``onednn``: the model runs inference on a CPU with oneDNN, so each precision also gets
    a candidate with the CPU-kernel passes (`graphopt.pipeline.cpu_kernel_passes`: oneDNN's fused,
    prepacked conv/linear kernels). ``emulated``: low precisions this device only emulates,
    with the reason; they are left out (building and timing them would spend the budget on
    a sure loser). ``int8``: calibration batches were given, so int8 (channels_last, the
    layers over ``accuracy`` kept in float32) is a candidate, unless explicit options rule it
    out. ``engines``: the engines other than PyTorch that may serve the model (inference on the
    CPU), in each precision they compute in that ``accuracy`` admits (int8 too, with calibration
    batches), all from one capture and one run of the portable passes (``build`` passes one
    `graphopt.stages.SharedByEngines` to them all, the engines their conversions); one not
    installed is listed with the extra to install.
    """
    has_conv = any(isinstance(m, (nn.Conv2d, nn.Conv3d)) for m in model.modules())
    layouts = ["preserve", "channels_last"] if has_conv else ["preserve"]
    if "memory_format" in fixed:
        layouts = [fixed["memory_format"]]
    precisions = ["fp32"]
    left_out = []
    emulated = emulated or {}
    for low in low_precisions:
        if low in emulated:
            left_out.append(TuneCandidate(low, {"precision": low}, status="not built", reason=emulated[low]))
        elif accuracy >= LOW_PRECISION_BOUNDS[low]:
            precisions.append(low)
        else:
            left_out.append(TuneCandidate(low, {"precision": low}, status="not built", reason=f"{low} errors reach {LOW_PRECISION_BOUNDS[low]:.0e} of the output scale, over accuracy={accuracy:.0e}"))
    if "precision" in fixed:
        precisions = [fixed["precision"]]
    engine_floats, engine_int8s, engines_left_out = _engine_candidates(fixed, precisions, engines, accuracy if int8 and "precision" not in fixed else None)
    left_out += engines_left_out
    if "engine" in fixed:  # only that engine is tuned: each of its precisions is a class of its own
        return [replace(candidate, required=True) for candidate in engine_floats + engine_int8s], left_out
    # an engine that compiles (Inductor: minutes on large models) is one of the costlier candidates, as fuse= is
    compiling = [candidate for candidate in engine_floats if _compiles(candidate, engines)]
    engine_floats = [candidate for candidate in engine_floats if candidate not in compiling]
    first = [Candidate("captured graph, no passes", {"passes": [], "memory_format": "preserve"}, required=True)] if "passes" not in fixed else []
    first += engine_floats
    if not fixed:
        first.append(Candidate("default call", {}, required=True))
    rest = []
    for precision in reversed(precisions):  # the likeliest winner first: channels_last before preserve, oneDNN before without
        own = []
        for layout in reversed(layouts):
            if onednn and layout == layouts[-1] and "passes" not in fixed and "fuse" not in fixed:
                own.append(Candidate(f"{precision} {layout} + oneDNN", {"precision": precision, "memory_format": layout, "passes": cpu_kernel_passes(precision, layout)}))
            own.append(Candidate(f"{precision} {layout}", {"precision": precision, "memory_format": layout}))
        if precision == "fp32" and not fixed:  # the default call is PyTorch's first fp32 candidate
            rest += own
        else:
            first.append(replace(own[0], required=True))
            rest += own[1:]
    first += engine_int8s
    if int8:
        int8_options = {"precision": "int8", "memory_format": "channels_last", "accuracy": accuracy}
        ruled_out = [name for name in ("precision", "passes", "fuse") if name in fixed] + (["memory_format"] if fixed.get("memory_format") == "preserve" else [])
        if ruled_out:
            left_out.append(TuneCandidate("int8", int8_options, status="not built", reason=f"explicit {', '.join(f'{name}=' for name in ruled_out)} rules int8 out"))
        else:
            first.append(Candidate("int8 channels_last", int8_options, required=True))
    fuse_choices = [fixed["fuse"]] if "fuse" in fixed else ["inductor", "graph"]
    best_precision = precisions[-1]
    for fuse in fuse_choices:
        if fuse is None:
            continue
        for layout in layouts[-1:]:
            compiling.append(Candidate(f"{best_precision} {layout} + fuse={fuse}", {"precision": best_precision, "memory_format": layout, "fuse": fuse}))
    for candidate in compiling:
        if budget_s < COMPILE_BUDGET_S and "fuse" not in fixed:
            left_out.append(TuneCandidate(candidate.name, candidate.options, status="not built", reason=f"compiles: needs tune_budget_s >= {COMPILE_BUDGET_S:.0f}"))
        else:
            rest.append(replace(candidate, required=False))
    return first + rest, left_out


def _compiles(candidate: Candidate, engines: Sequence[EngineInfo]) -> bool:
    return any(info.compiles and info.name == candidate.options.get("engine") for info in engines)


def _engine_candidates(
    fixed: Mapping[str, Any], precisions: list[str], engines: Sequence[EngineInfo], int8_accuracy: float | None = None
) -> tuple[list[Candidate], list[Candidate], list[TuneCandidate]]:
    """Each engine in each of ``precisions`` it computes in, lowest precision first (on a CPU with native bf16, every
    engine's bf16 before any fp32); each engine that quantizes in int8 within ``int8_accuracy`` (calibration batches
    were given; None: not a candidate); and the engines left out with the reason. Each is its precision class's only
    candidate on its engine, so all are built whatever the budget."""
    usable, left_out = [], []
    ruled_out = [name for name in ("memory_format", "passes", "fuse") if name in fixed]
    for info in engines:
        if "engine" in fixed and fixed["engine"] != info.name:
            continue
        reason = info.missing() or (f"explicit {', '.join(f'{name}=' for name in ruled_out)} rules engines out" if ruled_out else "")
        if reason:
            left_out.append(TuneCandidate(info.name, {"engine": info.name}, status="not built", reason=reason))
        else:
            usable.append(info)
    floats = [
        Candidate(f"{info.name} {precision}", {"engine": info.name, "precision": precision}, required=True)
        for precision in reversed(precisions)
        for info in usable
        if precision in info.precisions
    ]
    int8s = [
        Candidate(f"{info.name} int8", {"engine": info.name, "precision": "int8", "accuracy": int8_accuracy}, required=True)
        for info in usable
        if int8_accuracy is not None and "int8" in info.precisions
    ]
    return floats, int8s, left_out


def cache_key(model: nn.Module, args: tuple[Any, ...], settings: Mapping[str, Any]) -> str:
    """What the tuned choice depends on: the model's structure and weights' shapes, the inputs, the device, the options,
    torch's and graphopt's versions and the CPU (`graphopt.timing.cpu_signature`: a choice timed on another CPU model, or
    another instruction set, is made again)."""
    structure = [(name, type(module).__qualname__) for name, module in model.named_modules()]
    tensors = [(name, tuple(t.shape), str(t.dtype), str(t.device)) for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)]
    inputs = [(tuple(a.shape), str(a.dtype), str(a.device)) if isinstance(a, torch.Tensor) else repr(a) for a in args]
    text = json.dumps(
        [type(model).__qualname__, structure, tensors, inputs, {k: repr(v) for k, v in sorted(settings.items())}, torch.__version__, archive_metadata.GRAPHOPT_VERSION, timing.cpu_signature()]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _cache_file() -> Path:
    return Path(os.environ.get("GRAPHOPT_CACHE_DIR", Path.home() / ".cache" / "graphopt")) / "tune.json"


def cached(key: str) -> dict[str, Any] | None:
    if key in _memory_cache:
        return _memory_cache[key]
    try:
        entry = json.loads(_cache_file().read_text()).get(key)
    except (OSError, ValueError):
        return None
    if entry is not None:
        _memory_cache[key] = entry
    return entry


def remember(key: str, entry: dict[str, Any]) -> None:
    _memory_cache[key] = entry
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = json.loads(path.read_text()) if path.exists() else {}
        stored[key] = entry
        path.write_text(json.dumps(stored, indent=1))
    except (OSError, ValueError):
        pass  # an unwritable cache only costs a second measurement


def tune(
    build: Callable[..., Any],
    model: nn.Module,
    args: tuple[Any, ...],
    *,
    fixed: Mapping[str, Any],
    accuracy: float,
    budget_s: float,
    low_precisions: list[str],
    settings: Mapping[str, Any],
    onednn: bool = False,
    emulated: Mapping[str, str] | None = None,
    int8: bool = False,
    engines: Sequence[EngineInfo] = (),
    batch_size: int | None = None,
) -> Any:
    """The fastest candidate `build(**options)` (an `OptimizedModule`) whose error is within ``accuracy``: by latency on
    ``args``, or with ``batch_size`` by throughput at that batch (`at_batch_size`: a candidate that refuses it fails)."""
    todo, rows = candidates(model, fixed, accuracy, low_precisions, budget_s, onednn, emulated, int8, engines)
    timed = args if batch_size is None else at_batch_size(args, batch_size)
    # the candidates (with their pass lists) and the engines' versions are part of the key: a choice another graphopt
    # made, or made among other engines' builds, is not reused
    considered = [(candidate.name, candidate.options) for candidate in todo]
    versions = {info.name: info.version() for info in engines}
    key = cache_key(model, args, {**settings, **fixed, "accuracy": accuracy, "low": low_precisions, "candidates": considered, "versions": versions})
    hit = None if settings.get("remeasure") or remeasure_requested() else cached(key)  # remeasure=: tune again too
    failures: list[Exception] = []
    rejected = None  # the cached choice, where this model's weights put it over accuracy (or it fails to build)
    if hit is not None:
        row = TuneCandidate(hit["winner"], hit["winner_options"])
        module, failure = _build(build, row, timed, accuracy)
        if module is not None:
            why = f"{hit['why']}; verified on this model: {_error_text(row.max_error)}"
            listed = [TuneCandidate(**entry) for entry in hit["candidates"]]
            module.graphopt_report.tune = TuneReport(hit["winner"], why, listed, accuracy, cache="hit", seconds=0.0, batch_size=batch_size)
            return module
        rejected = row  # stands for its candidate below: built once is enough
        if failure is not None:
            failures.append(failure)
    started = clock()
    modules: dict[str, Any] = {}
    for candidate in progress.steps(todo, "tune: building", lambda candidate: candidate.name):
        if rejected is not None and candidate.name == rejected.name:
            rows.append(rejected)
            continue
        row = TuneCandidate(candidate.name, candidate.options)
        rows.append(row)
        if modules and not candidate.required and clock() - started > budget_s / 2:  # keep half the budget for timing
            row.status, row.reason = "not built", f"tune_budget_s={budget_s:.0f} spent on the candidates before it"
            continue
        module, failure = _build(build, row, timed, accuracy)
        if failure is not None:
            failures.append(failure)
        if module is not None:
            modules[candidate.name] = module
    if not modules:  # nothing to time: the first candidate's own error says why (the graph with no passes failed too)
        _nothing_built(failures, rows, "candidate", batch_size)
    remaining = max(budget_s - (clock() - started), 0.0)
    runs = {name: (lambda module=module: module(*timed)) for name, module in modules.items()}
    ranking = measure_latencies(runs, budget_s=remaining)
    for row in rows:
        if row.name in ranking.medians:
            row.status, row.seconds = "measured", ranking.medians[row.name]
    winner = ranking.winner
    why = _why(ranking, rows, accuracy, batch_size)
    shown = why if rejected is None else f"the cached choice {rejected.name} was rejected on this model ({rejected.status}: {rejected.reason}), so tune measured again; {why}"
    cache = "miss" if rejected is None else "rejected"
    report = TuneReport(winner, shown, rows, accuracy, cache=cache, seconds=clock() - started, ranking=ranking, batch_size=batch_size)
    chosen = modules[winner]
    chosen.graphopt_report.tune = report
    if ranking.verdict != "disturbed":  # a choice timed while other processes held the CPU is made again next time
        remember(key, {"winner": winner, "winner_options": next(c.options for c in todo if c.name == winner), "why": why, "candidates": [asdict(r) for r in rows]})
    return chosen


def _nothing_built(failures: list[Exception], rows: list[TuneCandidate], what: str, batch_size: int | None = None) -> NoReturn:
    """Raise why no candidate was built: the first candidate's own `GraphoptError` (with ``batch_size``, where the
    candidates refused that batch, an `InvalidOptionError` saying so), else one listing every candidate."""
    first = next((error for error in failures if isinstance(error, GraphoptError)), failures[0] if failures else None)
    if batch_size is not None and isinstance(first, InputMismatchError):
        raise InvalidOptionError(
            f"tune_target='throughput' times each candidate at tune_batch_size={batch_size}, and none accepts that batch ({first}): "
            f"give example inputs of batch {batch_size}, or leave tune_target out to tune for latency"
        ) from first
    if isinstance(first, GraphoptError):
        raise first
    raise GraphoptError(f"tune=True built no {what} ({'; '.join(f'{row.name}: {row.reason}' for row in rows)}): optimize without tune=True to see the error") from first


def measured_error(report: Report) -> float | None:
    """A candidate's error relative to the output's scale: the largest its verification measured (each pass on the example,
    the final graph or engine on the second input); None where nothing but the capture's own check against eager ran."""
    return max((error for error in (report.max_error, report.second_input_error) if error is not None), default=None)


def _error_text(error: float | None) -> str:
    return "error not measured (a graph with no passes, checked against eager by the capture only)" if error is None else f"error {error:.1e}"


def _build(build: Callable[..., Any], row: TuneCandidate, args: tuple[Any, ...], accuracy: float) -> tuple[Any, Exception | None]:
    """Build and run ``row``'s candidate, recording in ``row`` its build time and measured error, or why it is out:
    the module if it is within ``accuracy`` (else None), and the exception if it failed."""
    building = clock()
    try:
        module = build(**row.options)
        module(*args)
    except Exception as error:  # noqa: BLE001 - a candidate that cannot be built is reported, not fatal
        row.status, row.reason = "failed", error_summary(error)
        return None, error
    row.build_seconds = clock() - building
    row.max_error = measured_error(module.graphopt_report)
    if row.max_error is not None and row.max_error > accuracy:
        row.status, row.reason = "over budget", f"error {row.max_error:.1e} > accuracy {accuracy:.0e}"
        return None, None
    return module, None


def _why(ranking: Ranking, rows: list[TuneCandidate], accuracy: float, batch_size: int | None) -> str:
    latencies, winner = ranking.medians, ranking.winner
    baseline = latencies.get("captured graph, no passes", latencies[winner])
    error = next(row.max_error for row in rows if row.name == winner)
    if batch_size is None:
        text = f"fastest of {len(latencies)} accurate candidates: {latencies[winner] * 1e3:.2f} ms"
    else:  # every candidate ran the same batch: the fastest call is the most samples per second
        text = f"highest throughput of {len(latencies)} accurate candidates at batch {batch_size}: {batch_size / latencies[winner]:.1f} samples/s ({latencies[winner] * 1e3:.2f} ms per call)"
    text += f", {baseline / latencies[winner]:.2f}x the graph with no passes"
    if ranking.runner_up is not None:
        text += f"; next {ranking.runner_up} at {latencies[ranking.runner_up] * 1e3:.2f} ms"
    text += f"; timed {ranking.describe()}"
    return text + f"; {_error_text(error)} within accuracy {accuracy:.0e}"


TUNE_NEW_TOKENS = 16  # each generation candidate is timed on this many decode steps after the example prompt's prefill


def generation_candidates(engines: Sequence[EngineInfo], accuracy: float, fixed: str | None = None) -> list[tuple[EngineInfo, str]]:
    """(engine, precision) for each of ``engines`` in each precision it generates in that ``accuracy`` admits (only
    ``fixed``, where the caller gave one), lowest first: int8 (the weights alone) within any budget looser than fp32's
    tolerance, bf16 within its documented bound (`LOW_PRECISION_BOUNDS`), and fp32."""
    admitted = {"int8": accuracy > tolerance_for(torch.float32), "bf16": accuracy >= LOW_PRECISION_BOUNDS["bf16"], "fp32": True}
    precisions = [fixed] if fixed is not None else [precision for precision, admits in admitted.items() if admits]
    return [(info, precision) for info in engines for precision in precisions if precision in info.generation_precisions]


def tune_generation(
    build: Callable[[EngineInfo, str], Any],
    candidates: Sequence[tuple[EngineInfo, str]],
    decoding: Callable[[Any], Callable[[], Any]],
    accuracy: float,
    budget_s: float,
    key: str | None = None,
    remeasure: bool = False,
) -> tuple[Any, TuneReport]:
    """The fastest of ``build(engine, precision)`` (a verified `graphopt.generation.Generator`) over ``candidates``
    (`generation_candidates`), timed per new token: ``decoding(generator)`` makes the call timed, `TUNE_NEW_TOKENS`
    decode steps after a prefill it makes once (decode steps are most of a generation's time); with the report of
    every candidate. One whose logit error is over ``accuracy`` is not kept. Every candidate is built; ``budget_s``
    bounds the timing. Under ``key`` (`cache_key`; None: not remembered) the choice is remembered as
    `tune`'s is, and a remembered one is the only candidate built (unless ``remeasure``), verified on this model like a
    fresh one; where it fails or is over ``accuracy``, tune measures again and the report says why."""
    by_name = {_generation_name(info, precision): (info, precision) for info, precision in candidates}
    hit = None if key is None or remeasure or remeasure_requested() else cached(key)
    rejected = None  # the cached choice, where it failed or is over accuracy on this model
    if hit is not None and hit["winner"] in by_name:
        row = TuneCandidate(hit["winner"], hit["winner_options"])
        generator = _build_generation(build, *by_name[hit["winner"]], row, accuracy, [])
        if generator is not None:
            error = "not measured" if row.max_error is None else f"{row.max_error:.1e}"
            why = f"{hit['why']}; verified on this model: logit error {error}"
            return generator, TuneReport(hit["winner"], why, [TuneCandidate(**entry) for entry in hit["candidates"]], accuracy, cache="hit", seconds=0.0)
        rejected = row
    rows, built, failures = [], {}, []
    started = clock()
    for name, (info, precision) in by_name.items():
        if rejected is not None and name == rejected.name:
            rows.append(rejected)
            continue
        row = TuneCandidate(name, {"engine": info.name, "precision": precision})
        rows.append(row)
        generator = _build_generation(build, info, precision, row, accuracy, failures)
        if generator is not None:
            built[name] = generator
    if not built:
        _nothing_built(failures, rows, "generation candidate")
    remaining = max(budget_s - (clock() - started), 0.0)
    ranking = measure_latencies({name: decoding(generator) for name, generator in built.items()}, budget_s=remaining)
    for row in rows:
        if row.name in ranking.medians:
            row.status, row.seconds = "measured", ranking.medians[row.name]
    winner = ranking.winner
    why = f"fastest of {len(built)} verified generation candidates per new token, {TUNE_NEW_TOKENS} decode steps in {ranking.medians[winner] * 1e3:.1f} ms"
    if ranking.runner_up is not None:
        why += f"; next {ranking.runner_up} at {ranking.medians[ranking.runner_up] * 1e3:.1f} ms"
    why += f"; timed {ranking.describe()}; " + ("fp32, the original's greedy tokens" if built[winner].report.precision == "fp32" else f"logits within accuracy={accuracy:g}")
    if key is not None and ranking.verdict != "disturbed":  # a choice timed while other processes held the CPU is made again next time
        remember(key, {"winner": winner, "winner_options": next(row.options for row in rows if row.name == winner), "why": why, "candidates": [asdict(row) for row in rows]})
    shown = why if rejected is None else f"the cached choice {rejected.name} was rejected on this model ({rejected.status}: {rejected.reason}), so tune measured again; {why}"
    report = TuneReport(winner, shown, rows, accuracy, cache="miss" if rejected is None else "rejected", seconds=clock() - started, ranking=ranking)
    return built[winner], report


def _generation_name(info: EngineInfo, precision: str) -> str:
    return f"{info.name} {precision} generate"


def _build_generation(
    build: Callable[[EngineInfo, str], Any], info: EngineInfo, precision: str, row: TuneCandidate, accuracy: float, failures: list[Exception]
) -> Any:
    """``build(info, precision)``, recording in ``row`` its build time and logit error, or why it is out (its engine is
    missing, it failed: the error joins ``failures``, or it is over ``accuracy``): the generator, else None."""
    missing = info.missing()
    if missing is not None:
        row.status, row.reason = "not built", missing
        return None
    building = clock()
    try:
        generator = build(info, precision)
    except Exception as error:  # noqa: BLE001 - a candidate that cannot be built is reported, not fatal
        row.status, row.reason = "failed", error_summary(error)
        failures.append(error)
        return None
    row.build_seconds, row.max_error = clock() - building, generator.report.max_error
    if row.max_error is not None and row.max_error > accuracy:
        row.status, row.reason = "over budget", f"logit error {row.max_error:.1e} over accuracy={accuracy:g}"
        return None
    return generator

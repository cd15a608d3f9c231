"""tune=True for a causal language model's generate() (`graphopt.tuning.tune_generation`): the choice is remembered and
a second call builds only it, verified on the model; a remembered choice over the budget is tuned again; remeasure tunes
again; the key holds the candidates, the engines' versions and the CPU.

Builds are stubs (a generator is what its report says), timings come from tests.test_tuning's fake timer: no test times
anything. The key's test optimizes a tiny GPT-2 up to the point tune_generation is called.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import graphopt
from graphopt import tuning
from graphopt.backends import ENGINES, EngineInfo
from tests.test_generation import prompt, tiny
from tests.test_tuning import use_timer

PYTORCH = ENGINES["pytorch"]
OTHER = dataclasses.replace(PYTORCH, name="other")  # a second engine with nothing to install
CANDIDATES = [(PYTORCH, "fp32"), (OTHER, "fp32")]
FAST = {"other fp32 generate": 5e-3}  # the fake timer's latencies: "other" wins, pytorch takes 10 ms


class Builds:
    """A stub build: records each (engine, precision) built; each generator's logit error is ``errors[engine]`` (1e-7)."""

    def __init__(self, errors: dict[str, float] | None = None) -> None:
        self.errors = errors or {}
        self.built: list[tuple[str, str]] = []

    def __call__(self, info: EngineInfo, precision: str) -> Any:
        self.built.append((info.name, precision))
        return SimpleNamespace(report=SimpleNamespace(max_error=self.errors.get(info.name, 1e-7), precision=precision), engine=info.name)


def tune(builds: Builds, key: str | None = "key", budget_s: float = 60.0) -> tuple[Any, Any]:
    return tuning.tune_generation(builds, CANDIDATES, lambda generator: lambda: None, 1e-4, budget_s, key)


def test_a_second_tune_builds_only_the_remembered_choice_and_verifies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, FAST)
    first = Builds()
    generator, report = tune(first)
    assert (generator.engine, report.winner, report.cache, first.built) == ("other", "other fp32 generate", "miss", [("pytorch", "fp32"), ("other", "fp32")])
    monkeypatch.setattr(tuning, "_memory_cache", {})  # a new process: only the file is left
    second = Builds()
    generator, cached = tune(second)
    assert (generator.engine, cached.winner, cached.cache, second.built) == ("other", "other fp32 generate", "hit", [("other", "fp32")])
    assert cached.why == f"{report.why}; verified on this model: logit error 1.0e-07"
    assert [row.name for row in cached.candidates] == [row.name for row in report.candidates]


def test_a_remembered_choice_over_the_budget_on_this_model_is_tuned_again_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, FAST)
    tune(Builds())
    builds = Builds(errors={"other": 0.5})  # other weights: the remembered choice's logits are now over accuracy
    generator, report = tune(builds)
    assert builds.built == [("other", "fp32"), ("pytorch", "fp32")]  # the rejected choice is built once, not again
    assert (generator.engine, report.winner, report.cache) == ("pytorch", "pytorch fp32 generate", "rejected")
    assert report.why.startswith("the cached choice other fp32 generate was rejected on this model (over budget: logit error 5.0e-01 over accuracy=0.0001)")
    rows = {row.name: row.status for row in report.candidates}
    assert rows == {"pytorch fp32 generate": "measured", "other fp32 generate": "over budget"}


def test_remeasure_tunes_again_and_without_a_key_nothing_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    use_timer(monkeypatch, FAST)
    tune(Builds())
    again = Builds()
    _, report = tuning.tune_generation(again, CANDIDATES, lambda generator: lambda: None, 1e-4, 60.0, "key", remeasure=True)
    assert (report.cache, again.built) == ("miss", [("pytorch", "fp32"), ("other", "fp32")])
    monkeypatch.setattr(tuning, "_memory_cache", {})
    monkeypatch.setenv("GRAPHOPT_CACHE_DIR", str(Path(tuning._cache_file()).parent.parent / "empty"))
    tune(Builds(), key=None)
    again = Builds()
    _, report = tune(again, key=None)
    assert (report.cache, again.built) == ("miss", [("pytorch", "fp32"), ("other", "fp32")])
    assert tuning._memory_cache == {}


def test_the_key_holds_the_engines_and_graphopts_versions_and_the_cpu_and_remeasure_drops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    keys: list[tuple[str | None, bool]] = []

    class Stop(Exception):
        pass

    def record(build: Any, candidates: Any, decoding: Any, accuracy: float, budget_s: float, key: str | None, remeasure: bool) -> Any:
        keys.append((key, remeasure))
        raise Stop

    monkeypatch.setattr(tuning, "tune_generation", record)
    model = tiny("gpt2", n_layer=1)  # one layer is enough: each optimize below runs up to tune_generation, what the key holds is under test
    ids, mask = prompt(2, 6, padded=2)

    def key_of(**options: Any) -> tuple[str | None, bool]:
        with pytest.raises(Stop):
            graphopt.optimize(model, {"input_ids": ids, "attention_mask": mask}, tune=True, **options)
        return keys[-1]

    first = key_of()
    assert first[0] is not None and key_of() == first and not first[1]
    version = EngineInfo.version
    monkeypatch.setattr(EngineInfo, "version", lambda info: "another version")
    assert key_of() != first
    monkeypatch.setattr(EngineInfo, "version", version)
    assert key_of() == first
    assert key_of(remeasure=True) == (first[0], True)  # tune again, and remember the new choice under the same key
    monkeypatch.setattr(graphopt.timing, "cpu_signature", lambda: ["another CPU"])
    assert key_of() != first
    monkeypatch.undo()
    monkeypatch.setattr(tuning, "tune_generation", record)
    assert key_of() == first
    monkeypatch.setattr(graphopt.archive_metadata, "GRAPHOPT_VERSION", "another graphopt")  # an earlier graphopt's choice is not reused
    assert key_of() != first

"""The pass registry: every pass has a test file, a description, and presets are consistent."""

from __future__ import annotations

from pathlib import Path

import graphopt
from graphopt.passes import REGISTRY
from graphopt.pipeline import PRESETS

HERE = Path(__file__).parent


def test_every_registered_pass_has_a_test_file() -> None:
    missing = [name for name in REGISTRY if not (HERE / f"test_{name}.py").is_file()]
    assert missing == []


def test_every_pass_lives_in_a_module_named_after_it() -> None:
    for name, info in REGISTRY.items():
        assert info.function.__module__ == f"graphopt.passes.{name}"
        assert info.function.__name__ == name


def test_list_passes_describes_each_pass() -> None:
    infos = graphopt.list_passes()
    assert [info.name for info in infos] == list(REGISTRY)
    for info in infos:
        assert info.description and info.modes
        assert set(info.modes) <= {"inference", "training"}


def test_presets_name_registered_passes_of_their_mode() -> None:
    for mode, names in PRESETS.items():
        for name in names:
            assert mode in REGISTRY[name].modes
            assert REGISTRY[name].exact, "presets run by default: only exact passes belong there"

"""Which models a benchmark run measures: ``reference``, ``anchors``, names, or user factories.

``reference`` is graphopt's small reference models (`graphopt.models.REFERENCE_MODELS`);
``anchors`` the full-size models graphopt is measured against
(`graphopt.models.ANCHOR_MODELS`, imported only when asked for). Any other entry of the
comma-separated selection is a model name from either, or ``MODULE:FACTORY``, which the
caller turns into a `BenchModel` (the command line builds it with ``--input`` shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphopt.bench.harness import BenchModel
from graphopt.errors import InvalidOptionError
from graphopt.models import REFERENCE_MODELS, ReferenceModel


def anchor_models() -> dict[str, ReferenceModel]:
    """`graphopt.models.ANCHOR_MODELS`, or an error saying it is not available in this graphopt."""
    import graphopt.models

    anchors: Any = getattr(graphopt.models, "ANCHOR_MODELS", None)
    if anchors is None:
        raise InvalidOptionError(
            "--models anchors needs graphopt.models.ANCHOR_MODELS (the full-size anchor models), which this version of "
            "graphopt does not have: use --models reference, model names, or MODULE:FACTORY"
        )
    return dict(anchors)


def from_reference(reference: ReferenceModel, batch: int) -> BenchModel:
    return BenchModel(reference.name, reference.build, lambda: reference.example_inputs(batch_size=batch))


def select_models(selection: str, batch: int, from_factory: Callable[[str], BenchModel]) -> list[BenchModel]:
    """The models named by ``selection``: ``reference``, ``anchors``, names and ``MODULE:FACTORY``, comma-separated."""
    models: list[BenchModel] = []
    for entry in (part.strip() for part in selection.split(",")):
        if not entry:
            continue
        if entry == "reference":
            models += [from_reference(reference, batch) for reference in REFERENCE_MODELS.values()]
        elif entry == "anchors":
            models += [from_reference(reference, batch) for reference in anchor_models().values()]
        elif ":" in entry:
            models.append(from_factory(entry))
        elif entry in REFERENCE_MODELS:
            models.append(from_reference(REFERENCE_MODELS[entry], batch))
        else:
            models.append(from_reference(_anchor_named(entry), batch))
    if not models:
        raise InvalidOptionError("--models selects no model: give reference, anchors, model names or MODULE:FACTORY")
    return models


def _anchor_named(name: str) -> ReferenceModel:
    known = sorted(REFERENCE_MODELS)
    try:
        anchors = anchor_models()
    except InvalidOptionError:
        anchors = {}
    if name in anchors:
        return anchors[name]
    raise InvalidOptionError(
        f"unknown model {name!r}: use reference, anchors, one of {', '.join(known + sorted(anchors))}, or MODULE:FACTORY"
    )

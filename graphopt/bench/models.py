"""Which models a benchmark run measures: ``reference``, ``anchors``, names, or user factories.

``reference`` is graphopt's small reference models (`graphopt.models.REFERENCE_MODELS`);
``anchors`` the full-size models graphopt is measured against
(`graphopt.models.ANCHOR_MODELS`, imported only when asked for). Any other entry of the
comma-separated selection is a model name from either (``reference.NAME`` or ``anchors.NAME`` where both have it:
``mobilenet_v2`` is a small 64x64 reference model and a full-size anchor, and the bare name is refused), or
``MODULE:FACTORY``, which the caller turns into a `BenchModel` (the command line builds it with ``--input`` shapes).
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
        else:
            models.append(from_reference(_model_named(entry), batch))
    if not models:
        raise InvalidOptionError("--models selects no model: give reference, anchors, model names or MODULE:FACTORY")
    return models


def _model_named(name: str) -> ReferenceModel:
    """The reference or anchor model ``name`` names (``reference.NAME``, ``anchors.NAME`` or a name only one of them has)."""
    try:
        anchors = anchor_models()
    except InvalidOptionError:
        anchors = {}
    group, _, short = name.rpartition(".")
    if group in ("reference", "anchors"):
        models = REFERENCE_MODELS if group == "reference" else anchors
        if short in models:
            return models[short]
    elif name in REFERENCE_MODELS and name in anchors:
        reference, anchor = REFERENCE_MODELS[name], anchors[name]
        raise InvalidOptionError(
            f"--models {name} names two models: the small reference model ({_per_sample(reference)} per sample) and the "
            f"full-size anchor ({_per_sample(anchor)}): say reference.{name} or anchors.{name}"
        )
    elif name in REFERENCE_MODELS:
        return REFERENCE_MODELS[name]
    elif name in anchors:
        return anchors[name]
    known = [f"reference.{n}" if n in anchors else n for n in sorted(REFERENCE_MODELS)]
    known += [f"anchors.{n}" if n in REFERENCE_MODELS else n for n in sorted(anchors)]
    raise InvalidOptionError(f"unknown model {name!r}: use reference, anchors, one of {', '.join(known)}, or MODULE:FACTORY")


def _per_sample(model: ReferenceModel) -> str:
    return "x".join(str(size) for size in model.input_shape[1:])

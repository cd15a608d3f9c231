"""graphopt.dynamic's pieces: which dimensions each option asks for, torch.export specs, and the second sizes."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from graphopt import dynamic
from graphopt.errors import InvalidOptionError

IDS, MASK, PIXELS = torch.zeros(4, 16, dtype=torch.long), torch.ones(4, 16), torch.randn(4, 3, 8, 8)
ARGS, NAMES = (IDS, MASK, PIXELS), ["input_ids", "attention_mask", "pixel_values"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("batch+sequence", ({0, 1}, {0, 1}, {0})),  # the float mask has the ids' length; 8 and 3 are not sequence sizes
        ("batch", ({0}, {0}, {0})),
        ("auto", ({0, 1}, {0, 1}, {0, 1, 2, 3})),
        (None, (set(), set(), set())),
        ({"pixel_values": {2: Dim.AUTO, 3: Dim("w")}}, (set(), set(), {2, 3})),
        ((None, [Dim.STATIC, Dim.DYNAMIC]), (set(), {1}, set())),
    ],
)
def test_requested_dimensions(value: object, expected: tuple[set[int], ...]) -> None:
    assert dynamic.requested(value, ARGS, NAMES) == tuple(map(frozenset, expected))


def test_a_batch_of_one_is_asked_for_but_other_sizes_of_one_are_not() -> None:
    assert dynamic.requested("auto", (torch.zeros(1, 1, 5),), ["x"]) == (frozenset({0, 2}),)


def test_nested_inputs_follow_their_spec_and_their_names() -> None:
    args = ((torch.zeros(2, 5), torch.zeros(2, 7)), {"scale": 1.0})
    request = dynamic.request(([None, {1: Dim.AUTO}], None), args, ["pair", "options"])
    assert request.dims == (frozenset(), frozenset({1}), frozenset())
    assert request.names == ("pair[0]", "pair[1]", "options['scale']")
    assert request.export == ([None, {1: Dim.AUTO}], None)


def test_the_policies_give_torch_export_auto_on_each_dimension() -> None:
    request = dynamic.request("batch+sequence", ARGS, NAMES)
    assert request.export == ({0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO})
    assert dynamic.request(None, ARGS, NAMES).export is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("seq", "use 'batch\\+sequence', 'batch', 'auto', None"),
        ({"ids": {1: Dim.AUTO}}, "names 'ids'.*did you mean 'input_ids'"),
        (({4: Dim.AUTO},), r"dimension \[4\] of a tensor of shape \[4, 16\]"),
        ((None, None, None, None), "4 entries for 3 example inputs"),
        (({1: "seq"}, 3), "dynamic_shapes for attention_mask is 3"),
    ],
)
def test_invalid_specs_say_what_to_give(value: object, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        dynamic.request(value, ARGS, NAMES)


def test_dynamic_batch_false_is_none_and_contradicting_it_is_refused() -> None:
    assert dynamic.resolve("auto", True) == "auto" and dynamic.resolve(dynamic.DEFAULT, False) is None
    with pytest.raises(InvalidOptionError, match="contradicts"):
        dynamic.resolve("auto", False)


@pytest.mark.parametrize(("size", "batch", "other"), [(8, True, 9), (1, True, 2), (16, False, 8), (224, False, 192), (6, False, 4), (3, False, 2), (2, False, 3), (512, False, 256)])
def test_second_sizes(size: int, batch: bool, other: int) -> None:
    assert dynamic.other_size(size, batch) == other


def test_dimensions_of_one_size_vary_together() -> None:
    dims = dynamic.requested("auto", ARGS, NAMES)
    assert dynamic.second_sizes(ARGS, dims) == {4: 5, 16: 8, 3: 2, 8: 4}
    tied = (torch.zeros(4, 4, dtype=torch.long),)  # a batch of 4 and a length of 4: one size, varied as a length
    assert dynamic.second_sizes(tied, dynamic.requested("batch+sequence", tied, ["ids"])) == {4: 2}
    assert dynamic.second_sizes(ARGS, dynamic.requested("batch", ARGS, NAMES)) == {4: 5}


def test_an_exported_graph_keeps_what_the_model_allows() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight  # ties x's last size to 8

    x = torch.randn(4, 6, 8)
    request = dynamic.request("auto", (x,), ["x"])
    gm = torch.export.export(Model(), (x,), dynamic_shapes=request.export, strict=False).module()
    assert dynamic.graph_dims(gm, (x,), request.dims) == (frozenset({0, 1}),)
    assert dynamic.describe(((frozenset({0, 1})),), ["x"]) == "x dims 0, 1" and dynamic.describe((frozenset(),), ["x"]) == "none"

"""Side effects of forward(): each found at its line, none for tensor-only code, undone after tracing."""

from __future__ import annotations

import collections
import cProfile
import inspect
import logging
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import prune

import graphopt
from graphopt.side_effects import SideEffect, preserved_user_objects, side_effects_message, state_writes, watch_side_effects

HISTORY: list[Any] = []
LOGGER = logging.getLogger("side_effects_test")


def line_of(function: Any, text: str) -> str:
    """``file:line`` of the first line of ``function``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(function)
    offset = next(index for index, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(inspect.unwrap(function))}:{start + offset}"


def effects_of(model: nn.Module, *args: Any) -> list[SideEffect]:
    """The side effects of ``model(*args)``, undone afterwards (these tests share module globals)."""
    with preserved_user_objects(model), watch_side_effects(model) as watch:
        model(*args)
    return watch.effects


def assert_effects(effects: list[SideEffect], expected: list[tuple[str, str]]) -> None:
    """``expected``: (description, ``file:line``) pairs; a path ends the same, relative or not."""
    assert len(effects) == len(expected), effects
    for effect, (what, where) in zip(effects, expected):
        assert effect.what == what
        assert effect.where and where.endswith(effect.where), (effect.where, where)


class Printing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        print("output shape", y.shape)
        return y


class GlobalHistory(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        HISTORY.append(x.shape[0])
        return x + 1


class AttributeList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.stats: dict[str, list[int]] = {"calls": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.losses.append(float(x.sum()))
        self.stats["calls"].append(1)
        return x - 1


class CallCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 3


class SeenShapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()  # the line is still found in the decorated function's source
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[tuple(x.shape)] = x.mean()
        return x.relu()


class Logged(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        LOGGER.info("forward on %s", tuple(x.shape))
        return x.sigmoid()


def closure_model() -> tuple[nn.Module, list[Any]]:
    shapes: list[Any] = []

    class Closure(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shapes.append(x.shape)
            return x.tanh()

    return Closure(), shapes


def test_print_is_reported_at_its_line() -> None:
    assert_effects(effects_of(Printing(), torch.randn(2, 3)), [("calls print", line_of(Printing.forward, "print("))])


def test_append_to_a_global_list() -> None:
    effects = effects_of(GlobalHistory(), torch.randn(2, 3))
    assert_effects(effects, [("appends to the list `HISTORY` (a global)", line_of(GlobalHistory.forward, "HISTORY.append"))])
    assert HISTORY == []  # undone by preserved_user_objects


def test_append_to_attribute_lists_also_nested() -> None:
    effects = effects_of(AttributeList(), torch.randn(2, 3))
    assert_effects(
        effects,
        [
            ("appends to the list `self.losses` of AttributeList", line_of(AttributeList.forward, "self.losses.append")),
            ("appends to the list `self.stats['calls']` of AttributeList", line_of(AttributeList.forward, 'self.stats["calls"]')),
        ],
    )


def test_counter_attribute_with_its_values() -> None:
    model = CallCounter()
    effects = effects_of(model, torch.randn(2, 3))
    assert_effects(effects, [("changes `self.calls` of CallCounter (0 -> 1)", line_of(CallCounter.forward, "self.calls += 1"))])
    assert model.calls == 0


def test_dict_attribute_write() -> None:
    effects = effects_of(SeenShapes(), torch.randn(2, 3))
    assert_effects(effects, [("writes into the dict `self.seen` of SeenShapes", line_of(SeenShapes.forward, "self.seen["))])


def test_submodule_attribute_is_named_by_its_path() -> None:
    model = nn.Sequential(nn.Linear(3, 3), CallCounter())
    effects = effects_of(model, torch.randn(2, 3))
    assert [effect.what for effect in effects] == ["changes `self.calls` of submodule '1' (CallCounter) (0 -> 1)"]


class PrunedChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = prune.l1_unstructured(nn.Linear(3, 3), "weight", amount=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.linear.calls = 1
        return self.linear(x)


def test_attributes_set_by_a_parent_count_those_set_by_torch_hooks_do_not() -> None:
    effects = effects_of(PrunedChild(), torch.randn(2, 3))  # pruning's hook sets linear.weight before each call
    assert_effects(effects, [("sets `self.calls` of submodule 'linear' (Linear) (to 1)", line_of(PrunedChild.forward, "self.linear.calls"))])


def test_logging_call() -> None:
    effects = effects_of(Logged(), torch.randn(2, 3))
    assert_effects(effects, [("logs with logger 'side_effects_test' (info)", line_of(Logged.forward, "LOGGER.info"))])


def test_closure_list() -> None:
    model, shapes = closure_model()
    effects = effects_of(model, torch.randn(2, 3))
    assert_effects(effects, [("appends to the list `shapes` (a closure variable)", line_of(type(model).forward, "shapes.append"))])
    assert shapes == []


NESTED: dict[str, dict[str, list[list[int]]]] = {"outer": {"inner": [[]]}}


class DeepAppend(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        NESTED["outer"]["inner"][0].append(x.shape[0])
        return x + 1


def test_append_to_a_list_three_levels_below_a_global() -> None:
    deepest = NESTED["outer"]["inner"][0]
    effects = effects_of(DeepAppend(), torch.randn(2, 3))
    expected = "appends to the list `NESTED['outer']['inner'][0]` (a global)"
    assert_effects(effects, [(expected, line_of(DeepAppend.forward, "NESTED["))])
    assert NESTED == {"outer": {"inner": [[]]}} and NESTED["outer"]["inner"][0] is deepest


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_optimize_reports_a_deeply_nested_append_and_leaves_the_list_alone(frontend: str) -> None:
    deepest = NESTED["outer"]["inner"][0]
    with pytest.warns(graphopt.SideEffectWarning, match="appends to the list `NESTED\\['outer'\\]\\['inner'\\]\\[0\\]` \\(a global\\)"):
        graphopt.optimize(DeepAppend().eval(), (torch.randn(2, 3),), frontend=frontend)
    assert NESTED == {"outer": {"inner": [[]]}} and NESTED["outer"]["inner"][0] is deepest  # no fx Proxy or SymInt left in it


CHAIN: list[Any] = [[]]  # 2000 lists, each the only item of the one before: deeper than Python's recursion limit
for _ in range(1999):
    CHAIN = [CHAIN]
CYCLE: list[Any] = []
CYCLE.append(CYCLE)


def _bottom_of_chain() -> list[Any]:
    link = CHAIN
    while link:
        link = link[0]
    return link


class ChainAndCycle(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _bottom_of_chain().append(x.shape[0])
        CYCLE[0][0].append(0)
        return x * 2


def test_nesting_of_any_depth_and_cycles_are_followed() -> None:
    bottom = _bottom_of_chain()
    effects = effects_of(ChainAndCycle(), torch.randn(2, 3))
    assert [effect.what for effect in effects] == [
        f"appends to the list `CHAIN{'[0]' * 2000}` (a global)",
        "appends to the list `CYCLE` (a global)",
    ]
    assert bottom == [] and _bottom_of_chain() is bottom and CYCLE == [CYCLE]


TOTAL = 0
COUNTS: collections.Counter[str] = collections.Counter()
RECENT: collections.deque[int] = collections.deque(maxlen=4)
NAMES: set[str] = set()


def record(name: str) -> None:
    NAMES.add(name)


class Everything(nn.Module):
    """One change of each kind the snapshot knows, some through a helper function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global TOTAL
        TOTAL += 1
        COUNTS["forward"] += 1
        RECENT.append(x.shape[0])
        record("x")
        self.last_shape = x.shape
        return x * 2


def test_globals_set_deque_counter_and_new_attribute() -> None:
    model = Everything()
    containers = (COUNTS, RECENT, NAMES)
    effects = effects_of(model, torch.randn(2, 3))
    forward = Everything.forward
    assert_effects(
        effects,
        [
            ("adds to the set `NAMES` (a global)", line_of(record, "NAMES.add")),  # source order: record() comes first
            ("changes `TOTAL` (a global) (0 -> 1)", line_of(forward, "TOTAL += 1")),
            ("writes into the Counter `COUNTS` (a global)", line_of(forward, "COUNTS[")),
            ("appends to the deque `RECENT` (a global)", line_of(forward, "RECENT.append")),
            ("sets `self.last_shape` of Everything (to torch.Size([2, 3]))", line_of(forward, "self.last_shape =")),
        ],
    )
    assert TOTAL == 0 and (dict(COUNTS), list(RECENT), NAMES) == ({}, [], set())  # all undone
    assert all(now is then for now, then in zip((COUNTS, RECENT, NAMES), containers))
    assert "last_shape" not in vars(model)


class LocalList(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for scale in range(3):
            outs.append(x * scale)
        parts = {"first": outs[0]}
        parts["last"] = outs[-1]
        return torch.cat([*outs, *parts.values()])


class StepBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x * self.steps


def test_containers_created_in_the_call_are_not_side_effects() -> None:
    assert effects_of(LocalList(), torch.randn(2, 3)) == []


def test_in_place_buffer_update_is_not_a_side_effect() -> None:
    model = StepBuffer()
    assert effects_of(model, torch.randn(2, 3)) == []
    assert float(model.steps) == 1.0  # the update happened; it is torch state, kept by the graph


class Decays(nn.Module):
    """Writes one buffer in place, another through a slice, and only reads a third."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("last", torch.zeros(3))
        self.register_buffer("bias", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        self.last[:] = x[0]
        out = x * 2
        out.add_(self.bias)
        return out


def test_state_writes_names_every_buffer_written_even_where_its_values_stay_the_same() -> None:
    model = Decays()
    assert state_writes(model, (torch.zeros(2, 3),)) == ["mean", "last"]  # zeros written over zeros
    assert state_writes(StepBuffer(), (torch.randn(2, 3),)) == ["steps"]
    assert state_writes(nn.Linear(3, 3), (torch.randn(2, 3),)) == []


def test_state_writes_puts_the_buffers_back() -> None:
    model = Decays()
    state_writes(model, (torch.randn(2, 3),))
    assert torch.equal(model.mean, torch.zeros(3)) and torch.equal(model.last, torch.zeros(3))


def test_torch_modules_alone_have_no_side_effects() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.1)).train()
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    assert effects_of(model, torch.randn(3, 4)) == []
    tokens = torch.randn(2, 5, 8)
    assert effects_of(attention, tokens, tokens, tokens) == []


class Warns(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.softmax(x)  # no dim: torch itself warns
        warnings.warn("forward saw a small batch")
        return y


def test_only_the_users_warnings_count() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        effects = effects_of(Warns(), torch.randn(2, 3))
    assert any("softmax" in str(warning.message) for warning in caught)  # torch did warn
    assert_effects(effects, [("calls warnings.warn", line_of(Warns.forward, "warnings.warn("))])


def test_repeated_calls_are_reported_once() -> None:
    model = nn.Sequential(Printing(), Printing())
    assert_effects(effects_of(model, torch.randn(2, 3)), [("calls print", line_of(Printing.forward, "print("))])


def test_a_previous_profile_function_is_restored() -> None:
    def previous(frame: Any, event: str, arg: Any) -> None:
        pass

    model = Printing()
    sys.setprofile(previous)
    try:
        with watch_side_effects(model) as watch:
            model(torch.randn(2, 3))
        assert sys.getprofile() is previous
        assert [effect.what for effect in watch.effects] == ["calls print"]
        with pytest.raises(RuntimeError, match="boom"), watch_side_effects(model) as watch:
            model(torch.randn(2, 3))
            raise RuntimeError("boom")
        assert sys.getprofile() is previous
        assert [effect.what for effect in watch.effects] == ["calls print"]
    finally:
        sys.setprofile(None)


def test_a_profiler_written_in_c_keeps_running() -> None:
    model = CallCounter()
    profile = cProfile.Profile()
    profile.enable()
    try:
        running = sys.getprofile()
        effects = effects_of(model, torch.randn(2, 3))
        assert sys.getprofile() is running
    finally:
        profile.disable()
    assert_effects(effects, [("changes `self.calls` of CallCounter (0 -> 1)", line_of(CallCounter.forward, "self.calls += 1"))])


LEAKS: list[Any] = ["before"]


class Leaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.sizes: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        LEAKS.append(x.shape[0])
        LEAKS.append(x)
        self.calls += 1
        self.sizes.append(x.shape[0])
        return x.relu()


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_tracing_leaves_nothing_in_user_objects(frontend: str) -> None:
    model, leaks = Leaky(), LEAKS
    sizes = model.sizes
    example = torch.randn(2, 3)
    with preserved_user_objects(model):
        if frontend == "fx":
            graph_module = fx.symbolic_trace(model)
        else:
            dynamic_batch = ({0: torch.export.Dim.AUTO},)
            graph_module = torch.export.export(model, (example,), dynamic_shapes=dynamic_batch, strict=False).module()
        assert any(isinstance(value, (fx.Proxy, torch.SymInt)) for value in LEAKS)  # the trace did leak
    assert LEAKS is leaks and LEAKS == ["before"]
    assert model.sizes is sizes and sizes == [] and model.calls == 0
    bigger = torch.randn(4, 3)
    torch.testing.assert_close(graph_module(bigger), bigger.relu())


def test_message_lists_each_effect_and_what_to_do() -> None:
    effects = effects_of(nn.Sequential(Printing(), CallCounter()), torch.randn(2, 3))
    message = side_effects_message(effects, "Sequential")
    assert all(str(effect) in message for effect in effects) and len(effects) == 2
    assert "register_forward_hook" in message and "original model" in message
    assert side_effects_message([]) == ""

"""The pipeline: presets, pass resolution, node bookkeeping, and blame on a wrong pass."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import graphopt
from graphopt.passes import REGISTRY, PassContext, PassInfo, PassResult
from graphopt.passes.base import finish
from graphopt.pipeline import PRESETS, resolve_passes
from graphopt.report import PassReport
from tests.conftest import FRONTENDS, assert_same_outputs


def corrupt_adds(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """A deliberately wrong pass: turns every add into a subtraction."""
    report = PassReport("corrupt_adds")
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (operator.add, torch.add):
            node.target = operator.sub
            report.rewrite(node, "add -> sub")
    return finish(gm, bool(report.rewrites), report)


def break_graph(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """A deliberately broken pass: leaves a node reading a value defined after it."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes[0].args = (nodes[-1], *nodes[0].args[1:])
    return PassResult(gm, True, PassReport("break_graph"))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + x


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch):
    def register(function, name: str) -> None:
        monkeypatch.setitem(REGISTRY, name, PassInfo(name, function, ("inference",), "test pass", exact=False))

    return register


def test_presets_are_ordered_and_resolved() -> None:
    assert [p.name for p in resolve_passes("inference", None, ())] == list(PRESETS["inference"])
    assert [p.name for p in resolve_passes("training", None, ())] == list(PRESETS["training"])
    assert [p.name for p in resolve_passes("inference", None, ["remove_dropout"])] == [n for n in PRESETS["inference"] if n != "remove_dropout"]
    explicit = resolve_passes("inference", ["fold_conv_bn", "remove_dropout"], ())
    assert [p.name for p in explicit] == ["fold_conv_bn", "remove_dropout"]


def test_wrong_pass_raises_verification_error_when_strict_and_leaves_model_alone(registered) -> None:
    registered(corrupt_adds, "corrupt_adds")
    model = Residual().eval()
    weight = model.linear.weight.detach().clone()
    with pytest.raises(graphopt.VerificationError) as info:
        graphopt.optimize(model, torch.randn(3, 4), passes=["corrupt_adds"], verify="strict")
    error = info.value
    assert error.pass_name == "corrupt_adds" and error.max_error > 1e-3
    message = str(error)
    assert "pass 'corrupt_adds' changed output" in message
    assert "add -> sub" in message and "disable=['corrupt_adds']" in message
    assert torch.equal(model.linear.weight, weight)


def test_wrong_pass_is_rolled_back_loudly_and_the_others_stand(registered) -> None:
    registered(corrupt_adds, "corrupt_adds")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), Residual()).eval()
    with pytest.warns(graphopt.VerificationWarning, match="rolled back pass 'corrupt_adds'.*add -> sub.*verify='strict'"):
        optimized = graphopt.optimize(model, torch.randn(3, 3, 6, 6), passes=["fold_conv_bn", "corrupt_adds"])
    report = optimized.graphopt_report
    assert report["fold_conv_bn"].rewrites and not report["fold_conv_bn"].rolled_back
    assert "changed output on the example inputs" in report["corrupt_adds"].rolled_back
    assert any("'corrupt_adds' was rolled back" in warning for warning in report.warnings)
    assert "rolled back" in str(report)
    assert not any(node.target is operator.sub for node in optimized.graph.nodes)
    assert_same_outputs(model, optimized, (torch.randn(3, 3, 6, 6),))


def corrupt_adds_deciding_on(dim: int, name: str):
    """A pass that decides from the example's size of ``dim``: right at that size, wrong at any other."""

    def corrupt(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        report = PassReport(name)
        size = ctx.example_inputs[0].shape[dim]
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in (operator.add, torch.add, torch.ops.aten.add.Tensor):
                with gm.graph.inserting_after(node):
                    wrong = gm.graph.call_function(_add_if_size, (*node.args, dim, size))
                node.replace_all_uses_with(wrong)
                wrong.args = (*node.args, dim, size)
                report.rewrite(node, f"add decided from the example's size of dim {dim}")
        return finish(gm, bool(report.rewrites), report)

    return corrupt


def _add_if_size(a: torch.Tensor, b: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    return a + b if a.shape[dim] == size else a - b


torch.fx.wrap("_add_if_size")
corrupt_adds_on_other_batches = corrupt_adds_deciding_on(0, "corrupt_adds_on_other_batches")
corrupt_adds_on_other_lengths = corrupt_adds_deciding_on(1, "corrupt_adds_on_other_lengths")


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_pass_right_only_on_the_example_is_caught_by_the_second_input(registered, frontend: str) -> None:
    registered(corrupt_adds_on_other_batches, "corrupt_adds_on_other_batches")
    model = Residual().eval()
    with pytest.raises(graphopt.VerificationError, match="the optimized graph changed output on a second input \\(batch 4"):
        graphopt.optimize(model, torch.randn(3, 4), passes=["corrupt_adds_on_other_batches"], frontend=frontend, verify="strict")
    with pytest.warns(graphopt.VerificationWarning, match="rolled back pass 'corrupt_adds_on_other_batches'.*second input"):
        optimized = graphopt.optimize(model, torch.randn(3, 4), passes=["corrupt_adds_on_other_batches"], frontend=frontend)
    assert optimized.graphopt_report["corrupt_adds_on_other_batches"].rolled_back
    assert_same_outputs(model, optimized, (torch.randn(3, 4),))


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        return hidden + hidden.cumsum(1)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_pass_right_only_at_the_example_length_is_caught_at_a_second_length(registered, frontend: str) -> None:
    """Sequence lengths may vary (dynamic_shapes' default), so the second input has another one; a batch alone would miss this."""
    registered(corrupt_adds_on_other_lengths, "corrupt_adds_on_other_lengths")
    ids = torch.randint(0, 16, (3, 6))
    with pytest.raises(graphopt.VerificationError, match="second input \\(batch 4 \\(example: 3\\), size 4 \\(example: 6\\)"):
        graphopt.optimize(Tokens().eval(), ids, passes=["corrupt_adds_on_other_lengths"], frontend=frontend, verify="strict")
    fixed_length = graphopt.optimize(Tokens().eval(), ids, passes=["corrupt_adds_on_other_lengths"], frontend=frontend, dynamic_shapes="batch")
    assert not fixed_length.graphopt_report["corrupt_adds_on_other_lengths"].rolled_back  # right for every call it accepts


def test_verify_option_is_checked() -> None:
    with pytest.raises(graphopt.InvalidOptionError, match="verify='yes'.*'strict'"):
        graphopt.optimize(Residual().eval(), torch.randn(3, 4), verify="yes")


def test_wrong_pass_goes_unnoticed_only_without_verify(registered) -> None:
    registered(corrupt_adds, "corrupt_adds")
    model = Residual().eval()
    optimized = graphopt.optimize(model, torch.randn(3, 4), passes=["corrupt_adds"], verify=False)
    assert optimized.graphopt_report["corrupt_adds"].max_error is None


def test_invalid_graph_is_blamed_on_its_pass(registered) -> None:
    registered(break_graph, "break_graph")
    with pytest.raises(graphopt.GraphoptError, match="pass 'break_graph' produced an invalid graph"):
        graphopt.optimize(Residual().eval(), torch.randn(3, 4), passes=["break_graph"])


def test_created_and_erased_nodes_are_recorded_per_pass() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Dropout()).eval()
    report = graphopt.optimize(model, torch.randn(2, 3, 6, 6), frontend="export").graphopt_report
    dropout, fold = report["remove_dropout"], report["fold_conv_bn"]
    assert [c.target for c in dropout.erased] == ["aten.dropout.default"]
    assert "aten.batch_norm.default" in [c.target for c in fold.erased]
    # the bias-free conv receives a bias: one new get_attr node
    assert [(c.op, c.target) for c in fold.created] == [("get_attr", "0.bias")]


def test_pass_that_changes_nothing_is_not_verified_again() -> None:
    model = nn.Sequential(nn.Linear(3, 3)).eval()
    report = graphopt.optimize(model, torch.randn(2, 3)).graphopt_report
    assert all(not p.modified and p.max_error == 0.0 for p in report.passes)

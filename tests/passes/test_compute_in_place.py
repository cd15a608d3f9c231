"""compute_in_place: structure, numerics on inputs other than the example, and every aliasing, shape and dtype guard."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphopt
from graphopt.passes.compute_in_place import add_into, compute_in_place, div_into, mul_into
from graphopt.pipeline import cpu_kernel_passes
from graphopt.runtime.onednn import OneDNNConv
from tests.conftest import FRONTENDS, captured, context

IN_PLACE = {add_into, mul_into, div_into}


def in_place_ops(gm) -> list:
    return [node for node in gm.graph.nodes if node.target in IN_PLACE]


def other_input(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Fresh values, another batch size, other strides than ``x``.

    Contiguous when ``x`` is not, else channels_last (4-D) or with its last two dims swapped in memory.
    """
    fresh = torch.randn(batch, *x.shape[1:]).to(x.dtype)
    if not x.is_contiguous():
        return fresh
    if x.dim() == 4:
        return fresh.to(memory_format=torch.channels_last)
    return fresh.transpose(-1, -2).contiguous().transpose(-1, -2)


def rewrite(model: nn.Module, inputs: tuple, frontend: str, rewritten: int, others: list[tuple] | None = None):
    """Run the pass; check the outputs are exactly eager's, the inputs unchanged, then the rewrite count.

    The outputs and inputs are checked on the example and on ``others`` (by default: `other_input`, one more in the batch).
    """
    model = model.eval()
    gm = captured(model, inputs, frontend)
    result = compute_in_place(gm, context(inputs))
    if others is None:
        others = [tuple(other_input(x, x.shape[0] + 1) for x in inputs)]
    for args in [inputs, *others]:
        with torch.inference_mode():
            expected = model(*args)
            kept = [x.clone() for x in args]
            actual = gm(*args)
        for want, got in zip(expected if isinstance(expected, tuple) else (expected,), actual if isinstance(actual, tuple) else (actual,)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        for before, x in zip(kept, args):
            torch.testing.assert_close(x, before, rtol=0, atol=0)
    assert len(result.report.rewrites) == rewritten and len(in_place_ops(gm)) == rewritten, result.report
    return gm, result.report


def reasons(report) -> str:
    return " | ".join(skip.reason for skip in report.skips)


# ----------------------------------------------------------------------------- the intended patterns


class SqueezeExcitation(nn.Module):
    """EfficientNet's pattern: the activation is read by the pool, then multiplied last by the channel weights.

    ``activation``: "relu" (relu(conv(x))) or "silu" (silu(bn(conv(x)))); ``modules``: nn modules or functions.
    """

    def __init__(self, activation: str, modules: bool) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1)
        self.act, self.pool, self.gate = nn.ReLU() if activation == "relu" else nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Sigmoid()
        self.activation, self.modules_form = activation, modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x) if self.activation == "relu" else self.bn(self.conv(x))
        if self.modules_form:
            y = self.act(y)
            return y * self.gate(self.fc(self.pool(y)))
        y = torch.relu(y) if self.activation == "relu" else F.silu(y)
        return y * torch.sigmoid(self.fc(y.mean((2, 3), keepdim=True)))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize(("activation", "modules"), [("relu", False), ("relu", True), ("silu", False), ("silu", True)])
def test_squeeze_excitation_multiply_writes_into_the_dead_activation(frontend: str, activation: str, modules: bool) -> None:
    model = SqueezeExcitation(activation, modules)
    x = torch.randn(2, 3, 8, 8)
    gm, report = rewrite(model, (x,), frontend, rewritten=1)
    assert "mul computed in place" in report.rewrites[0].detail
    y = other_input(x, 3)  # channels_last: the in-place result keeps the activation's layout, as the multiply did
    with torch.inference_mode():
        assert gm(y).stride() == model(y).stride()


class Residual(nn.Module):
    """ResNet's adds: a conv branch plus another conv's output, then plus the block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x))
        z = torch.relu(self.bn(self.conv2(y)) + y)
        return z + x


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_residual_adds_write_into_the_branch(frontend: str) -> None:
    _, report = rewrite(Residual(), (torch.randn(2, 4, 6, 6),), frontend, rewritten=2)
    assert all("add computed in place" in r.detail for r in report.rewrites)


# ----------------------------------------------------------------------------- memory guards


class ReshapeThenMultiply(nn.Module):
    """The reported bug: ``reshape`` copies a transposed ``y`` but is a view of a contiguous one, read after ``y * 2``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(x)
        z = y.reshape(-1)
        w = y * 2
        return w, z.sum()


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_reshape_that_may_be_a_view_is_not_overwritten_whatever_the_example_strides(frontend: str) -> None:
    _, report = rewrite(ReshapeThenMultiply(), (torch.randn(4, 3).t(),), frontend, rewritten=0, others=[(torch.randn(5, 4),)])
    assert "may share memory with reshape, which is read after this op" in reasons(report)


def test_the_reported_reproduction_through_optimize() -> None:
    optimized = graphopt.optimize(ReshapeThenMultiply().eval(), (torch.randn(4, 3).t(),), passes=["compute_in_place"])
    x = torch.randn(3, 4)
    torch.testing.assert_close(optimized(x)[1], ReshapeThenMultiply()(x)[1], rtol=0, atol=0)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_operand_read_later_is_not_written(frontend: str) -> None:
    class ReadLater(nn.Module):
        """``y * 2`` cannot write into ``y`` (the add reads it later); the add can write into ``y * 2``."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.conv(x))
            return y * 2 + y

    _, report = rewrite(ReadLater(), (torch.randn(2, 4, 6, 6),), frontend, rewritten=1)
    (skip,) = report.skips
    assert "is read after this op" in skip.reason


class ViewsOfTheInput(nn.Module):
    """Every operand is the input or may be a view of it: a view, an index, a transpose, eval dropout, an identity."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout, self.identity = nn.Dropout(0.5), nn.Identity()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.view(-1) * 2, x[0] + 1, x.t() / 3, self.dropout(x) * 4, self.identity(x) + 5, x * 6


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_inputs_and_their_views_are_never_written(frontend: str) -> None:
    _, report = rewrite(ViewsOfTheInput(), (torch.randn(3, 4),), frontend, rewritten=0, others=[(torch.randn(5, 4),)])
    assert len(report.skips) == 6
    assert "may share memory with x, an input or stored tensor" in reasons(report)


class InputAndStored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 2) + self.offset, x + self.offset


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_inputs_stored_tensors_and_outputs_are_never_written(frontend: str) -> None:
    _, report = rewrite(InputAndStored(), (torch.randn(3, 4),), frontend, rewritten=1)  # only x * 2 dies at its add
    assert "not a value computed in the graph" in reasons(report)


class ViewChain(nn.Module):
    """``v`` may be a view of ``y`` through reshape, flatten, an index, eval dropout and an identity.

    ``write_view``: multiply ``v`` while ``y`` is read later; else multiply ``y`` while ``v`` is read later.
    """

    def __init__(self, write_view: bool) -> None:
        super().__init__()
        self.flatten, self.dropout, self.identity = nn.Flatten(), nn.Dropout(0.5), nn.Identity()
        self.write_view = write_view

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(x)
        v = self.identity(self.dropout(self.flatten(y.reshape(y.shape[0], 3, -1))[0]))
        return (v * 2, y.sum()) if self.write_view else (y * 2, v.sum())


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("write_view", [False, True], ids=["write-base", "write-view"])
def test_a_view_chain_keeps_both_ends_alive(frontend: str, write_view: bool) -> None:
    _, report = rewrite(ViewChain(write_view), (torch.randn(2, 3, 4, 4),), frontend, rewritten=0)
    assert "which is read after this op" in reasons(report)


class ViewStillNeeded(nn.Module):
    """``y = a.unsqueeze(0)`` is read after ``a * 3``: writing into ``a`` would change ``y``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x + 1
        y = a.unsqueeze(0)
        b = a * 3
        return b, y.sum()


class ViewOfDeadValue(nn.Module):
    """A permuted view of a value nothing else reads: writing through it is safe."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x)
        return a.permute(0, 2, 1) * 2


class Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        return a * a


class TimesItsTranspose(nn.Module):
    """The other operand is a view of the written one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        return a * a.transpose(1, 2)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize(
    ("model", "rewritten", "reason"),
    [
        (ViewStillNeeded(), 0, "may share memory with"),
        (ViewOfDeadValue(), 1, None),
        (Twice(), 0, "both operands are the same value"),
        (TimesItsTranspose(), 0, "may share memory with exp"),
    ],
    ids=["view-still-needed", "view-of-dead-value", "same-value", "other-is-a-view"],
)
def test_memory_guards(frontend: str, model: nn.Module, rewritten: int, reason: str | None) -> None:
    _, report = rewrite(model, (torch.randn(2, 4, 4),), frontend, rewritten=rewritten)
    if reason is not None:
        assert reason in reasons(report)


# ----------------------------------------------------------------------------- shape and dtype guards


class Broadcast(nn.Module):
    """``small + big``: the result is larger than ``small``, and ``big`` is the model's input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0, keepdim=True) + x


class Promotes(nn.Module):
    """An int tensor times a float: the result's dtype is not the operand's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1, keepdim=True) * 0.5


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("model", [Broadcast(), Promotes()], ids=["broadcast", "promotes"])
def test_a_result_that_never_fits_the_operand_is_left_alone(frontend: str, model: nn.Module) -> None:
    _, report = rewrite(model, (torch.randn(3, 4, 5),), frontend, rewritten=0)
    assert "does not have" in reasons(report)


class ChannelWeights(nn.Module):
    """``sigmoid(w) * relu(x)`` with ``w`` of shape (1, C): it holds the result only for a batch of 1."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.Parameter(torch.randn(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.weights) * torch.relu(x)


def test_a_broadcast_operand_that_fits_the_example_batch_is_checked_at_run_time() -> None:
    # fx records the example's batch of 1: the multiply writes into sigmoid(w) only when the call's batch is 1 too
    _, report = rewrite(ChannelWeights(), (torch.randn(1, 4),), "fx", rewritten=1, others=[(torch.randn(4, 4),), (torch.randn(4, 3).t(),)])
    assert "into sigmoid" in report.rewrites[0].detail


def test_export_sees_the_dynamic_batch_and_writes_into_the_full_size_operand() -> None:
    _, report = rewrite(ChannelWeights(), (torch.randn(2, 4),), "export", rewritten=1, others=[(torch.randn(5, 4),), (torch.randn(4, 3).t(),)])
    assert "into relu" in report.rewrites[0].detail


class AbsHalf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs() * 0.5


def test_a_dtype_promoted_at_run_time_is_computed_out_of_place() -> None:
    # float on the example: written in place; an int input makes abs() an int tensor that cannot hold x * 0.5
    rewrite(AbsHalf(), (torch.randn(3, 4),), "fx", rewritten=1, others=[(torch.randint(-5, 5, (2, 4)),)])


class Expanded(nn.Module):
    """An expanded view stores one element for many: writing into it would be wrong (PyTorch refuses)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x[:, :1]).expand(-1, 4) * 2


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_an_overlapping_operand_is_computed_out_of_place(frontend: str) -> None:
    rewrite(Expanded(), (torch.randn(3, 4),), frontend, rewritten=1)


@pytest.mark.parametrize(
    ("make_operand", "other", "in_place"),
    [
        (lambda: torch.randn(4, 3), torch.randn(3), True),
        (lambda: torch.randn(4, 3).t(), torch.randn(4), True),
        (lambda: torch.randn(4, 3), 2, True),
        (lambda: torch.randn(1, 3), torch.randn(4, 3), False),  # broadcast to a larger shape
        (lambda: torch.randn(3), torch.randn(4, 3), False),  # to more dims
        (lambda: torch.ones(4, 3, dtype=torch.int64), 0.5, False),  # promoted
        (lambda: torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(4, 3), False),  # promoted
        (lambda: torch.randn(4, 1).expand(4, 3), torch.randn(4, 3), False),  # one element stored for three
    ],
    ids=["broadcast-other", "transposed", "scalar", "larger", "more-dims", "int-by-float", "bf16-by-fp32", "expanded"],
)
def test_run_time_helpers_write_into_the_operand_only_when_it_holds_the_result(make_operand, other, in_place: bool) -> None:
    for helper, op in ((add_into, torch.add), (mul_into, torch.mul), (div_into, torch.div)):
        operand = make_operand()
        before = operand.clone()
        expected = op(operand, other)
        result = helper(operand, other)
        torch.testing.assert_close(result, expected, rtol=0, atol=0)
        assert (result.data_ptr() == operand.data_ptr()) is in_place
        if not in_place:
            torch.testing.assert_close(operand, before, rtol=0, atol=0)


# ----------------------------------------------------------------------------- in the pipeline


def test_optimize_runs_it_last_and_keeps_onednn_residual_fusions() -> None:
    model = nn.Sequential(SqueezeExcitation("relu", modules=False), nn.Conv2d(8, 8, 1)).eval()
    x = torch.randn(2, 3, 16, 16)
    asked_first = ["compute_in_place", *(name for name in cpu_kernel_passes("fp32", "channels_last") if name != "compute_in_place")]
    optimized = graphopt.optimize(model, (x,), memory_format="channels_last", passes=asked_first)
    assert [p.name for p in optimized.graphopt_report.passes][-3:] == ["use_onednn_kernels", "use_onednn_linear", "compute_in_place"]
    assert len(in_place_ops(optimized.graph_module)) == 1
    for args in (x, torch.randn(3, 3, 16, 16)):
        torch.testing.assert_close(optimized(args), model(args), rtol=1e-5, atol=1e-5)
    fused = graphopt.optimize(model, (x,), memory_format="channels_last", fuse="inductor")
    assert "compute_in_place" not in [p.name for p in fused.graphopt_report.passes], "with fuse= the compiler plans buffers"


class ConvPlusInput(nn.Module):
    """A residual add. forward() has no annotations: fx cannot pickle them as ``from __future__`` strings."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return torch.relu(self.conv(x)) + x


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_the_rewritten_module_copies_and_pickles(frontend: str) -> None:
    model, x = ConvPlusInput().eval(), torch.randn(2, 3, 8, 8)
    gm, _ = rewrite(model, (x,), frontend, rewritten=1)
    expected = model(x)
    torch.testing.assert_close(copy.deepcopy(gm)(x), expected, rtol=0, atol=0)
    if frontend == "fx":  # torch.export's modules do not pickle, with or without this pass
        buffer = io.BytesIO()
        torch.save(gm, buffer)
        buffer.seek(0)
        torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------- oneDNN conv + residual add


class Bottleneck(nn.Module):
    """ResNet's block: the residual add follows the last conv; the block input is read by the first conv before."""

    def __init__(self, reads_input_after: bool = False) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.reads_input_after = reads_input_after

    def forward(self, x: torch.Tensor):
        x = torch.relu(x * 2)  # computed in the graph: the add may write into it
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))) + x)
        return (y, x.sum()) if self.reads_input_after else y


class ConvAddInput(nn.Module):
    """A residual add of the model's input (the caller's memory, or its channels_last conversion, which may be it), which the conv
    reads too (``conv_reads_it``) or not."""

    def __init__(self, conv_reads_it: bool) -> None:
        super().__init__()
        self.conv, self.conv_reads_it = nn.Conv2d(8, 8, 3, padding=1), conv_reads_it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x if self.conv_reads_it else torch.relu(x)) + x)


def conv_adds(module: nn.Module) -> list[OneDNNConv]:
    return [m for m in module.modules() if isinstance(m, OneDNNConv) and m.binary]


def test_a_fused_residual_add_accumulates_into_its_dead_operand() -> None:
    model, x = Bottleneck().eval(), torch.randn(2, 8, 8, 8)
    fast = graphopt.optimize(model, (x,), memory_format="channels_last", passes=cpu_kernel_passes("fp32", "channels_last"))
    report = fast.graphopt_report["compute_in_place"]
    assert [m.into_other for m in conv_adds(fast)] == [True]
    assert report.rewrites[0].detail.startswith("conv + add accumulates into ")
    for args in (x, torch.randn(3, 8, 8, 8), torch.randn(5, 8, 8, 8).to(memory_format=torch.channels_last)):
        kept = args.clone()
        with torch.inference_mode():
            torch.testing.assert_close(fast(args), model(args), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fast(args), model(args), rtol=1e-5, atol=1e-5)  # twice: nothing it reads was overwritten
        assert torch.equal(args, kept), "the input is never written"


@pytest.mark.parametrize(
    "model, reason",
    [
        (Bottleneck(reads_input_after=True), "is read after this op"),
        (ConvAddInput(conv_reads_it=False), "not a value computed in the graph"),
        (ConvAddInput(conv_reads_it=True), "both operands are the same value"),
    ],
)
def test_a_residual_operand_read_later_or_given_by_the_caller_is_not_written(model: nn.Module, reason: str) -> None:
    x = torch.randn(2, 8, 8, 8)
    fast = graphopt.optimize(model.eval(), (x,), memory_format="channels_last", passes=cpu_kernel_passes("fp32", "channels_last"))
    assert conv_adds(fast) and not any(m.into_other for m in conv_adds(fast))
    assert reason in " | ".join(skip.reason for skip in fast.graphopt_report["compute_in_place"].skips)
    y = torch.randn(3, 8, 8, 8).to(memory_format=torch.channels_last)  # converting it to channels_last returns it
    kept = y.clone()
    with torch.inference_mode():
        expected, actual = model(y), fast(y)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, kept)


def test_a_conv_module_called_at_two_places_is_left_alone() -> None:
    conv = OneDNNConv(torch.randn(4, 4, 1, 1), None, [0, 0], [1, 1], [1, 1], 1, [2, 4, 6, 6], binary=True)
    root = nn.Module()
    root.conv = conv
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a, b = graph.call_function(torch.relu, (x,)), graph.call_function(torch.sigmoid, (x,))
    first = graph.call_module("conv", (x, a))
    second = graph.call_module("conv", (first, b))
    graph.output(second)
    gm = torch.fx.GraphModule(root, graph)
    inputs = (torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last),)
    result = compute_in_place(gm, context(inputs))
    assert not conv.into_other and [s.reason for s in result.report.skips] == ["the module runs at more than one place"] * 2


@pytest.mark.parametrize(
    "make_other, in_place",
    [
        (lambda shape: torch.randn(shape).to(memory_format=torch.channels_last), True),
        (lambda shape: torch.randn(shape), False),  # NCHW: not the layout oneDNN writes for a channels_last input
        (lambda shape: torch.randn(shape, dtype=torch.float64).to(memory_format=torch.channels_last), False),
        (lambda shape: torch.randn(shape[0], shape[1], 1, 1).expand(shape), False),  # each element stored once: no
    ],
)
def test_the_conv_module_accumulates_only_into_an_operand_that_holds_the_result(make_other, in_place: bool) -> None:
    weight, bias = torch.randn(6, 4, 3, 3), torch.randn(6)
    conv = OneDNNConv(weight, bias, [1, 1], [2, 2], [1, 1], 1, [2, 4, 9, 9], binary=True)
    conv.into_other = True
    x = torch.randn(2, 4, 9, 9).to(memory_format=torch.channels_last)
    other = make_other((2, 6, 5, 5))
    before = other.clone()
    with torch.inference_mode():
        expected = F.conv2d(x, weight, bias, stride=2, padding=1) + before
        try:
            result = conv(x, other)
        except RuntimeError:  # oneDNN refuses a float64 operand out of place too: never a silent in-place write
            assert not in_place and other.dtype == torch.float64
            return
    torch.testing.assert_close(result, expected.to(result.dtype), rtol=1e-5, atol=1e-5)
    assert (result.data_ptr() == other.data_ptr()) is in_place
    if not in_place:
        assert torch.equal(other, before), "an operand that cannot hold the result is left as it was"

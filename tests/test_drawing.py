"""The drawn diff: the merged graph's nodes and edges, folding, replaced modules, the side-by-side rows."""

from __future__ import annotations

import contextlib
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphopt
from graphopt.diff import GraphDiff, NodeInfo
from graphopt import drawing as drawing_module
from graphopt.drawing import MAX_BOXES, draw
from tests.conftest import FRONTENDS, randomize_batch_norms

SVG = "{http://www.w3.org/2000/svg}"


class ConvBN(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    """A block the fold changes and a head it leaves alone (two linears, so the head folds)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBN()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def fold_diff(model: nn.Module, frontend: str = "fx") -> GraphDiff:
    module = graphopt.optimize(randomize_batch_norms(model).eval(), torch.randn(2, 4, 4, 4), passes=["fold_conv_bn"], frontend=frontend)
    return module.graphopt_report.diffs["fold_conv_bn"]


def nodes_of(svg: str) -> dict[str, ElementTree.Element]:
    """The drawn nodes by name; parsing also checks the SVG is well-formed XML."""
    root = ElementTree.fromstring(svg)
    return {g.get("data-name"): g for g in root.iter(f"{SVG}g") if "node" in (g.get("class") or "").split()}


def classes(node: ElementTree.Element) -> set[str]:
    return set((node.get("class") or "").split())


def texts(node: ElementTree.Element) -> list[str]:
    return [t.text or "" for t in node.iter(f"{SVG}text")]


def edges(svg: str) -> list[ElementTree.Element]:
    return list(ElementTree.fromstring(svg).iter(f"{SVG}path"))[1:]  # the first path is the arrow head


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_the_removed_batchnorm_is_drawn_beside_the_conv_it_was_folded_into(frontend: str) -> None:
    diff = fold_diff(Net(), frontend)
    svg = diff.draw(fold="none").svg
    nodes = nodes_of(svg)
    ops = {name: texts(node)[1] for name, node in nodes.items()}  # line 2 of a node: its op
    batch_norm = next(name for name, op in ops.items() if op in ("BatchNorm2d", "aten.batch_norm.default"))
    conv = next(name for name, op in ops.items() if op in ("Conv2d", "aten.conv2d.default"))
    assert classes(nodes[batch_norm]) == {"node", "removed"} and classes(nodes[conv]) == {"node", "changed"}
    assert any(text.startswith("folded") and "into conv2d" in text for text in texts(nodes[conv]))  # the reason, beside it
    assert "removed by fold_conv_bn" in texts(nodes[batch_norm])
    assert any(t.endswith("4, 4, 4] float32") for t in texts(nodes[conv]))  # shape and dtype on the node
    tooltip = nodes[conv].find(f"{SVG}title").text
    assert "changed" in tooltip and "folded" in tooltip
    if frontend == "export":  # weight reads are no nodes of their own: the reader lists them
        assert all("get_attr" not in texts(node) for node in nodes.values())
        assert "reads block.conv.weight" in tooltip
    # a chain, plus the detour the graph before took: conv -> bn -> relu (dashed, removed) beside conv -> relu
    dashed = [edge for edge in edges(svg) if edge.get("class") == "removed"]
    assert len(dashed) == 2 and len(edges(svg)) == len(nodes)


def test_an_unchanged_module_folds_into_one_box_and_expand_opens_it() -> None:
    diff = fold_diff(Net())
    folded = diff.draw()
    assert folded.folded == ["head"]
    head = nodes_of(folded.svg)["/head"]
    assert classes(head) == {"node", "folded"} and texts(head) == ["head", "4 nodes folded", "unchanged"]
    assert "block_bn" in nodes_of(folded.svg)  # the changed block stays open
    opened = diff.draw(expand=["head"])
    assert opened.folded == [] and {"head_1", "head_3"} <= set(nodes_of(opened.svg))
    assert diff.draw(fold="none").boxes == opened.boxes == folded.boxes + 3
    with pytest.raises(graphopt.GraphoptError, match="fold='some' is not one of 'auto', 'unchanged', 'none'"):
        diff.draw(fold="some")


def test_a_graph_too_large_to_read_folds_its_modules_with_what_changed_inside() -> None:
    model = nn.Sequential(*[ConvBN() for _ in range(40)])
    diff = fold_diff(model)
    drawing = diff.draw()
    assert drawing.boxes <= MAX_BOXES and len(drawing.folded) == 40
    boxes = nodes_of(drawing.svg)
    assert texts(boxes["/7"]) == ["7", "3 nodes folded", "-1 removed, ~1 changed"] and classes(boxes["/7"]) == {"node", "folded-changed"}
    assert len(edges(drawing.svg)) == 41  # the chain, box to box: inner edges are not drawn
    assert diff.draw(fold="unchanged").boxes == diff.draw(fold="none").boxes == 2 + 40 * 3


def _node(name: str, target: str, where: str, inputs: tuple[str, ...] = (), op: str = "call_module") -> NodeInfo:
    return NodeInfo(name, op, target, where, inputs)


def test_a_module_replaced_at_the_same_path_is_one_changed_node() -> None:
    """Passes that swap a module (Conv2d -> OneDNNConv) keep its path, not its node name."""
    x = _node("x", "x", "x", op="placeholder")
    before = [x, _node("conv", "Conv2d", "layer.conv", ("x",)), _node("act", "ReLU", "act", ("conv",)), _node("out", "output", "out", ("act",), "output")]
    after = [x, _node("conv_1", "OneDNNConv", "layer.conv", ("x",)), _node("out", "output", "out", ("conv_1",), "output")]
    diff = GraphDiff("swap", before, after, {"conv": "folded bn", "conv_1": "conv2d + relu -> oneDNN"})
    assert diff.pairs == {"x": "x", "out": "out", "conv_1": "conv"}
    assert [n.name for n in diff.removed] == ["act"] and diff.added == [] and [n.name for n in diff.changed] == ["conv_1"]
    assert diff.why(after[1]) == "folded bn; conv2d + relu -> oneDNN"  # both names' rewrites, in order
    nodes = nodes_of(draw(diff, fold="none").svg)
    assert set(nodes) == {"x", "conv_1", "act", "out"} and "Conv2d -> OneDNNConv" in texts(nodes["conv_1"])
    dashed = [edge.get("d") for edge in edges(draw(diff, fold="none").svg) if edge.get("class") == "removed"]
    assert len(dashed) == 2  # conv -> act -> out, under the conv's new name
    # a module called twice on either side is not paired by path: no guessing which call is which
    twice = GraphDiff("twice", [x, _node("a", "ReLU", "act", ("x",)), _node("b", "ReLU", "act", ("a",))], [x, _node("c", "GELU", "act", ("x",))])
    assert twice.pairs == {"x": "x"} and len(twice.removed) == 2 and len(twice.added) == 1


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_side_by_side_rows_put_corresponding_nodes_on_one_row(frontend: str) -> None:
    diff = fold_diff(Net(), frontend)
    rows = diff.rows()
    assert all((old or new).op != "get_attr" for old, new in rows)
    removed = {n.name for n in diff.removed if n.op != "get_attr"}
    for old, new in rows:
        if old is not None and new is not None:
            assert diff.pairs[new.name] == old.name
        else:
            assert (old is not None and old.name in removed) or (new is not None and new in diff.added)
    assert len(rows) == len([n for n in diff.before if n.op != "get_attr"])  # the fold adds no node
    page = diff._repr_html_()
    conv_row = next(part for part in page.split("<tr ")[1:] if part.startswith('class="changed"'))
    assert len(re.findall(r"call_module Conv2d|aten.conv2d.default", conv_row)) == 2  # before and after on one row
    if frontend == "export":
        assert "(reads " in conv_row  # the weight reads sit with the op that reads them


def test_a_pass_created_node_without_a_module_folds_with_the_module_it_reads_from(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _node("x", "x", "x", op="placeholder")
    before = [x, _node("attn", "MultiheadAttention", "enc.attn", ("x",)), _node("o", "Linear", "enc.o", ("attn",)), _node("out", "output", "out", ("o",), "output")]
    after = [
        x, _node("proj", "OneDNNLinear", "enc.attn.proj", ("x",)), _node("sdpa", "sdpa", "sdpa", ("proj",), "call_function"),
        _node("o", "Linear", "enc.o", ("sdpa",)), _node("out", "output", "out", ("o",), "output"),
    ]  # fmt: skip
    diff = GraphDiff("attention", before, after)
    assert "sdpa" in nodes_of(diff.draw().svg)  # small enough: nothing changed folds
    monkeypatch.setattr(drawing_module, "MAX_BOXES", 3)
    boxes = nodes_of(diff.draw().svg)
    assert set(boxes) == {"x", "/enc", "out"}  # sdpa, created with no module, went into the module it reads from
    assert "sdpa" in boxes["/enc"].find(f"{SVG}title").text and texts(boxes["/enc"])[1:] == ["4 nodes folded", "-1 removed, +2 added"]


def test_a_node_the_graph_moved_sits_on_two_rows_unmarked() -> None:
    x = _node("x", "x", "x", op="placeholder")
    before = [x, _node("a", "ReLU", "a", ("x",)), _node("b", "GELU", "b", ("x",)), _node("out", "output", "out", ("a", "b"), "output")]
    after = [x, before[2], before[1], before[3]]
    diff = GraphDiff("moved", before, after)
    assert diff.removed == diff.added == diff.changed == []
    assert [(old and old.name, new and new.name) for old, new in diff.rows()] == [("x", "x"), (None, "b"), ("a", "a"), ("b", None), ("out", "out")]
    rows = diff._repr_html_().split("<h4>side by side</h4>")[1]
    assert '<tr class="removed">' not in rows and '<tr class="added">' not in rows and rows.count('<tr class="">') == 5


def test_a_node_the_graph_moved_and_changed_is_marked_changed_on_both_rows() -> None:
    x = _node("x", "x", "x", op="placeholder")
    before = [x, _node("a", "ReLU", "a", ("x",)), _node("b", "GELU", "b", ("x",)), _node("out", "output", "out", ("a", "b"), "output")]
    after = [x, _node("b", "GELU", "b", ("x",)), before[1], before[3]]
    diff = GraphDiff("moved", before, after, {"b": "made exact"})  # b moved above a, and a pass rewrote it
    assert [(old and old.name, new and new.name) for old, new in diff.rows()] == [("x", "x"), (None, "b"), ("a", "a"), ("b", None), ("out", "out")]
    rows = diff._repr_html_().split("<h4>side by side</h4>")[1]
    marks = re.findall(r'<tr class="(\w*)">', rows)
    assert marks == ["", "changed", "", "changed", ""]


def test_the_html_file_shows_a_wide_drawing_whole(tmp_path: Path) -> None:
    """A notebook keeps the drawing in a scroll box; the file lets the page scroll, so nothing is cut at the window's width."""
    from tests.test_browser_screenshot import page_or_skip

    x = _node("x", "x", "x", op="placeholder")
    branches = [_node(f"relu_{i}", "ReLU", f"branch{i}.act", ("x",)) for i in range(16)]
    before = [x, *branches, _node("out", "output", "out", tuple(b.name for b in branches), "output")]
    diff = GraphDiff("wide", before, before[:1] + before[2:])  # one branch removed: 15 boxes side by side
    width = float(ElementTree.fromstring(diff.draw().svg).get("width"))
    path = diff.to_html(tmp_path / "wide.html")
    assert 'max-height:720px;overflow:auto' in diff._repr_html_()
    with contextlib.ExitStack() as stack:
        page = page_or_skip(stack)  # 1400 px wide
        page.goto(path.resolve().as_uri())
        assert width > 1400 and page.evaluate("document.documentElement.scrollWidth") >= width


def test_plain_text_forms_are_short() -> None:
    """Jupyter keeps text/plain beside the HTML: a summary, not the node lists or the SVG."""
    diff = fold_diff(Net())
    assert repr(diff) == "<GraphDiff fold_conv_bn: 9 -> 8 nodes (-1 +0 ~1)>"
    assert repr(diff.draw()) == "<Drawing: 6 boxes, 1 modules folded>"


def test_a_png_without_playwright_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # import fails as if not installed
    drawing = fold_diff(Net()).draw()
    with pytest.raises(graphopt.GraphoptError, match=r"need Playwright: pip install playwright"):
        drawing.save(tmp_path / "diff.png")
    assert drawing.save(tmp_path / "diff.svg").read_text() == drawing.svg  # SVG and HTML need nothing
    assert drawing.svg in drawing.save(tmp_path / "diff.html").read_text()
    with pytest.raises(graphopt.GraphoptError, match=r"cannot save a drawing as 'diff.pdf': use a .svg, .html or .png path"):
        drawing.save(tmp_path / "diff.pdf")

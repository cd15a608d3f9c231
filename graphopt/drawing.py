"""Drawn graph diffs: the graph before and after a change, merged into one layered SVG drawing.

The drawing shows the graph after the change plus the nodes it removed, wired where they
were: removed nodes and the edges that went through them are dashed red, added nodes
green, changed nodes yellow, each with the reason the pass recorded beside it and the
node's full description on hover (an SVG ``<title>``). Nodes show their op, shape, dtype
and layout; weight reads (``get_attr``) are listed in the node that reads them rather than
drawn apart.

Large graphs stay readable by folding: a module none of whose nodes changed is drawn as
one grey box, and where the drawing still has more than ``MAX_BOXES`` boxes, modules fold
at the deepest module level that fits, each box summing up what changed inside it.
``expand=`` keeps chosen modules open. No system binary is needed: grandalf (pure Python,
from the package index) lays the graph out (Sugiyama layering and crossing reduction) and
this module writes the SVG, which renders in Jupyter and any browser without scripts.
"""

from __future__ import annotations

import collections
import html
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from grandalf.graphs import Edge, Vertex, graph_core
from grandalf.layouts import SugiyamaLayout

from graphopt.errors import GraphoptError

if TYPE_CHECKING:
    from graphopt.diff import GraphDiff, NodeInfo

MAX_BOXES = 80  # above this many boxes, "auto" folds modules until the drawing fits
FOLDS = ("auto", "unchanged", "none")
SAVE_SUFFIXES = (".svg", ".html", ".htm", ".png")

_CHAR_WIDTH = 6.6  # monospace 11px
_LINE_HEIGHT = 14
_PADDING = 6
_NOTE_CHARS = 48
_LABEL_CHARS = 40
_GAP = 40  # between components side by side


@dataclass
class _Item:
    """One node of the merged graph: what it is, its status and the module it belongs to."""

    node: NodeInfo
    status: str  # "removed", "added", "changed", "unchanged"
    note: str  # the reason beside it
    was: str = ""  # the op it replaced (a module replaced at the same path)
    weights: tuple[str, ...] = ()
    module: tuple[str, ...] = ()


@dataclass
class _Box:
    """What is drawn for one item or one folded module."""

    key: str
    lines: list[str]
    status: str
    tooltip: str
    note: str = ""
    x: float = 0.0
    y: float = 0.0

    @property
    def width(self) -> float:
        return max(len(line) for line in self.lines) * _CHAR_WIDTH + 2 * _PADDING

    @property
    def height(self) -> float:
        return len(self.lines) * _LINE_HEIGHT + _PADDING

    @property
    def outer_width(self) -> float:
        """The width the layout reserves: the box and the note beside it."""
        return self.width + (len(self.note) * _CHAR_WIDTH + 8 if self.note else 0)


@dataclass
class _Link:
    source: str
    target: str
    removed: bool
    points: list[tuple[float, float]] = field(default_factory=list)


@dataclass(repr=False)
class Drawing:
    """A laid-out diff: ``svg`` (the picture), ``boxes`` drawn and the modules ``folded`` into one box each.

    Renders inline in Jupyter; ``save(path)`` writes ``.svg``, ``.html`` or ``.png`` (the PNG
    is taken by a headless browser, see `graphopt.browser`).
    """

    svg: str
    boxes: int
    folded: list[str]

    def __repr__(self) -> str:  # not the SVG: a notebook keeps this beside the picture
        return f"<Drawing: {self.boxes} boxes, {len(self.folded)} modules folded>"

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, scroll: bool = True) -> str:
        """The drawing for a page: in a scroll box (a notebook cell keeps its height), or with ``scroll=False``
        at its natural size, the page scrolling instead (a file: printing or a full-page screenshot of a scroll
        box would cut the drawing at the window's width)."""
        return f'<div style="max-height:720px;overflow:auto">{self.svg}</div>' if scroll else f"<div>{self.svg}</div>"

    def save(self, path: str | Path) -> Path:
        destination = Path(path)
        suffix = destination.suffix.lower()
        if suffix not in SAVE_SUFFIXES:
            raise GraphoptError(f"cannot save a drawing as {destination.name!r}: use a .svg, .html or .png path")
        if suffix == ".svg":
            destination.write_text(self.svg, encoding="utf-8")
        elif suffix == ".png":
            from graphopt.browser import screenshot_svg

            screenshot_svg(html_document(self.svg), destination)
        else:
            destination.write_text(html_document(self.svg), encoding="utf-8")
        return destination


def html_document(body: str, title: str = "graphopt diff") -> str:
    """One self-contained HTML page around ``body`` (a drawing, or a diff's HTML)."""
    return f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title></head><body>{body}</body></html>\n'


def draw(diff: GraphDiff, fold: str = "auto", expand: Iterable[str] = ()) -> Drawing:
    """Lay out ``diff`` as one merged graph and draw it (see the module docstring for ``fold`` and ``expand``)."""
    if fold not in FOLDS:
        raise GraphoptError(f"fold={fold!r} is not one of {', '.join(map(repr, FOLDS))}")
    items, links = _merged(diff)
    opened = [tuple(path.split(".")) for path in expand]
    groups = _groups(items, fold, opened)
    boxes, links = _boxes(items, links, groups)
    width, height = _layout(boxes, links)
    folded = sorted({".".join(group) for group in groups.values() if group})
    return Drawing(_svg(diff.title, boxes, links, width, height), len(boxes), folded)


# ---------------------------------------------------------------------------- the merged graph


def _container(item: _Item) -> tuple[str, ...]:
    """The module that holds ``item`` (`NodeInfo.container`, of its module as drawn: a created node's is inferred)."""
    return item.module[:-1] if item.node.op == "call_module" else item.module


def _merged(diff: GraphDiff) -> tuple[dict[str, _Item], dict[tuple[str, str], _Link]]:
    """The graph after the change plus the removed nodes and edges; weight reads kept with their readers."""
    pairs = diff.pairs
    before = {node.name: node for node in diff.before}
    removed = {node.name for node in diff.removed}
    added = {node.name for node in diff.added}
    changed = {node.name for node in diff.changed}

    items: dict[str, _Item] = {}
    for node in diff.after:
        if node.op == "get_attr":
            continue
        status = "added" if node.name in added else "changed" if node.name in changed else "unchanged"
        old = before.get(pairs.get(node.name, ""))
        was = old.target if old is not None and old.target != node.target else ""
        note = diff.why(node) or (f"added by {diff.origin[node.name]}" if node.name in diff.origin and status == "added" else "")
        module = node.module_path
        if not module and status == "added":  # a node a pass created without a module: where its inputs are
            module = next((_container(items[s]) for s in node.inputs if s in items and _container(items[s])), ())
        items[node.name] = _Item(node, status, note, was, diff.reads(node), module)
    for node in diff.removed:
        if node.op == "get_attr":
            continue
        note = f"removed by {diff.origin[node.name]}" if node.name in diff.origin else ""
        items[node.name] = _Item(node, "removed", note, "", diff.reads(node), node.module_path)

    # before-names of surviving nodes map to their after-names (a replaced module keeps its path, not its name)
    renamed = {old: new for new, old in pairs.items()}
    links: dict[tuple[str, str], _Link] = {}
    for node in diff.after:
        for source in node.inputs:
            if node.name in items and source in items:
                links[source, node.name] = _Link(source, node.name, removed=False)
    for node in diff.before:
        target = renamed.get(node.name, node.name)
        for source in node.inputs:
            source = renamed.get(source, source)
            if target in items and source in items and (source in removed or target in removed):
                links.setdefault((source, target), _Link(source, target, removed=True))
    return items, links


# ---------------------------------------------------------------------------- folding


def _groups(items: dict[str, _Item], fold: str, opened: list[tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The module each item folds into (() where it is drawn on its own)."""
    members: dict[tuple[str, ...], list[str]] = collections.defaultdict(list)
    for name, item in items.items():
        for depth in range(1, len(item.module) + 1):
            members[item.module[:depth]].append(name)

    def foldable(module: tuple[str, ...]) -> bool:
        return len(members[module]) >= 2 and not any(path[: len(module)] == module for path in opened)

    def unchanged(module: tuple[str, ...]) -> bool:
        return all(items[name].status == "unchanged" for name in members[module])

    def group_at(item: _Item, depth: int | None) -> tuple[str, ...]:
        for level in range(1, len(item.module) + 1):
            module = item.module[:level]
            if foldable(module) and ((fold != "none" and unchanged(module)) or (depth is not None and level == depth)):
                return module
        return ()

    def count(groups: dict[str, tuple[str, ...]]) -> int:
        return len({group or ("", name) for name, group in groups.items()})

    groups = {name: group_at(item, None) for name, item in items.items()}
    if fold != "auto" or count(groups) <= MAX_BOXES:
        return groups
    deepest = max(len(item.module) for item in items.values())
    for depth in range(deepest, 0, -1):
        groups = {name: group_at(item, depth) for name, item in items.items()}
        if count(groups) <= MAX_BOXES:
            break
    return groups


def _summary(statuses: Iterable[str]) -> str:
    counts = collections.Counter(statuses)
    parts = [f"{sign}{counts[status]} {status}" for sign, status in (("-", "removed"), ("+", "added"), ("~", "changed")) if counts[status]]
    return ", ".join(parts) or "unchanged"


def _boxes(
    items: dict[str, _Item], links: dict[tuple[str, str], _Link], groups: dict[str, tuple[str, ...]]
) -> tuple[dict[str, _Box], list[_Link]]:
    """One box per item drawn on its own and per folded module; links between boxes, merged."""
    boxes: dict[str, _Box] = {}
    folded: dict[str, list[_Item]] = collections.defaultdict(list)
    for name, item in items.items():
        if groups[name]:
            folded["/" + ".".join(groups[name])].append(item)
        else:
            boxes[name] = _item_box(name, item)
    for key, members in folded.items():
        summary = _summary(item.status for item in members)
        status = "folded" if summary == "unchanged" else "folded-changed"
        tooltip = "\n".join(
            f"{item.node.where}: {item.node.detail()} ({item.status}{': ' + item.note if item.note else ''})" for item in members[:40]
        ) + (f"\n... {len(members) - 40} more" if len(members) > 40 else "")
        lines = [_clip(key[1:], _LABEL_CHARS), f"{len(members)} nodes folded", summary]
        boxes[key] = _Box(key, lines, status, f"{key[1:]} ({summary})\n{tooltip}")

    def box_of(name: str) -> str:
        return "/" + ".".join(groups[name]) if groups[name] else name

    merged: dict[tuple[str, str], _Link] = {}
    for link in links.values():
        source, target = box_of(link.source), box_of(link.target)
        if source == target:
            continue
        removed = link.removed and merged.get((source, target), link).removed  # a kept edge between two boxes wins
        merged[source, target] = _Link(source, target, removed)
    return boxes, list(merged.values())


def _item_box(name: str, item: _Item) -> _Box:
    node = item.node
    op = f"{item.was} -> {node.target}" if item.was else node.target
    lines = [_clip(node.where, _LABEL_CHARS), _clip(op, _LABEL_CHARS)]
    if node.shape is not None:
        shape = "[" + ", ".join("?" if s < 0 else str(s) for s in node.shape) + f"] {node.dtype}"
        if node.layout in ("channels_last", "any"):
            shape += f" {node.layout}"
        lines.append(_clip(shape, _LABEL_CHARS))
    tooltip = [f"{node.where} ({item.status})", node.detail()]
    if item.was:
        tooltip.append(f"was {item.was}")
    if item.weights:
        tooltip.append("reads " + ", ".join(item.weights))
    if item.note:
        tooltip.append(item.note)
    status = {"placeholder": "input", "output": "output"}.get(node.op, item.status) if item.status == "unchanged" else item.status
    return _Box(name, lines, status, "\n".join(tooltip), _clip(item.note, _NOTE_CHARS))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------- layout


class _View:
    """What grandalf reads and writes for a vertex: its size and centre."""

    def __init__(self, width: float, height: float) -> None:
        self.w, self.h = width, height
        self.xy = (0.0, 0.0)


class _EdgeView:
    """Where grandalf puts an edge's points: the centres of the boxes and of the bends (replaced by box borders)."""

    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []

    def setpath(self, points: list[tuple[float, float]]) -> None:
        self.points = list(points)


def _layout(boxes: dict[str, _Box], links: list[_Link]) -> tuple[float, float]:
    """Place the boxes in layers (grandalf's Sugiyama layout), components side by side; returns the drawing's size."""
    vertices = {key: Vertex(key) for key in boxes}
    for key, vertex in vertices.items():
        vertex.view = _View(boxes[key].outer_width, boxes[key].height)
    edges, links_of = [], {}
    for link in links:
        edge = Edge(vertices[link.source], vertices[link.target])
        edge.view = _EdgeView()
        edges.append(edge)
        links_of[id(edge)] = link
    left, height = 0.0, 0.0
    for component in _components(list(vertices.values()), edges):
        layout = SugiyamaLayout(component)
        layout.xspace, layout.yspace = 24, 28
        layout.init_all()
        layout.draw(3)
        views = [vertex.view for vertex in component.sV]
        bends = [x for edge in component.sE for x, _ in edge.view.points[1:-1]]  # long edges pass beside the boxes
        x0 = min([view.xy[0] - view.w / 2 for view in views] + bends)
        right = max([view.xy[0] + view.w / 2 for view in views] + bends)
        bottom = max(view.xy[1] + view.h / 2 for view in views)
        for vertex in component.sV:
            box = boxes[vertex.data]
            box.x = vertex.view.xy[0] - x0 + left - (box.outer_width - box.width) / 2  # the note sits right of the box
            box.y = vertex.view.xy[1]
        for edge in component.sE:
            link = links_of[id(edge)]
            source, target = boxes[link.source], boxes[link.target]
            middle = [(x - x0 + left, y) for x, y in edge.view.points[1:-1]]
            link.points = [(source.x, source.y + source.height / 2), *middle, (target.x, target.y - target.height / 2)]
        left += right - x0 + _GAP
        height = max(height, bottom)
    return max(left - _GAP, 0.0), height


def _components(vertices: list[Vertex], edges: list[Edge]) -> list[graph_core]:
    """The connected components, vertices and edges in the order given (grandalf's Graph orders a component's edges
    by a set of objects, which changes the layout from one process to the next)."""
    index = {id(vertex): i for i, vertex in enumerate(vertices)}
    parent = list(range(len(vertices)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for edge in edges:
        first, second = find(index[id(edge.v[0])]), find(index[id(edge.v[1])])
        parent[max(first, second)] = min(first, second)
    groups: dict[int, tuple[list[Vertex], list[Edge]]] = {}
    for i, vertex in enumerate(vertices):
        groups.setdefault(find(i), ([], []))[0].append(vertex)
    for edge in edges:
        groups[find(index[id(edge.v[0])])][1].append(edge)
    return [graph_core(members, inner) for members, inner in groups.values()]


# ---------------------------------------------------------------------------- SVG

_MARGIN = 10
_LEGEND = 26

_SVG_CSS = (
    ".gd text{font-family:monospace;font-size:11px;fill:#222}.gd .note{fill:#555;font-style:italic}"
    ".gd rect{stroke:#888;stroke-width:1;fill:#fff}.gd .removed rect{fill:#f7c5c5;stroke:#c0392b;stroke-dasharray:4 3}"
    ".gd .added rect{fill:#c8f7c5;stroke:#27ae60}.gd .changed rect{fill:#fff3b0;stroke:#b7950b}"
    ".gd .folded rect{fill:#eee;stroke:#aaa}.gd .folded-changed rect{fill:#eee;stroke:#b7950b;stroke-width:2}"
    ".gd .input rect,.gd .output rect{fill:#e8f0fe;stroke:#4a6fa5}"
    ".gd path{fill:none;stroke:#777;stroke-width:1}.gd path.removed{stroke:#c0392b;stroke-dasharray:4 3}"
)


def _svg(title: str, boxes: dict[str, _Box], links: list[_Link], width: float, height: float) -> str:
    esc = html.escape
    total_width = max(width, 520) + 2 * _MARGIN
    total_height = height + 2 * _MARGIN + _LEGEND
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="gd" width="{total_width:.0f}" height="{total_height:.0f}" '
        f'viewBox="0 0 {total_width:.0f} {total_height:.0f}" role="img" aria-label="graphopt diff: {esc(title)}" '
        'style="max-width:none">',  # natural size, scrolled: JupyterLab shrinks SVGs to the page width, text and all
        f"<style>{_SVG_CSS}</style>",
        '<defs><marker id="gd-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" style="fill:#777;stroke:none"/></marker></defs>',
    ]
    x = _MARGIN
    for status, label in (("removed", "removed"), ("added", "added"), ("changed", "changed"), ("folded", "folded module")):
        parts.append(f'<g class="{status}"><rect x="{x}" y="{_MARGIN}" width="14" height="12"/>'
                     f'<text x="{x + 18}" y="{_MARGIN + 10}">{label}</text></g>')
        x += 18 + len(label) * _CHAR_WIDTH + 14
    top = _MARGIN + _LEGEND
    for link in links:
        if len(link.points) < 2:
            continue
        d = " ".join(f"{'M' if i == 0 else 'L'}{px + _MARGIN:.1f},{py + top:.1f}" for i, (px, py) in enumerate(link.points))
        css = ' class="removed"' if link.removed else ""
        parts.append(f'<path{css} d="{d}" marker-end="url(#gd-arrow)"/>')
    for box in boxes.values():
        left, upper = box.x - box.width / 2 + _MARGIN, box.y - box.height / 2 + top
        parts.append(f'<g class="node {box.status}" data-name="{esc(box.key)}"><title>{esc(box.tooltip)}</title>')
        parts.append(f'<rect x="{left:.1f}" y="{upper:.1f}" width="{box.width:.1f}" height="{box.height:.1f}" rx="3"/>')
        for i, line in enumerate(box.lines):
            weight = ' style="font-weight:bold"' if i == 0 else ""
            parts.append(f'<text x="{left + _PADDING:.1f}" y="{upper + _PADDING / 2 + (i + 0.8) * _LINE_HEIGHT:.1f}"{weight}>{esc(line)}</text>')
        if box.note:
            parts.append(f'<text class="note" x="{left + box.width + 6:.1f}" y="{box.y + top + 4:.1f}">{esc(box.note)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)

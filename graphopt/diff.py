"""GraphDiff: what an optimization removed, added and changed in a graph, node by node.

A diff is built from two node listings (taken before and after a pass, or before and
after the whole pipeline) matched by node name — passes rewrite the graph in place, so
a surviving node keeps its name — plus the rewrites and skips the passes recorded: a
node whose parameters a pass rewrote (a conv with a BatchNorm folded in) is "changed"
even though its call looks the same, and every skip says why a candidate was left alone.

Renderings: ``str()`` for terminals (coloured on a TTY unless NO_COLOR is set);
``_repr_html_`` for Jupyter and ``to_html(path)`` for one self-contained file (no network,
no scripts): the drawn graph (`graphopt.drawing`), the op counts and the two graphs side by
side, corresponding nodes on one row; ``draw()``/``to_svg()`` for the drawing alone;
``to_dot()`` for Graphviz.
"""

from __future__ import annotations

import collections
import difflib
import functools
import html
import itertools
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from graphopt.drawing import Drawing, draw, html_document
from graphopt.errors import GraphoptError
from graphopt.report import Skip, describe, target_name


@dataclass(frozen=True)
class NodeInfo:
    """One node as a diff shows it."""

    name: str
    op: str
    target: str
    where: str  # module path the user recognises
    inputs: tuple[str, ...]  # names of the nodes it reads
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    layout: str | None = None

    @classmethod
    def of(cls, node: fx.Node) -> NodeInfo:
        shape = dtype = layout = None
        value = node.meta.get("val", node.meta.get("tensor_meta"))
        if isinstance(value, torch.Tensor) or hasattr(value, "shape"):
            shape = tuple(int(s) if isinstance(s, int) else -1 for s in value.shape)
            dtype = str(value.dtype).removeprefix("torch.")
        layout = node.meta.get("graphopt_layout")
        target = target_name(node.target)
        owner = node.graph.owning_module
        if node.op == "call_module" and owner is not None:
            target = type(owner.get_submodule(str(node.target))).__name__  # the op, not the instance's path
        return cls(node.name, node.op, target, describe(node), tuple(a.name for a in node.all_input_nodes), shape, dtype, layout)

    @property
    def module_path(self) -> tuple[str, ...]:
        """The module the node belongs to: its own path for a module call, else the path before ':' (see report.describe)."""
        if self.op == "call_module":
            path = self.where
        elif ":" in self.where:
            path = self.where.split(":", 1)[0]
        else:
            return ()
        return tuple(part for part in path.split(".") if part)

    @property
    def container(self) -> tuple[str, ...]:
        """The module that holds the node: a module call's parent, else the module the node runs in."""
        return self.module_path[:-1] if self.op == "call_module" else self.module_path

    def signature(self) -> tuple[str, str, str | None]:
        """What makes a surviving node "changed": its op, or its dtype (not rewired inputs)."""
        return self.op, self.target, self.dtype

    def detail(self) -> str:
        parts = [f"{self.op} {self.target}"]
        if self.shape is not None:
            parts.append("[" + ", ".join("?" if s < 0 else str(s) for s in self.shape) + f"] {self.dtype}")
        if self.layout in ("channels_last", "any"):
            parts.append(self.layout)
        return "  ".join(parts)


def snapshot(graph: fx.Graph) -> list[NodeInfo]:
    """The nodes of ``graph`` as a diff needs them (taken before a graph changes)."""
    return [NodeInfo.of(node) for node in graph.nodes]


@dataclass(repr=False)  # the node lists would fill a notebook's plain-text output
class GraphDiff:
    """Nodes removed, added and changed between two graphs, and why candidates were left alone."""

    title: str
    before: list[NodeInfo]
    after: list[NodeInfo]
    rewritten: dict[str, str] = field(default_factory=dict)  # node name -> what a pass did to it
    skips: list[Skip] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)  # node name -> the pass that removed or added it

    @functools.cached_property
    def pairs(self) -> dict[str, str]:
        """Surviving nodes: after-name -> before-name.

        A node keeps its name through a pass; a module a pass replaced at the same path (a Conv2d
        swapped for a oneDNN conv) is the same node under a new name, where one node on each side calls it.
        """
        before_names = {n.name for n in self.before}
        pairs = {n.name: n.name for n in self.after if n.name in before_names}
        gone = collections.defaultdict(list)
        for node in self.before:
            if node.name not in pairs and node.op == "call_module":
                gone[node.where].append(node.name)
        new = collections.defaultdict(list)
        for node in self.after:
            if node.name not in pairs and node.op == "call_module":
                new[node.where].append(node.name)
        for where, names in new.items():
            if len(names) == 1 and len(gone.get(where, ())) == 1:
                pairs[names[0]] = gone[where][0]
        return pairs

    @property
    def removed(self) -> list[NodeInfo]:
        kept = set(self.pairs.values())
        return [n for n in self.before if n.name not in kept]

    @property
    def added(self) -> list[NodeInfo]:
        pairs = self.pairs
        return [n for n in self.after if n.name not in pairs]

    @property
    def changed(self) -> list[NodeInfo]:
        before = {n.name: n for n in self.before}
        pairs = self.pairs
        return [
            n for n in self.after
            if n.name in pairs and (self.why(n) or n.signature() != before[pairs[n.name]].signature())
        ]

    def __repr__(self) -> str:
        return f"<GraphDiff {self.title}: {self._counts()}>"

    def _counts(self) -> str:
        return f"{len(self.before)} -> {len(self.after)} nodes (-{len(self.removed)} +{len(self.added)} ~{len(self.changed)})"

    def op_counts(self) -> list[tuple[str, int, int]]:
        """(op, count before, count after) for every op that computes, most changed first."""
        def count(nodes: list[NodeInfo]) -> collections.Counter[str]:
            return collections.Counter(n.target for n in nodes if n.op in ("call_module", "call_function", "call_method"))

        before, after = count(self.before), count(self.after)
        ops = sorted(set(before) | set(after), key=lambda op: (-abs(after[op] - before[op]), op))
        return [(op, before[op], after[op]) for op in ops]

    @functools.cached_property
    def _weights(self) -> dict[str, str]:
        """Weight reads (``get_attr`` nodes) of either graph: name -> the attribute read."""
        return {n.name: n.target for n in [*self.before, *self.after] if n.op == "get_attr"}

    def reads(self, node: NodeInfo) -> tuple[str, ...]:
        """The weights ``node`` reads (its ``get_attr`` inputs), which the drawing and the rows show with it."""
        return tuple(self._weights[name] for name in node.inputs if name in self._weights)

    def why(self, node: NodeInfo) -> str:
        """What a pass recorded doing to ``node`` (under its name before or after a replacement), or ""."""
        names = dict.fromkeys((self.pairs.get(node.name, node.name), node.name))  # before the replacement first
        return "; ".join(self.rewritten[name] for name in names if name in self.rewritten)

    # ------------------------------------------------------------------ text

    def render_text(self, color: bool = False) -> str:
        paint = _ansi if color else (lambda text, _: text)
        removed, added, changed = self.removed, self.added, self.changed
        lines = [f"graphopt diff: {self.title}: {self._counts()}"]
        counts = [f"{op} {b}->{a}" for op, b, a in self.op_counts() if b != a]
        if counts:
            lines.append("op counts: " + ", ".join(counts))
        width = max([len(n.where) for n in [*removed, *added, *changed]] or [0])
        for mark, label, nodes, colour in (("-", "removed", removed, "31"), ("+", "added", added, "32"), ("~", "changed", changed, "33")):
            for node in nodes:
                why = f"  ({self.why(node)})" if self.why(node) else ""
                lines.append(paint(f"{mark} {label:<8}{node.where:<{width}}  {node.detail()}{why}", colour))
        if self.skips:
            lines.append("left alone:")
            lines += [f"  {skip.where}: {skip.reason}" for skip in self.skips]
        if not (removed or added or changed):
            lines.append("(no change)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render_text(color=sys.stdout.isatty() and "NO_COLOR" not in os.environ)

    # ------------------------------------------------------------------ html

    def draw(self, fold: str = "auto", expand: Iterable[str] = ()) -> Drawing:
        """The diff drawn as one merged graph (SVG, no system binary); see `graphopt.drawing`."""
        return draw(self, fold, expand)

    def rows(self) -> list[tuple[NodeInfo | None, NodeInfo | None]]:
        """The side-by-side view: (before, after) per row, corresponding nodes on one row, weight reads left out."""
        before = [n for n in self.before if n.op != "get_attr"]
        after = [n for n in self.after if n.op != "get_attr"]
        before_keys = [n.name for n in before]
        after_keys = [self.pairs.get(n.name, "+" + n.name) for n in after]  # "+": never a before-name
        rows: list[tuple[NodeInfo | None, NodeInfo | None]] = []
        matcher = difflib.SequenceMatcher(None, before_keys, after_keys, autojunk=False)
        for tag, b0, b1, a0, a1 in matcher.get_opcodes():
            if tag == "equal":
                rows += zip(before[b0:b1], after[a0:a1])
            else:
                rows += [(node, None) for node in before[b0:b1]] + [(None, node) for node in after[a0:a1]]
        return rows

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, fold: str = "auto", expand: Iterable[str] = (), scroll: bool = True) -> str:
        """The HTML a notebook shows: the drawing (``fold``/``expand`` as in `draw`), op counts, rows side by side.

        ``scroll``: the drawings in scroll boxes (a notebook), else at their natural size (a file, see `to_html`)."""
        esc = html.escape
        removed, added, changed = ({n.name for n in nodes} for nodes in (self.removed, self.added, self.changed))
        changed_before = {self.pairs[name] for name in changed}  # the same nodes' names before
        counts = "".join(
            f'<tr class="{"d" if b != a else ""}"><td>{esc(op)}</td><td>{b}</td><td>{a}</td></tr>' for op, b, a in self.op_counts()
        )

        def cell(node: NodeInfo | None) -> str:
            if node is None:
                return "<td></td><td></td>"
            reads = self.reads(node)
            detail = node.detail() + (f" (reads {', '.join(reads)})" if reads else "")
            return f"<td>{esc(node.where)}</td><td>{esc(detail)}</td>"

        def status(pair: tuple[NodeInfo | None, NodeInfo | None]) -> str:
            """A surviving node the graph moved sits on two rows, unmarked unless it also changed: then both are."""
            old, new = pair
            if (new is not None and new.name in changed) or (old is not None and old.name in changed_before):
                return "changed"
            if old is not None and new is not None:
                return ""
            return "removed" if old is not None and old.name in removed else "added" if new is not None and new.name in added else ""

        def group(pair: tuple[NodeInfo | None, NodeInfo | None]) -> str:
            """The top-level module a row belongs to ("" for the model's own nodes)."""
            node = pair[0] or pair[1]
            assert node is not None
            return node.container[0] if node.container else ""

        blocks = []
        for name, run in itertools.groupby(self.rows(), key=group):
            pairs = list(run)
            marks = [status(pair) for pair in pairs]
            body = "".join(
                f'<tr class="{mark}">{cell(old)}{cell(new)}<td>{esc(self.why(new) if new else "")}</td></tr>'
                for (old, new), mark in zip(pairs, marks)
            )
            open_attr = " open" if any(marks) else ""
            marked = collections.Counter(marks)
            summary = ", ".join(f"{marked[m]} {m}" for m in ("removed", "added", "changed") if marked[m]) or "unchanged"
            blocks.append(f"<details{open_attr}><summary>{esc(name or 'top level')} ({len(pairs)} rows: {summary})</summary><table class=\"rows\">{_COLUMNS}{body}</table></details>")
        skips = "".join(f"<li><code>{esc(s.where)}</code>: {esc(s.reason)}</li>" for s in self.skips)
        drawing = self.draw(fold, expand)
        every = ""
        if drawing.folded:
            every = f"<details><summary>every node ({len(self.after)} after, {len(removed)} removed)</summary>{self.draw(fold='none').html(scroll)}</details>"
        return (
            f'<div class="graphopt-diff"><style>{_CSS}</style>'
            f"<h3>{esc(self.title)}: {len(self.before)} &rarr; {len(self.after)} nodes "
            f'(<span class="removed">-{len(removed)}</span> <span class="added">+{len(added)}</span> '
            f'<span class="changed">~{len(changed)}</span>)</h3>'
            f"{drawing.html(scroll)}{every}"
            f'<h4>op counts</h4><table class="counts"><tr><th>op</th><th>before</th><th>after</th></tr>{counts}</table>'
            f"<h4>side by side</h4>{''.join(blocks)}"
            + (f"<h4>left alone</h4><ul>{skips}</ul>" if skips else "")
            + "</div>"
        )

    def to_html(self, path: str | os.PathLike[str], fold: str = "auto", expand: Iterable[str] = ()) -> Path:
        """Write `html` as one self-contained file (inline CSS and SVG, no scripts, no network) and return its path.

        The drawings keep their natural size there (the page scrolls): nothing is cut at the window's width."""
        destination = Path(path)
        destination.write_text(html_document(self.html(fold, expand, scroll=False), self.title), encoding="utf-8")
        return destination

    def to_svg(self, fold: str = "auto", expand: Iterable[str] = ()) -> str:
        """The drawing as an SVG document (see `draw`)."""
        return self.draw(fold, expand).svg

    # ------------------------------------------------------------------ graphviz

    def to_dot(self) -> str:
        """The graph after the change in Graphviz DOT, removed nodes dashed, added green, changed yellow."""
        removed, added, changed = ({n.name for n in nodes} for nodes in (self.removed, self.added, self.changed))
        lines = ["digraph graphopt_diff {", "  rankdir=TB; node [shape=box, fontsize=10, style=filled, fillcolor=white];"]
        for node in [*self.after, *self.removed]:
            fill = "#c8f7c5" if node.name in added else "#fff3b0" if node.name in changed else "#f7c5c5" if node.name in removed else "white"
            style = ', style="filled,dashed"' if node.name in removed else ""
            label = f"{node.where}\\n{node.target}".replace('"', '\\"')
            lines.append(f'  "{node.name}" [label="{label}", fillcolor="{fill}"{style}];')
        for node in [*self.after, *self.removed]:
            lines += [f'  "{source}" -> "{node.name}";' for source in node.inputs]
        lines.append("}")
        return "\n".join(lines)


def _ansi(text: str, colour: str) -> str:
    return f"\033[{colour}m{text}\033[0m"


# colours on the cells, selectors of two classes and two elements: they hold against JupyterLab's table styles
# (striped rows: `.jp-RenderedHTMLCommon tbody tr:nth-child(odd)`; right-aligned cells: `:not(...).jp-RenderedHTMLCommon td`)
_CSS = (
    ".graphopt-diff{font-family:monospace;font-size:12px}.graphopt-diff table{border-collapse:collapse}"
    ".graphopt-diff table.counts td,.graphopt-diff table.counts th,.graphopt-diff table.rows td{padding:1px 6px;text-align:left}"
    ".graphopt-diff tbody tr.removed>td,.graphopt-diff span.removed{background:#f7c5c5}"
    ".graphopt-diff tbody tr.added>td,.graphopt-diff span.added{background:#c8f7c5}"
    ".graphopt-diff tbody tr.changed>td,.graphopt-diff span.changed{background:#fff3b0}.graphopt-diff tbody tr.d>td{font-weight:bold}"
    ".graphopt-diff table.rows{table-layout:fixed;width:100%}.graphopt-diff table.rows td{overflow-wrap:anywhere;vertical-align:top}"
)
# the same column widths in every group's table, so the groups line up: before (module, op), after (module, op), why
_COLUMNS = '<colgroup><col style="width:14%"><col style="width:22%"><col style="width:14%"><col style="width:22%"><col></colgroup>'



def diff(before: Any, after: Any = None) -> GraphDiff:
    """Diff an optimized module against the graph captured before its passes, or two graphs/modules.

    ``diff(optimized)`` uses the snapshot `optimize` took; ``diff(a, b)`` accepts
    ``OptimizedModule``, ``fx.GraphModule`` or ``fx.Graph`` on either side.
    """
    if after is None:
        if not hasattr(before, "graphopt_report"):
            raise GraphoptError("diff(model) needs a module returned by graphopt.optimize; to compare two graphs, pass both")
        report = before.graphopt_report
        rewritten: dict[str, str] = {}
        for r in (r for p in report.passes for r in p.rewrites if r.node):
            rewritten[r.node] = f"{rewritten[r.node]}; {r.detail}" if r.node in rewritten else r.detail
        skips = [s for p in report.passes for s in p.skips]
        origin = {change.name: p.name for p in report.passes for change in [*p.erased, *p.created]}
        return GraphDiff("all passes", list(report.captured_nodes), snapshot(before.graph), rewritten, skips, origin)
    return GraphDiff("graphs", snapshot(_graph_of(before)), snapshot(_graph_of(after)))


def _graph_of(value: Any) -> fx.Graph:
    if isinstance(value, fx.Graph):
        return value
    graph = getattr(value, "graph", None)
    if isinstance(graph, fx.Graph):
        return graph
    raise GraphoptError(f"cannot diff a {type(value).__name__}: pass an optimized module, a torch.fx.GraphModule or a torch.fx.Graph")

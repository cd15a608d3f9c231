"""GraphDiff: what an optimization removed, added and changed in a graph, node by node.

A diff is built from two node listings (taken before and after a pass, or before and
after the whole pipeline) matched by node name — passes rewrite the graph in place, so
a surviving node keeps its name — plus the rewrites and skips the passes recorded: a
node whose parameters a pass rewrote (a conv with a BatchNorm folded in) is "changed"
even though its call looks the same, and every skip says why a candidate was left alone.

Renderings: ``str()`` for terminals (coloured on a TTY unless NO_COLOR is set),
``_repr_html_`` for Jupyter, ``to_html(path)`` for one self-contained file (no network),
``to_dot()`` and ``to_svg()`` (the latter runs Graphviz's ``dot`` when installed).
"""

from __future__ import annotations

import collections
import html
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

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


@dataclass
class GraphDiff:
    """Nodes removed, added and changed between two graphs, and why candidates were left alone."""

    title: str
    before: list[NodeInfo]
    after: list[NodeInfo]
    rewritten: dict[str, str] = field(default_factory=dict)  # node name -> what a pass did to it
    skips: list[Skip] = field(default_factory=list)

    @property
    def removed(self) -> list[NodeInfo]:
        names = {n.name for n in self.after}
        return [n for n in self.before if n.name not in names]

    @property
    def added(self) -> list[NodeInfo]:
        names = {n.name for n in self.before}
        return [n for n in self.after if n.name not in names]

    @property
    def changed(self) -> list[NodeInfo]:
        before = {n.name: n for n in self.before}
        return [
            n for n in self.after
            if n.name in before and (n.name in self.rewritten or n.signature() != before[n.name].signature())
        ]

    def op_counts(self) -> list[tuple[str, int, int]]:
        """(op, count before, count after) for every op that computes, most changed first."""
        def count(nodes: list[NodeInfo]) -> collections.Counter[str]:
            return collections.Counter(n.target for n in nodes if n.op in ("call_module", "call_function", "call_method"))

        before, after = count(self.before), count(self.after)
        ops = sorted(set(before) | set(after), key=lambda op: (-abs(after[op] - before[op]), op))
        return [(op, before[op], after[op]) for op in ops]

    def _why(self, node: NodeInfo) -> str:
        return self.rewritten.get(node.name, "")

    # ------------------------------------------------------------------ text

    def render_text(self, color: bool = False) -> str:
        paint = _ansi if color else (lambda text, _: text)
        removed, added, changed = self.removed, self.added, self.changed
        lines = [
            f"graphopt diff: {self.title}: {len(self.before)} -> {len(self.after)} nodes "
            f"(-{len(removed)} +{len(added)} ~{len(changed)})"
        ]
        counts = [f"{op} {b}->{a}" for op, b, a in self.op_counts() if b != a]
        if counts:
            lines.append("op counts: " + ", ".join(counts))
        width = max([len(n.where) for n in [*removed, *added, *changed]] or [0])
        for mark, label, nodes, colour in (("-", "removed", removed, "31"), ("+", "added", added, "32"), ("~", "changed", changed, "33")):
            for node in nodes:
                why = f"  ({self._why(node)})" if self._why(node) else ""
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

    def _repr_html_(self) -> str:
        esc = html.escape
        removed = {n.name for n in self.removed}
        added = {n.name for n in self.added}
        changed = {n.name for n in self.changed}
        counts = "".join(
            f'<tr class="{"d" if b != a else ""}"><td>{esc(op)}</td><td>{b}</td><td>{a}</td></tr>' for op, b, a in self.op_counts()
        )

        def column(nodes: list[NodeInfo], marks: dict[str, str]) -> str:
            groups: dict[str, list[NodeInfo]] = collections.defaultdict(list)
            for node in nodes:
                groups[node.where.split(".")[0].split(":")[0]].append(node)
            blocks = []
            for group, members in groups.items():
                touched = any(n.name in marks for n in members)
                rows = "".join(
                    f'<tr class="{marks.get(n.name, "")}"><td>{esc(n.where)}</td><td>{esc(n.detail())}</td>'
                    f"<td>{esc(self._why(n))}</td></tr>"
                    for n in members
                )
                open_attr = " open" if touched else ""
                blocks.append(
                    f"<details{open_attr}><summary>{esc(group)} ({len(members)})</summary><table>{rows}</table></details>"
                )
            return "".join(blocks)

        before_marks = {name: "removed" for name in removed} | {name: "changed" for name in changed}
        after_marks = {name: "added" for name in added} | {name: "changed" for name in changed}
        skips = "".join(f"<li><code>{esc(s.where)}</code>: {esc(s.reason)}</li>" for s in self.skips)
        return (
            f'<div class="graphopt-diff"><style>{_CSS}</style>'
            f"<h3>{esc(self.title)}: {len(self.before)} &rarr; {len(self.after)} nodes "
            f'(<span class="removed">-{len(removed)}</span> <span class="added">+{len(added)}</span> '
            f'<span class="changed">~{len(changed)}</span>)</h3>'
            f"<table><tr><th>op</th><th>before</th><th>after</th></tr>{counts}</table>"
            f'<div class="sides"><div><h4>before</h4>{column(self.before, before_marks)}</div>'
            f"<div><h4>after</h4>{column(self.after, after_marks)}</div></div>"
            + (f"<h4>left alone</h4><ul>{skips}</ul>" if skips else "")
            + "</div>"
        )

    def to_html(self, path: str | os.PathLike[str]) -> Path:
        """Write one self-contained HTML file (inline CSS, no scripts, no network) and return its path."""
        destination = Path(path)
        destination.write_text(
            f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(self.title)}</title></head>"
            f"<body>{self._repr_html_()}</body></html>\n",
            encoding="utf-8",
        )
        return destination

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

    def to_svg(self) -> str:
        """The DOT graph rendered by Graphviz's ``dot`` program."""
        dot = shutil.which("dot")
        if dot is None:
            raise GraphoptError(
                "to_svg needs Graphviz's 'dot' program, which is not installed (apt-get install graphviz, or your "
                "platform's package); to_dot() gives the graph as text without it, to_html() renders without Graphviz"
            )
        return subprocess.run([dot, "-Tsvg"], input=self.to_dot(), capture_output=True, text=True, check=True).stdout


def _ansi(text: str, colour: str) -> str:
    return f"\033[{colour}m{text}\033[0m"


_CSS = (
    ".graphopt-diff{font-family:monospace;font-size:12px}.graphopt-diff table{border-collapse:collapse}"
    ".graphopt-diff td,.graphopt-diff th{padding:1px 6px;text-align:left}.graphopt-diff .sides{display:flex;gap:16px}"
    ".graphopt-diff .sides>div{flex:1;min-width:0}.graphopt-diff .removed{background:#f7c5c5}"
    ".graphopt-diff .added{background:#c8f7c5}.graphopt-diff .changed{background:#fff3b0}.graphopt-diff tr.d{font-weight:bold}"
)


def diff(before: Any, after: Any = None) -> GraphDiff:
    """Diff an optimized module against the graph captured before its passes, or two graphs/modules.

    ``diff(optimized)`` uses the snapshot `optimize` took; ``diff(a, b)`` accepts
    ``OptimizedModule``, ``fx.GraphModule`` or ``fx.Graph`` on either side.
    """
    if after is None:
        if not hasattr(before, "graphopt_report"):
            raise GraphoptError("diff(model) needs a module returned by graphopt.optimize; to compare two graphs, pass both")
        report = before.graphopt_report
        rewritten = {r.node: r.detail for p in report.passes for r in p.rewrites if r.node}
        skips = [s for p in report.passes for s in p.skips]
        return GraphDiff("all passes", list(report.captured_nodes), snapshot(before.graph), rewritten, skips)
    return GraphDiff("graphs", snapshot(_graph_of(before)), snapshot(_graph_of(after)))


def _graph_of(value: Any) -> fx.Graph:
    if isinstance(value, fx.Graph):
        return value
    graph = getattr(value, "graph", None)
    if isinstance(graph, fx.Graph):
        return graph
    raise GraphoptError(f"cannot diff a {type(value).__name__}: pass an optimized module, a torch.fx.GraphModule or a torch.fx.Graph")

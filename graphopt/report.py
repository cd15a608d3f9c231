"""What graphopt did to a model: per-pass rewrites, skips with reasons, node changes, errors.

A `Report` is attached to every optimized module as ``.graphopt_report``. It renders as
a text table (``str(report)``), JSON-ready data (``report.to_dict()``) and HTML in a
notebook (``_repr_html_``). ``report.why("layer1.0.bn1")`` answers "why was my
BatchNorm not folded?" from the skip reasons the passes recorded.
"""

from __future__ import annotations

import difflib
import html
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from graphopt.checkpoint import StateChange, state_change_from_dict, state_change_to_dict
from graphopt.errors import InvalidOptionError
from graphopt.timing import Comparison, Ranking


def describe(node: fx.Node) -> str:
    """The name a user knows a node by: its module path when it has one, else the node name."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        # export's paths look like "L['self'].layer1[0].conv1" under strict mode; keep them readable
        return f"{path}:{node.name}" if path else node.name
    return node.name


def target_name(target: Any) -> str:
    """``aten.conv2d.default``, ``conv2d``, ``add`` or a module path: short, and unambiguous for ATen."""
    if isinstance(target, (str, torch._ops.OpOverload)):
        return str(target)
    return getattr(target, "__name__", None) or str(target)


class Reasons(list):
    """What `Report.why` found: a list of lines (old code indexes and compares it as one)
    that prints one reason a line, or says that no pass rewrote or skipped the name."""

    def __init__(self, where: str, lines: Iterable[str] = ()) -> None:
        super().__init__(lines)
        self.where = where

    def __str__(self) -> str:
        return "\n".join(self) if self else f"no pass rewrote or skipped {self.where!r}"

    __repr__ = __str__  # a notebook cell shows the lines, not a bracketed list


@dataclass
class NodeChange:
    """One node a pass created or erased."""

    name: str
    op: str
    target: str
    where: str  # module path (or node name) the user recognises

    @classmethod
    def of(cls, node: fx.Node) -> NodeChange:
        return cls(name=node.name, op=node.op, target=target_name(node.target), where=describe(node))


@dataclass
class Rewrite:
    """One rewrite a pass made."""

    where: str
    detail: str
    node: str = ""  # the node's name in the graph (what diffs match on)


@dataclass
class Skip:
    """One candidate a pass left alone, and why."""

    where: str
    reason: str


@dataclass
class PassReport:
    """What one pass did. Passes fill rewrites and skips; the pipeline fills the rest."""

    name: str
    rewrites: list[Rewrite] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    created: list[NodeChange] = field(default_factory=list)
    erased: list[NodeChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # summaries and decisions, e.g. conversion counts
    state_changes: list[StateChange] = field(default_factory=list)  # stored tensors removed or rewritten (graphopt.checkpoint)
    modified: bool = False
    max_error: float | None = None  # error vs the original model after this pass (None: not verified)
    gradient_error: float | None = None  # training: the largest gradient error, relative to its scale (None: not compared)
    mean_error: float | None = None  # mean error over the worst output, when this pass was verified
    seconds: float = 0.0  # the pass's whole cost: rewriting, its checks against the original, and timing it (measured)
    rolled_back: str = ""  # why: the pass failed verification and the graph is as if it had not run
    measurement: Comparison | None = None  # a measured pass: the timing that decided whether it stayed (None: not measured)
    measurement_cached: bool = False  # that timing was taken in an earlier run on this machine and remembered

    def rewrite(self, node: fx.Node, detail: str) -> None:
        self.rewrites.append(Rewrite(describe(node), detail, node.name))

    def skip(self, node: fx.Node, reason: str) -> None:
        self.skips.append(Skip(describe(node), reason))

    def measurement_lines(self) -> list[str]:
        """The timing behind a measured decision: its interval and verdict, flagged when close or disturbed."""
        if self.measurement is None:
            return []
        source = "remembered from an earlier run on this machine (GRAPHOPT_REMEASURE=1 measures again)" if self.measurement_cached else "measured now"
        lines = [f"timing, {source}: {self.measurement.describe()}"]
        concern = self.measurement.concern()
        return [*lines, f"{self.measurement.verdict.upper()}: {concern}"] if concern else lines


@dataclass
class RegionReport:
    """What the backend did with one pointwise region."""

    name: str
    ops: list[str]
    backend: str
    status: str  # "compiled", "shared" (reuses another region's artifact) or "eager" (backend failed)
    compile_seconds: float = 0.0
    compilations: int = 0  # how many times the backend compiled this region's artifact
    shares_with: str = ""
    reason: str = ""


@dataclass
class FusionReport:
    """The fusion backend's work: one entry per region (one for the whole graph with ``"graph"``)."""

    backend: str
    regions: list[RegionReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def compile_seconds(self) -> float:
        return sum(region.compile_seconds for region in self.regions)

    def lines(self) -> list[str]:
        compiled = sum(region.status != "eager" for region in self.regions)
        artifacts = sum(region.status == "compiled" for region in self.regions)
        summary = f"{compiled}/{len(self.regions)} regions compiled into {artifacts} artifacts in {self.compile_seconds:.2f}s"
        lines = [f"fusion ({self.backend}): {summary}"]
        lines += [f"    {note}" for note in self.notes]
        for region in self.regions:
            how = {"compiled": f"compiled in {region.compile_seconds:.2f}s", "shared": f"shares {region.shares_with}'s artifact"}
            lines.append(f"    {region.name}: {', '.join(region.ops)}: {how.get(region.status, 'eager: ' + region.reason)}")
        return lines


@dataclass
class TuneCandidate:
    """One configuration ``optimize(tune=True)`` considered."""

    name: str
    options: dict[str, Any]
    status: str = "built"  # then "measured", "over budget", "failed"; or "not built"
    seconds: float | None = None  # median seconds per call on the example inputs (throughput: at the report's batch_size)
    max_error: float | None = None  # relative to the output's scale, against the original model
    build_seconds: float | None = None
    reason: str = ""


@dataclass
class TuneReport:
    """What ``optimize(tune=True)`` measured and why the winner won."""

    winner: str
    why: str
    candidates: list[TuneCandidate]
    accuracy: float
    cache: str = "miss"  # "hit": the choice came from the cache, nothing was measured; "rejected": the cached one was not within accuracy here
    seconds: float = 0.0
    ranking: Ranking | None = None  # how the accurate candidates were timed, and how clearly the winner won (None: from the cache)
    batch_size: int | None = None  # tune_target="throughput": the batch every candidate was timed at (None: latency, on the example)

    @property
    def target(self) -> str:
        """What the candidates were ranked by: ``"latency"`` or ``"throughput"`` (optimize's ``tune_target``)."""
        return "latency" if self.batch_size is None else "throughput"

    def lines(self) -> list[str]:
        source = "from the cache, not measured again" if self.cache == "hit" else f"tuned in {self.seconds:.1f}s"
        target = "" if self.batch_size is None else f" for throughput at batch {self.batch_size}"
        lines = [f"tune{target}: {self.winner} ({source}): {self.why}"]
        if self.ranking is not None and self.ranking.concern():
            lines.append(f"    {self.ranking.verdict.upper()}: {self.ranking.concern()}")
        for candidate in self.candidates:
            if candidate.status == "measured" and candidate.seconds is not None:
                time = f"{candidate.seconds * 1e3:.2f} ms"
                if self.batch_size is not None:
                    time = f"{self.batch_size / candidate.seconds:.1f} samples/s ({time} per call)"
                result = f"{time}, " + ("error not measured" if candidate.max_error is None else f"error {candidate.max_error:.1e}")
            else:
                result = f"{candidate.status}: {candidate.reason}"
            lines.append(f"    {'*' if candidate.name == self.winner else ' '} {candidate.name}: {result}")
        return lines


@dataclass
class EngineReport:
    """``optimize(engine=...)``: the runtime the optimized graph was handed to, and how its result was verified."""

    name: str
    precision: str
    build_seconds: float = 0.0
    max_error: float | None = None  # the engine's outputs against the original model's, on the example (None: not verified)
    second_input_error: float | None = None  # the same on the second input
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        verified = "not verified" if self.max_error is None else f"error {self.max_error:.1e} on the example"
        if self.second_input_error is not None:
            verified += f", {self.second_input_error:.1e} on the second input"
        return [f"engine: {self.name} ({self.precision}), built in {self.build_seconds:.1f}s, {verified}", *(f"    {note}" for note in self.notes)]


@dataclass
class GenerationReport:
    """A causal language model's ``generate()``: the graphs it runs, the cache, the times and how it was verified."""

    engine: str  # the engine that runs the prefill and decode graphs
    precision: str
    max_length: int  # prompt + new tokens: the model's position limit
    cache_bytes_per_token: int  # the key/value cache of one token of one sequence
    prefill_seconds: float = 0.0  # the example prompt's prefill
    token_seconds: float = 0.0  # one new token (a decode step), median over the verification's steps
    verified: list[str] = field(default_factory=list)  # how tokens were compared with the original's: greedy on each prompt, seeded sampling
    max_error: float | None = None  # the largest logit error of any step, relative to the logits' scale
    tolerance: float | None = None  # the logit error allowed: fp32's, twice autocast's in bf16, the accuracy budget in int8
    ties: list[str] = field(default_factory=list)  # low precision: where a token differs from the original's, at a tie
    passes: list[str] = field(default_factory=list)  # the PyTorch engine: what graphopt's passes changed in each graph
    compiled: str = ""  # the PyTorch engine: how the decode graph runs (compiled by Inductor, or as ops and why)
    decode_compiled: bool = False  # the decode graph runs compiled (graphopt.load compiles it again)

    def lines(self) -> list[str]:
        exact = "tokens equal to the original's" if self.precision == "fp32" else "tokens equal to the original's up to a tie"
        verified = f"{exact}: {', '.join(self.verified)}" if self.verified else "not verified"
        error = "" if self.max_error is None else f", logits within {self.max_error:.1e}" + (f" (allowed {self.tolerance:.1e})" if self.tolerance is not None else "")
        lines = [
            f"generation: {self.engine} ({self.precision}), prefill and decode graphs with the key/value cache as tensors; up to {self.max_length} positions, "
            f"cache {self.cache_bytes_per_token} bytes per token per sequence",
            f"    prefill {self.prefill_seconds * 1e3:.2f} ms on the example prompt, {self.token_seconds * 1e3:.2f} ms per new token; {verified}{error}",
        ]
        if self.passes:
            lines.append(f"    graphopt's passes on the graphs: {'; '.join(self.passes)}")
        if self.compiled:
            lines.append(f"    {self.compiled}")
        return lines + [f"    a token differs from the original's after a tie: {tie}" for tie in self.ties]


@dataclass
class Report:
    """What `graphopt.optimize` did to a model, pass by pass."""

    mode: str
    frontend: str
    capture_attempts: dict[str, str] = field(default_factory=dict)  # frontend -> why it was not used
    notes: list[str] = field(default_factory=list)
    passes: list[PassReport] = field(default_factory=list)
    verified: bool = True
    tolerance: float | None = None
    second_input: str = ""  # how the second input the final graph was verified on differs from the example ("": none)
    dynamic: str = ""  # the input dimensions calls may vary, e.g. "input_ids dims 0, 1" (see graphopt.dynamic)
    second_input_error: float | None = None  # the final graph's error on it
    second_input_gradient_error: float | None = None  # training: the final graph's gradient error on it
    warnings: list[str] = field(default_factory=list)  # what the user must know: rolled-back passes, side effects, unverifiable outputs
    capture_seconds: float = 0.0
    # where optimize's time went, stage by stage (`graphopt.api.run_stages`): "capture", "passes", "runtime", "other";
    # empty where not recorded (a report saved by an earlier graphopt)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    fusion: FusionReport | None = None  # optimize(fuse=...): what the fusion backend compiled
    tune: TuneReport | None = None  # optimize(tune=True): every candidate measured, and the winner
    engine: EngineReport | None = None  # optimize(engine=...) other than PyTorch: the engine that runs the graph
    generation: GenerationReport | None = None  # a causal language model with its cache: its generate()
    # graph diffs, kept out of to_dict(): per pass (report.diffs[pass_name]), and the
    # captured graph's nodes that graphopt.diff(optimized) compares the result with
    diffs: dict[str, Any] = field(default_factory=dict, repr=False)
    captured_nodes: list[Any] = field(default_factory=list, repr=False)

    def __getitem__(self, pass_name: str) -> PassReport:
        for report in self.passes:
            if report.name == pass_name:
                return report
        raise KeyError(f"no pass named {pass_name!r} ran; ran: {', '.join(p.name for p in self.passes) or 'none'}")

    @property
    def max_error(self) -> float | None:
        """The largest error any pass left (the final graph's, since errors are measured against the original)."""
        errors = [p.max_error for p in self.passes if p.max_error is not None]
        if self.engine is not None and self.engine.max_error is not None:  # the engine computes the final outputs
            errors.append(max(self.engine.max_error, self.engine.second_input_error or 0.0))
        return max(errors) if errors else None

    def why(self, where: str) -> Reasons:
        """Every recorded rewrite or skip that mentions ``where`` (a module path or node name).

        Raises `InvalidOptionError`, with the closest names, when ``where`` is no part of any
        name the report knows (a misspelt layer would otherwise read as "nothing happened").
        """
        found = Reasons(where)
        for p in self.passes:
            found += [f"{p.name}: rewrote {r.where}: {r.detail}" for r in p.rewrites if where in r.where or where in r.detail]
            found += [f"{p.name}: skipped {s.where}: {s.reason}" for s in p.skips if where in s.where]
        if self.engine is not None:  # an engine's int8: the layers it kept in float, "<path>: kept in float: <why>"
            found += [f"engine {self.engine.name}: {note}" for note in self.engine.notes if note.split(":")[0] == where]
        if not found:
            known = self._known_names()  # empty for a report read back from JSON: nothing to check against
            if known and not any(where in name for name in known):
                close = difflib.get_close_matches(where, sorted(known), n=3, cutoff=0.6)
                hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
                raise InvalidOptionError(
                    f"report.why({where!r}): no node or module of the graph is named {where!r}; "
                    f"{hint}names are module paths (e.g. 'layer1.0.bn1') or node names, as in report.diffs and graphopt.diff(model)"
                )
        return found

    def _known_names(self) -> set[str]:
        """Every module path and node name the captured graph and the passes' records mention."""
        names = set()
        for node in self.captured_nodes:
            names.update((node.name, node.where, *node.where.split(":")))
        for p in self.passes:
            names.update(r.where for r in p.rewrites)
            names.update(s.where for s in p.skips)
            names.update(c.where for c in (*p.created, *p.erased))
            names.update(c.name for c in (*p.created, *p.erased))
        return names

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (without the graph diffs); `from_dict` rebuilds it."""
        data = asdict(replace(self, diffs={}, captured_nodes=[]))
        del data["diffs"], data["captured_nodes"]
        for entry, report in zip(data["passes"], self.passes, strict=True):
            entry["state_changes"] = [state_change_to_dict(change) for change in report.state_changes]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Report:
        """The report `to_dict` wrote."""
        fields = dict(data)

        def pass_report(entry: Mapping[str, Any]) -> PassReport:
            entry = dict(entry)
            entry["rewrites"] = [Rewrite(**r) for r in entry["rewrites"]]
            entry["skips"] = [Skip(**s) for s in entry["skips"]]
            entry["created"] = [NodeChange(**c) for c in entry["created"]]
            entry["erased"] = [NodeChange(**c) for c in entry["erased"]]
            entry["state_changes"] = [state_change_from_dict(c) for c in entry["state_changes"]]
            if entry.get("measurement") is not None:
                entry["measurement"] = Comparison(**entry["measurement"])
            return PassReport(**entry)

        fields["passes"] = [pass_report(entry) for entry in fields["passes"]]
        if fields.get("fusion") is not None:
            fields["fusion"] = FusionReport(**{**fields["fusion"], "regions": [RegionReport(**r) for r in fields["fusion"]["regions"]]})
        if fields.get("tune") is not None:
            ranking = fields["tune"].get("ranking")
            fields["tune"] = TuneReport(
                **{**fields["tune"], "candidates": [TuneCandidate(**c) for c in fields["tune"]["candidates"]], "ranking": Ranking(**ranking) if ranking else None}
            )
        if fields.get("engine") is not None:
            fields["engine"] = EngineReport(**fields["engine"])
        if fields.get("generation") is not None:
            fields["generation"] = GenerationReport(**fields["generation"])
        return cls(**fields)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _header(self) -> str:
        parts = [f"mode: {self.mode}", f"frontend: {self.frontend}"]
        failed = [f"{name} failed: {reason}" for name, reason in self.capture_attempts.items()]
        if failed:
            parts[-1] += f" ({'; '.join(failed)})"
        parts.append(f"verify: {'on' if self.verified else 'off'}" + (f", tolerance {self.tolerance:.0e}" if self.verified and self.tolerance else ""))
        header = "graphopt report: " + ", ".join(parts)
        if self.verified and self.second_input:
            error = "" if self.second_input_error is None else f": max error {self.second_input_error:.1e}"
            if self.second_input_gradient_error is not None:
                error += f", gradient error {self.second_input_gradient_error:.1e}"
            header += f"\nsecond input: {self.second_input}{error}"
        if self.dynamic:
            header += f"\ndynamic sizes: {self.dynamic}"
        if self.stage_seconds:
            header += "\n" + self.time_line()
        return header

    def time_line(self) -> str:
        """``time: 61.2 s in all: capture 4.1 s, passes 55.0 s (...), runtime 0.0 s, other 2.1 s``: the whole call accounted
        for (capture: the original's reference run, the second inputs, the graph and its check; passes: the time column,
        each pass's rewriting, checks and timing; runtime: compiling regions or building and verifying an engine)."""
        parts = [f"{stage} {seconds:.1f} s" + (" (the time column: rewriting, checks, timing)" if stage == "passes" else "") for stage, seconds in self.stage_seconds.items()]
        return f"time: {sum(self.stage_seconds.values()):.1f} s in all: " + ", ".join(parts)

    def _columns(self) -> tuple[str, ...]:
        gradients = any(p.gradient_error is not None for p in self.passes)
        return ("pass", "rewrites", "skips", "nodes -/+", "max error", *(("grad error",) if gradients else ()), "time")

    def _rows(self) -> list[tuple[str, ...]]:
        gradients = "grad error" in self._columns()
        rows = []
        for p in self.passes:
            error = "rolled back" if p.rolled_back else "-" if p.max_error is None else f"{p.max_error:.1e}"
            gradient = ("-" if p.rolled_back or p.gradient_error is None else f"{p.gradient_error:.1e}",) if gradients else ()
            rows.append((p.name, str(len(p.rewrites)), str(len(p.skips)), f"-{len(p.erased)}/+{len(p.created)}", error, *gradient, f"{p.seconds:.3f}s"))
        return rows

    def __str__(self) -> str:
        header = self._columns()
        rows = self._rows()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        warned = [f"warning: {warning}" for warning in self.warnings]
        lines = [self._header(), *warned, *self.notes, fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        for p, row in zip(self.passes, rows, strict=True):
            lines.append(fmt.format(*row))
            if p.rolled_back:
                lines.append(f"    rolled back: {p.rolled_back}")
            lines += [f"    {note}" for note in p.notes]
            lines += [f"    {line}" for line in p.measurement_lines()]
            lines += [f"    skipped {s.where}: {s.reason}" for s in p.skips]
        if not self.passes:
            lines.append("(no passes ran)")
        if self.fusion is not None:
            lines += self.fusion.lines()
        if self.engine is not None:
            lines += self.engine.lines()
        if self.generation is not None:
            lines += self.generation.lines()
        if self.tune is not None:
            lines += self.tune.lines()
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape
        columns = self._columns()
        head = "".join(f"<th>{h}</th>" for h in columns)
        body = []
        for p, row in zip(self.passes, self._rows(), strict=True):
            body.append("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>")
            if p.rolled_back:
                body.append(f'<tr><td colspan="{len(columns)}"><b>rolled back</b>: {esc(p.rolled_back)}</td></tr>')
            body += [f'<tr><td colspan="{len(columns)}">{esc(note)}</td></tr>' for note in [*p.notes, *p.measurement_lines()]]
            if p.skips:
                items = "".join(f"<li><code>{esc(s.where)}</code>: {esc(s.reason)}</li>" for s in p.skips)
                body.append(f'<tr><td colspan="{len(columns)}"><details><summary>{len(p.skips)} skipped</summary><ul>{items}</ul></details></td></tr>')
        notes = "".join(f"<p><b>warning</b>: {esc(w)}</p>" for w in self.warnings) + "".join(f"<p>{esc(n)}</p>" for n in self.notes)
        extra = [part.lines() for part in (self.fusion, self.tune) if part is not None]
        fusion = "".join(f"<pre>{esc(chr(10).join(lines))}</pre>" for lines in extra)
        header = "<br>".join(esc(line) for line in self._header().splitlines())
        return f"<div><p><b>{header}</b></p>{notes}<table><tr>{head}</tr>{''.join(body)}</table>{fusion}</div>"

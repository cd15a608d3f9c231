"""The linter's machinery: findings, rules, the facts rules share, checking and fixing source.

A rule is a function ``(tree, facts) -> Iterator[Match]`` registered with `rule`, in one of
the ``graphopt/lint/rules_*.py`` modules. It reports AST nodes; a match may carry an
`Edit` (a source-range replacement) when the fix is safe to apply mechanically.
`check_source` runs every rule; `fix_source` applies the safe edits and checks again.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from graphopt.errors import GraphoptError


@dataclass(frozen=True)
class Edit:
    """Replace the source from (line, col) to (end_line, end_col).

    Positions are as `ast` gives them: 1-based lines, 0-based columns counted in UTF-8 bytes.
    """

    line: int
    col: int
    end_line: int
    end_col: int
    replacement: str


@dataclass(frozen=True)
class Match:
    """A rule's hit: where, optionally a more specific message, and a safe edit when one exists."""

    node: ast.AST
    message: str | None = None
    edit: Edit | None = None


@dataclass(frozen=True)
class Finding:
    """One finding, as reported (JSON keys are these field names, and stay stable)."""

    code: str
    name: str
    message: str
    why: str
    fix: str
    path: str
    line: int
    col: int
    fixable: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col + 1}: {self.code} {self.message}{' [fixable]' if self.fixable else ''}"


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    message: str
    why: str
    fix: str
    check: Callable[[ast.Module, Facts], Iterator[Match]]


RULES: dict[str, Rule] = {}


def rule(code: str, name: str, message: str, why: str, fix: str) -> Callable[[Callable[[ast.Module, Facts], Iterator[Match]]], Callable[[ast.Module, Facts], Iterator[Match]]]:
    """Register a rule under ``code`` (e.g. ``GO201``): one-line message, why it matters, how to fix it."""

    def register(check: Callable[[ast.Module, Facts], Iterator[Match]]) -> Callable[[ast.Module, Facts], Iterator[Match]]:
        if code in RULES:
            raise ValueError(f"rule code {code} registered twice")
        RULES[code] = Rule(code, name, message, why, fix, check)
        return check

    return register


def call_name(node: ast.AST) -> str:
    """Dotted name of a call's function: ``torch.utils.data.DataLoader``, ``model.cuda``, ``DataLoader``; else ""."""
    if isinstance(node, ast.Call):
        node = node.func
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    """The value passed as ``name=`` to ``call``, or None."""
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_constant(node: ast.AST | None, value: Any) -> bool:
    """Whether ``node`` is the literal ``value`` (``True`` is not ``1``)."""
    return isinstance(node, ast.Constant) and type(node.value) is type(value) and node.value == value


def calls(tree: ast.AST) -> Iterator[ast.Call]:
    return (node for node in ast.walk(tree) if isinstance(node, ast.Call))


_LOADER_POSITIONS = {"batch_size": 1, "num_workers": 5, "pin_memory": 7}  # DataLoader's positional order


def dataloader_calls(tree: ast.AST) -> Iterator[ast.Call]:
    """Every ``DataLoader(...)`` call, whatever the dotted form (``torch.utils.data.DataLoader``, ``data.DataLoader``)."""
    return (call for call in calls(tree) if call_name(call).split(".")[-1] == "DataLoader")


def unpacks(call: ast.Call) -> bool:
    """Whether ``call`` passes ``*args`` or ``**kwargs``: then its settings cannot be read from the source."""
    return any(isinstance(arg, ast.Starred) for arg in call.args) or any(k.arg is None for k in call.keywords)


def loader_setting(call: ast.Call, name: str) -> ast.expr | None:
    """The value a DataLoader call passes for ``name``, by keyword or by position, or None."""
    value = keyword(call, name)
    position = _LOADER_POSITIONS.get(name)
    if value is None and position is not None and len(call.args) > position:
        value = call.args[position]
    return value


_OPERATORS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def constant_int(node: ast.AST | None) -> int | None:
    """The value of an int literal or of constant arithmetic on them (``64 * 7 * 7``), else None."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = constant_int(node.left), constant_int(node.right)
        if left is not None and right is not None and not (isinstance(node.op, ast.FloorDiv) and right == 0):
            return _OPERATORS[type(node.op)](left, right)
    return None


_CONV = re.compile(r"(Lazy)?Conv(Transpose)?[123]d|conv(_transpose)?[123]d")


def _is_backward(call: ast.Call) -> bool:
    # any receiver: loss.backward(), scaler.scale(loss).backward(), (loss / k).backward()
    return isinstance(call.func, ast.Attribute) and call.func.attr == "backward"


@dataclass
class Facts:
    """What rules need to know about the whole script, computed once."""

    source: str
    tree: ast.Module
    uses_cuda: bool = False  # .cuda(), device "cuda", torch.cuda.* calls
    uses_amp: bool = False  # torch.autocast / torch.cuda.amp / GradScaler
    has_convs: bool = False  # nn.Conv*/F.conv* anywhere
    training_loops: list[ast.AST] = field(default_factory=list)  # for/while loops that call .backward()

    @classmethod
    def of(cls, source: str, tree: ast.Module) -> Facts:
        names = [call_name(c) for c in calls(tree)]
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        facts = cls(source, tree)
        facts.uses_cuda = any(n.endswith(".cuda") or n.startswith("torch.cuda.") for n in names) or any(s.startswith("cuda") for s in strings)
        facts.uses_amp = any(n.split(".")[-1] in ("autocast", "GradScaler") for n in names)
        facts.has_convs = any(_CONV.fullmatch(n.split(".")[-1]) for n in names)
        facts.training_loops = [
            loop for loop in ast.walk(tree)
            if isinstance(loop, (ast.For, ast.While)) and any(_is_backward(c) for c in calls(loop))
        ]
        return facts


def _load_rules() -> None:
    # importing the rule modules registers their rules
    from graphopt.lint import rules_data, rules_device, rules_model, rules_training  # noqa: F401


def check_source(source: str, path: str = "<string>", select: Iterable[str] | None = None) -> list[Finding]:
    """Every finding of the registered rules (or of ``select``'s codes) in ``source``, in line order."""
    return [finding for finding, _ in _matches(source, path, select)]


def _matches(source: str, path: str, select: Iterable[str] | None) -> list[tuple[Finding, Edit | None]]:
    _load_rules()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as error:
        raise GraphoptError(f"{path}:{error.lineno}: cannot lint a file that does not parse ({error.msg})") from error
    facts = Facts.of(source, tree)
    codes = set(select) if select is not None else set(RULES)
    unknown = codes - set(RULES)
    if unknown:
        raise GraphoptError(f"unknown lint rule codes {sorted(unknown)}: known codes are {', '.join(sorted(RULES))}")
    lines = _byte_lines(source)
    found = []
    for code in sorted(codes):
        current = RULES[code]
        for match in current.check(tree, facts):
            line = getattr(match.node, "lineno", 1)
            column = len(lines[line - 1][: getattr(match.node, "col_offset", 0)].decode(errors="ignore")) if line <= len(lines) else 0
            finding = Finding(
                current.code, current.name, match.message or current.message, current.why, current.fix, path,
                line, column, match.edit is not None,
            )
            found.append((finding, match.edit))
    return sorted(found, key=lambda item: (item[0].line, item[0].col, item[0].code))


def _byte_lines(source: str) -> list[bytes]:
    """The source's lines as `ast` numbers them (split on newlines only), in UTF-8 bytes, endings kept."""
    return source.encode().splitlines(keepends=True) or [b""]


def fix_source(source: str, path: str = "<string>", select: Iterable[str] | None = None) -> tuple[str, list[Finding]]:
    """Apply every safe fix and return the new source with the findings that remain.

    Edits are applied bottom-up, one at a time, each kept only if the file still parses;
    an edit overlapping one already applied waits for the next run (its finding remains).
    """
    edits = sorted(
        {edit for _, edit in _matches(source, path, select) if edit is not None},
        key=lambda e: (e.line, e.col, e.end_line, e.end_col, e.replacement),
        reverse=True,
    )
    offsets = [0]
    for line in _byte_lines(source):
        offsets.append(offsets[-1] + len(line))
    fixed, last_start = source.encode(), len(source.encode()) + 1
    for edit in edits:
        start = offsets[edit.line - 1] + edit.col
        end = offsets[edit.end_line - 1] + edit.end_col
        if end > last_start or (end == last_start and start == end):  # overlaps, or inserts at the same place
            continue
        candidate = fixed[:start] + edit.replacement.encode() + fixed[end:]
        try:
            ast.parse(candidate)
        except SyntaxError:
            continue
        fixed, last_start = candidate, start
    text = fixed.decode()
    return text, check_source(text, path, select)


def replace_node(node: ast.AST, replacement: str) -> Edit:
    """An edit replacing the source of ``node`` (an expression) with ``replacement``."""
    return Edit(node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or node.col_offset, replacement)


def add_keyword(call: ast.Call, text: str, source: str) -> Edit | None:
    """An edit appending the keyword argument ``text`` (e.g. ``non_blocking=True``) to ``call``.

    None when the call cannot take one more argument textually (a bare generator argument).
    """
    end_line, end_col = call.end_lineno or call.lineno, (call.end_col_offset or 1) - 1  # at the closing ")"
    arguments = [*call.args, *call.keywords]
    if not arguments:
        return Edit(end_line, end_col, end_line, end_col, text)
    if len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.GeneratorExp):
        return None
    last = max(arguments, key=lambda a: (a.end_lineno or 0, a.end_col_offset or 0))
    lines = _byte_lines(source)
    between = b"".join(lines[(last.end_lineno or 1) - 1 : end_line])
    start = last.end_col_offset or 0
    stop = len(between) - len(lines[end_line - 1]) + end_col
    gap = between[start:stop].decode(errors="ignore")
    has_comma = "," in "".join(part.split("#")[0] for part in gap.splitlines())
    return Edit(end_line, end_col, end_line, end_col, f" {text}" if has_comma else f", {text}")

"""The import rules of docs/architecture.md, and pass names spelled only in the registry.

Imports point one way: cli/api -> pipeline/capture -> passes -> ops. A pass never imports
the API, the CLI, a backend or the tuner; ops and runtime import no pass; backends do
not import the API. Pass names appear as strings only in graphopt/passes/ (the registry
and each pass's own module): every other list of passes is derived from `PassInfo`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from graphopt.passes import REGISTRY

PACKAGE = Path(__file__).resolve().parent.parent / "graphopt"

# (modules, what they must not import); a name covers its submodules
RULES = [
    ("graphopt.passes", ("graphopt.api", "graphopt.cli", "graphopt.backends", "graphopt.tuning", "graphopt.export", "graphopt.pipeline", "graphopt.bench")),
    ("graphopt.ops", ("graphopt.passes", "graphopt.api", "graphopt.cli", "graphopt.backends", "graphopt.tuning", "graphopt.pipeline", "graphopt.runtime")),
    ("graphopt.runtime", ("graphopt.passes", "graphopt.api", "graphopt.cli", "graphopt.backends", "graphopt.tuning", "graphopt.pipeline", "graphopt.export")),
    ("graphopt.backends", ("graphopt.api", "graphopt.cli", "graphopt.export", "graphopt.tuning", "graphopt.bench")),
    ("graphopt.pipeline", ("graphopt.api", "graphopt.cli", "graphopt.backends", "graphopt.tuning", "graphopt.export")),
    ("graphopt.models", ("graphopt",)),  # reference models are plain torch
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path) -> set[str]:
    """The graphopt modules ``path`` imports, at any depth (including imports inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from graphopt import api`
    return {name for name in names if name == "graphopt" or name.startswith("graphopt.")}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("package", "forbidden"), RULES, ids=[package for package, _ in RULES])
def test_imports_point_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    broken = [
        f"{name} imports {target}"
        for name, path in modules().items()
        if within(name, package)
        for target in sorted(imported(path))
        if any(within(target, rule) for rule in forbidden) and not within(target, package)
    ]
    assert broken == []


def test_the_rules_see_the_modules_they_govern() -> None:
    """A rule about a package that no longer exists, or an import scan that finds nothing, would pass vacuously."""
    names = modules()
    for package, _ in RULES:
        assert any(within(name, package) for name in names), package
    assert "graphopt.passes.base" in imported(names["graphopt.passes.fold_conv_bn"])
    assert "graphopt.api" in imported(names["graphopt.export"])


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of the module, its classes and functions."""
    owners = [node for node in ast.walk(tree) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return {
        id(owner.body[0].value)
        for owner in owners
        if owner.body and isinstance(owner.body[0], ast.Expr) and isinstance(owner.body[0].value, ast.Constant)
    }


def pass_names_in_strings(path: Path) -> list[str]:
    """Pass names in the string literals of ``path`` (docstrings excluded: they document, they do not select)."""
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, REGISTRY)) + r")\b")  # not torch.as_tensor
    tree = ast.parse(path.read_text())
    skipped = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {match}" for match in pattern.findall(node.value)]
    return found


def test_pass_names_are_spelled_only_in_the_passes_package() -> None:
    outside = [found for name, path in modules().items() if not within(name, "graphopt.passes") for found in pass_names_in_strings(path)]
    assert outside == []


def test_the_pass_name_scan_finds_names() -> None:
    assert pass_names_in_strings(PACKAGE / "passes" / "__init__.py")

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

# docs/architecture.md's layers, top down: a module imports from its own layer or below; a name covers its submodules
LAYERS = {
    "entry points": (
        "graphopt", "graphopt.cli", "graphopt.cli_arguments", "graphopt.cli_optimize", "graphopt.cli_run", "graphopt.cli_bench", "graphopt.cli_lint",
        "graphopt.cli_listings", "graphopt.bench", "graphopt.lint", "graphopt.data",
    ),
    "API": ("graphopt.api", "graphopt.export", "graphopt.saving", "graphopt.load_safety", "graphopt.archive_metadata", "graphopt.tuning", "graphopt.precision"),
    "backends": ("graphopt.backends",),
    "pipeline": ("graphopt.pipeline", "graphopt.capture", "graphopt.validate", "graphopt.side_effects", "graphopt.user_objects", "graphopt.device"),
    "passes": ("graphopt.passes",),
    "runtime": ("graphopt.runtime",),
    "ops": ("graphopt.ops",),
    "foundations": (
        "graphopt.verify", "graphopt.inputs", "graphopt.trees", "graphopt.dynamic", "graphopt.report", "graphopt.diff", "graphopt.drawing", "graphopt.browser", "graphopt.checkpoint", "graphopt.errors",
        "graphopt.timing", "graphopt.prefetch", "graphopt.progress", "graphopt.quiet", "graphopt.models",
    ),
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path) -> set[str]:
    """The graphopt modules ``path`` imports, at any depth (imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}  # `import graphopt`: the public API, an entry point
        elif isinstance(node, ast.ImportFrom) and node.module == "graphopt":  # `from graphopt import verify, __version__`
            submodules = {alias.name for alias in node.names if (PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").is_file()}
            names |= {f"graphopt.{name}" for name in submodules} | ({"graphopt"} if len(submodules) < len(node.names) else set())
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {name for name in names if name == "graphopt" or name.startswith("graphopt.")}


def within(name: str, package: str) -> bool:
    return name == package or (package != "graphopt" and name.startswith(package + "."))


def layer_of(name: str) -> int:
    """The index of the layer owning module ``name`` (the longest matching prefix wins)."""
    owners = [(len(package), index) for index, packages in enumerate(LAYERS.values()) for package in packages if within(name, package)]
    assert owners, f"{name} belongs to no layer of docs/architecture.md: add it to LAYERS and to the document"
    return max(owners)[1]


def test_every_module_belongs_to_a_layer() -> None:
    for name in modules():
        layer_of(name)


def test_imports_point_down_the_layers() -> None:
    names = list(LAYERS)
    upward = [
        f"{name} ({names[layer_of(name)]}) imports {target} ({names[layer_of(target)]})"
        for name, path in modules().items()
        for target in sorted(imported(path))
        if layer_of(target) < layer_of(name)
    ]
    assert upward == []


# the rules the issue names, kept apart so that a change to LAYERS cannot quietly drop them
RULES = [
    ("graphopt.passes", ("graphopt.api", "graphopt.cli", "graphopt.backends", "graphopt.tuning")),
    ("graphopt.ops", ("graphopt.passes",)),
    ("graphopt.runtime", ("graphopt.passes",)),
    ("graphopt.backends", ("graphopt.api", "graphopt.export")),
    ("graphopt.models", ("graphopt",)),  # reference models are plain torch
]


@pytest.mark.parametrize(("package", "forbidden"), RULES, ids=[package for package, _ in RULES])
def test_named_import_rules(package: str, forbidden: tuple[str, ...]) -> None:
    broken = [
        f"{name} imports {target}"
        for name, path in modules().items()
        if within(name, package)
        for target in sorted(imported(path))
        if any(target == rule or target.startswith(rule + ".") for rule in forbidden) and not within(target, package)
    ]
    assert broken == []


def test_the_rules_see_the_modules_they_govern() -> None:
    """A rule about a package that no longer exists, or an import scan that finds nothing, would pass vacuously."""
    names = modules()
    for package, _ in RULES:
        assert any(within(name, package) for name in names), package
    assert "graphopt.passes.base" in imported(names["graphopt.passes.fold_conv_bn"])
    assert "graphopt.verify" in imported(names["graphopt.capture"])
    assert layer_of("graphopt.api") < layer_of("graphopt.passes") < layer_of("graphopt.ops")


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

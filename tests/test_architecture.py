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
    "API": ("graphopt.api", "graphopt.options", "graphopt.stages", "graphopt.generation", "graphopt.generation_build", "graphopt.export", "graphopt.saving", "graphopt.load_safety", "graphopt.archive_metadata", "graphopt.archive_files", "graphopt.generation_archive", "graphopt.tuning", "graphopt.precision"),
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


# sizes that keep a module readable in one sitting (bench/ and models/ are scripts and model definitions)
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_OPTIMIZE_BODY_LINES = 600, 120, 80


def sized_modules() -> dict[str, Path]:
    return {name: path for name, path in modules().items() if not (within(name, "graphopt.bench") or within(name, "graphopt.models"))}


def function_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
    """A function's lines, decorators included, and its body's, docstring excluded."""
    body = function.body[1:] if function.body and id(getattr(function.body[0], "value", None)) in docstrings(function) else function.body
    first = function.decorator_list[0].lineno if function.decorator_list else function.lineno
    return function.end_lineno - first + 1, (body[-1].end_lineno - body[0].lineno + 1) if body else 0  # type: ignore[operator]


def test_modules_and_functions_stay_short() -> None:
    """No module over 600 lines, no function over 120 (argparse parser builders aside), optimize's body (its
    docstring, the user's documentation, aside) at most 80: a new capability gets its own stage or module."""
    too_long = []
    for name, path in sized_modules().items():
        tree = ast.parse(path.read_text())
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            total, body = function_lines(node)
            if name == "graphopt.api" and node.name == "optimize":
                if body > MAX_OPTIMIZE_BODY_LINES:
                    too_long.append(f"graphopt.api.optimize: its body is {body} lines")
            elif total > MAX_FUNCTION_LINES and not node.name.endswith("parser"):
                too_long.append(f"{name}.{node.name}: {total} lines")
    assert too_long == []


def test_the_size_rule_sees_what_it_measures() -> None:
    api = ast.parse((PACKAGE / "api.py").read_text())
    (optimize,) = [node for node in ast.walk(api) if isinstance(node, ast.FunctionDef) and node.name == "optimize"]
    total, body = function_lines(optimize)
    assert 10 < body < total  # the docstring is counted out of the body, not the whole function
    assert "graphopt.api" in sized_modules() and "graphopt.bench.harness" not in sized_modules()


def test_the_documented_stages_are_the_ones_optimize_runs() -> None:
    """docs/architecture.md's stage table lists, in order, the functions `api.run_stages` calls after check_options."""
    document = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = document.split("## `optimize`, stage by stage", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| \w+ \| `(?:options|stages)\.(\w+)` \|", section, flags=re.MULTILINE)
    api = ast.parse((PACKAGE / "api.py").read_text())
    (run_stages,) = [node for node in api.body if isinstance(node, ast.FunctionDef) and node.name == "run_stages"]
    calls = sorted((node.lineno, node.func.id) for node in ast.walk(run_stages) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name))
    called = [name for _, name in calls]
    stages = [name for name in called if name in ("prepare", "capture_model", "rewrite", "build_runtime", "assemble")]
    assert documented == ["check_options", *stages]
    assert stages == ["prepare", "capture_model", "rewrite", "build_runtime", "assemble"]

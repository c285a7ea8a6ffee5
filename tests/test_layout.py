"""The layout's promises, read from the code (AST), not from a running process.

A running process only shows the imports one path through the code made;
the source shows every import, including those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "guardian"
CONCERNS = {"engine", "admission", "health", "supervise", "plugins", "distributed", "access"}


def module_file(name: str) -> Path | None:
    """The file of a guardian module or package, or None for anything else."""
    parts = name.split(".")
    if parts[0] != "guardian":
        return None
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def module_name(path: Path) -> str:
    """guardian/a/b.py -> guardian.a.b; a package's __init__ counts as a module inside it."""
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def imported_names(path: Path, module: str | None = None) -> set[str]:
    """Every module an ``import`` anywhere in the file names (functions included)."""
    names = set()
    package = module or module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.rsplit(".", node.level)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            names.add(module)
            # ``from guardian.plugins import hookspecs`` imports a module too.
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def with_parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__, a/b/__init__ and a/b/c."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def transitive_imports(root: str) -> dict[str, set[str]]:
    """For every guardian module reachable from ``root``: what it imports."""
    seen: dict[str, set[str]] = {}
    todo = with_parents(root)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = module_file(name)
        if path is None:
            continue
        seen[name] = imported_names(path)
        for imported in seen[name]:
            todo.extend(n for n in with_parents(imported) if n not in seen)
    return seen


def top(name: str) -> str:
    return name.split(".")[0]


def test_subprocess_mode_imports_neither_mlx_nor_mlx_lm():
    reached = transitive_imports("guardian.supervise.supervisor")
    assert "guardian.supervise.proxy" in reached  # the walk follows guardian imports
    offenders = {
        module: sorted(n for n in names if top(n) in ("mlx", "mlx_lm"))
        for module, names in reached.items()
    }
    offenders = {module: names for module, names in offenders.items() if names}
    assert not offenders, f"subprocess mode would load mlx: {offenders}"


@pytest.mark.parametrize("root", ["guardian.access", "guardian.access.policy", "guardian.plugins.access"])
def test_the_door_imports_no_mlx(root):
    """The supervisor's public port runs the same door as the server (issue 21)."""
    reached = transitive_imports(root)
    assert root in reached  # the walk starts where it should
    offenders = {module: sorted(n for n in names if top(n) in ("mlx", "mlx_lm"))
                 for module, names in reached.items()}
    assert not {m: n for m, n in offenders.items() if n}, f"the door would load mlx: {offenders}"


def test_the_engine_knows_nothing_of_admission():
    offenders = {}
    for path in (PACKAGE / "engine").glob("*.py"):
        names = [n for n in imported_names(path) if n.startswith("guardian.admission")]
        if names:
            offenders[path.name] = names
    assert not offenders, f"guardian/engine imports admission: {offenders}"


def test_packages_are_one_level_deep_by_concern():
    packages = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")}
    packages.discard(".")
    assert packages == CONCERNS


@pytest.mark.parametrize("concern", sorted(CONCERNS))
def test_each_concern_says_what_it_is(concern):
    init = PACKAGE / concern / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"guardian/{concern}/__init__.py has no docstring"


def test_the_walk_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import mlx.core as mx\n    from mlx_lm import server\n"
                      "    from ..stock import x\n")
    names = imported_names(source, module="guardian.supervise.m")
    assert {"mlx.core", "mlx_lm", "mlx_lm.server", "guardian.stock"} <= names

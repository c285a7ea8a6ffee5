"""The layout's promises, read from the code (AST), not from a running process.

A running process only shows the imports one path through the code made;
the source shows every import, including those inside functions.

guardian/ is one level of packages by concern, in layers: a module imports
modules of its own layer and of the layers below, never above, and no two
modules import each other, directly or around a loop (docs/development.md,
"Layout").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "guardian"
CONCERNS = {"access", "admission", "config", "distributed", "engine", "health", "observability", "plugins",
            "quarantine", "serving", "stock", "supervise"}
# The modules at the package's root: the public face, the plugin machinery, what every layer shares.
ROOT_MODULES = {"__init__", "__main__", "cli", "hookspecs", "plugin_manager", "engine_view", "errors",
                "exit_codes", "relay_protocol", "handoff", "request_context", "demo_model", "long_lived"}

# Bottom to top. A module belongs to the longest prefix listed; ``guardian`` is
# the package's __init__ (hookimpl, EngineView, GuardianError: what plugins import).
LAYERS = (
    # Leaves: they import nothing of guardian.
    {"guardian.observability", "guardian.exit_codes", "guardian.relay_protocol", "guardian.hookspecs",
     "guardian.long_lived"},
    # What every layer reads: errors, the configuration, the request a thread serves.
    # The hand-off (both ends, like the relay protocol it carries).
    {"guardian.errors", "guardian.config", "guardian.request_context", "guardian.demo_model", "guardian.handoff"},
    # The plugin machinery: the manager, the view hooks receive, the public face.
    {"guardian.plugin_manager", "guardian.engine_view", "guardian"},
    # Stock mlx_lm, embedded.
    {"guardian.stock"},
    # The door (no mlx: the supervisor runs it too).
    {"guardian.access"},
    # The engine, what stands before it and what watches it; a group of ranks is an engine too.
    {"guardian.admission", "guardian.engine", "guardian.health", "guardian.quarantine", "guardian.distributed"},
    # The built-in plugins, registered like anyone's.
    {"guardian.plugins"},
    # Processes: one server, the supervisor.
    {"guardian.serving", "guardian.supervise"},
    # The command.
    {"guardian.cli", "guardian.__main__"},
)


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
    """guardian/a/b.py -> guardian.a.b; guardian/a/__init__.py -> guardian.a."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str | None = None) -> set[str]:
    """Every module an ``import`` anywhere in the file names (functions included)."""
    names = set()
    name = module or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                imported = f"{base}.{node.module}" if node.module else base
            else:
                imported = node.module
            names.add(imported)
            # ``from guardian.stock import loop`` imports a module too.
            names.update(f"{imported}.{alias.name}" for alias in node.names)
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


# -- the graph of guardian's own imports ---------------------------------------------------------
def guardian_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Each guardian module -> the guardian modules it imports (the module named, not its parents)."""
    modules = guardian_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path):
            # ``from a import b``: the module a.b if there is one, else a.
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def layer_of(module: str) -> int | None:
    """The layer of the longest prefix of ``module`` that LAYERS lists."""
    for name in reversed(with_parents(module)):
        for level, members in enumerate(LAYERS):
            if name in members:
                return level
    return None


# -- tests -----------------------------------------------------------------------------------------
def test_no_module_imports_itself_back():
    """No import cycle among guardian's modules, counting imports inside functions."""
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in guardian_modules() if layer_of(m) is None)
    assert not unplaced, f"add these to LAYERS in tests/test_layout.py: {unplaced}"


def test_no_import_goes_up_the_layers():
    upward = sorted(f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
                    for module, targets in import_graph().items() for target in targets
                    if layer_of(target) > layer_of(module))
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_a_built_in_plugin_imports_no_other_plugin():
    """Each built-in can be disabled ([guardian] disabled_plugins): none may need another."""
    offenders = {module: sorted(t for t in targets if t.startswith("guardian.plugins."))
                 for module, targets in import_graph().items() if module.startswith("guardian.plugins.")}
    offenders = {module: targets for module, targets in offenders.items() if targets}
    assert not offenders, f"built-in plugins importing plugins: {offenders}"


def test_the_plugin_machinery_lives_at_the_root():
    """guardian/plugins/ holds built-in plugins only; the hookspecs and the manager are the core's."""
    assert (PACKAGE / "hookspecs.py").exists() and (PACKAGE / "plugin_manager.py").exists()
    for path in (PACKAGE / "plugins").glob("*.py"):
        if path.name != "__init__.py":
            classes = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
            assert any(any(isinstance(s, ast.Assign) and any(getattr(t, "id", None) == "name" for t in s.targets)
                           for s in c.body) for c in classes), f"{path.name} is not a plugin (a class with a name)"


def test_the_root_holds_only_what_every_concern_shares():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == ROOT_MODULES, f"modules at guardian/'s root: {sorted(loose - ROOT_MODULES)} new, " \
                                  f"{sorted(ROOT_MODULES - loose)} gone; put a module in its concern's package"


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
                      "    from ..stock import contract\n")
    names = imported_names(source, module="guardian.supervise.m")
    assert {"mlx.core", "mlx_lm", "mlx_lm.server", "guardian.stock", "guardian.stock.contract"} <= names


def test_a_cycle_is_found_however_long():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_development_guides_layout_names_every_module_and_benchmark():
    """The layout table in docs/development.md is written by hand: six modules and eight
    benchmarks had come since it last named them all."""
    guide = (REPO / "docs" / "development.md").read_text()
    unnamed = [str(path.relative_to(REPO)) for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "__init__.py" and f"{path.name}`" not in guide and f"`{path.stem}`" not in guide]
    unnamed += [str(path.relative_to(REPO)) for path in sorted((REPO / "bench").glob("*.py"))
                if f"`{path.name}`" not in guide]
    assert not unnamed, f"not in docs/development.md's layout: {unnamed}"

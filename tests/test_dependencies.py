"""Every third-party module guardian/ imports is a dependency pyproject.toml
declares: one that only arrives through another package (huggingface_hub and
tokenizers, through mlx-lm's transformers) can go away in that package's next
release."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.one_version

REPO = Path(__file__).resolve().parent.parent


def imported_modules() -> dict[str, set[str]]:
    """Top-level module name -> the guardian files importing it (lazy imports included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "guardian").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {canonicalize_name(Requirement(line).name) for line in project["dependencies"]}


def test_every_third_party_import_is_a_declared_dependency():
    imported = imported_modules()
    assert {"mlx_lm", "structlog", "guardian"} <= set(imported)  # the walk saw the imports
    declared = declared_distributions()
    # Module -> the installed distributions providing it. A module that is
    # not installed here (tomli on Python >= 3.11) is looked up by its own name.
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for module, files in imported.items():
        if module in sys.stdlib_module_names or module == "guardian":
            continue
        distributions = {canonicalize_name(name) for name in providers.get(module, [module])}
        if not distributions & declared:
            undeclared[module] = sorted(files)
    assert undeclared == {}, f"imported but not in [project] dependencies: {undeclared}"

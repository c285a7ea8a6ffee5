"""The docs site builds, its reference pages say what the code says, and the README stays short.

The site (mkdocs.yml, docs/) is built with ``--strict``: a broken link, a
missing anchor or image, a snippet that names nothing, or a page left out of
the nav fails it. The reference pages (docs/reference/) are written from the
code by tools/docs_reference.py; a page that differs from what the script
writes now is stale. None of this depends on mlx-lm's version, so it runs on
the newest venv only; the command line page depends on the installed
mlx-lm and Python, and is compared only where they are the ones it was
written with.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.one_version]

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# A user reads the README's first screens; the rest is in docs/.
README_MAX_BYTES = 10 * 1024


def docs_reference():
    """tools/docs_reference.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "tools" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_with_strict_checks(tmp_path):
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for page in ("index.html", "quickstart/index.html", "reference/settings/index.html", "images/soak-inprocess.png"):
        assert (tmp_path / "site" / page).exists(), page
    home = (tmp_path / "site" / "index.html").read_text()
    # The home page takes the README's incident table through a snippet.
    assert "hangs forever" in home and "--8&lt;--" not in home


def test_reference_pages_are_current():
    module = docs_reference()
    files = module.rendered([name for name in module.PAGES if name != "cli.md"])
    files.update({path: content for path, content in module.rendered().items() if path.suffix == ".png"})
    stale = [str(path.relative_to(REPO)) for path in module.stale(files)]
    assert not stale, f"stale: {stale}; regenerate with {module.REGENERATE}"


def test_command_line_reference_is_current():
    module = docs_reference()
    page = module.REFERENCE / "cli.md"
    written_with = module.cli_page_written_with(page.read_text())
    if written_with != module.written_with():
        pytest.skip(f"{page.name} was written with {written_with}; this is {module.written_with()}")
    assert not module.stale(module.rendered(["cli.md"])), f"{page.name} is stale; regenerate with {module.REGENERATE}"


def test_readme_is_short_and_links_into_the_docs():
    text = README.read_text()
    assert len(text.encode()) <= README_MAX_BYTES, f"README.md is {len(text.encode())} bytes; move text into docs/"
    targets = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)
               if "://" not in target and not target.startswith("#")]
    assert any(target.startswith("docs/") for target in targets)
    missing = [target for target in targets if not (REPO / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


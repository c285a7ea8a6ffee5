"""What a bug report needs first: this build's version and those of what it runs on.

From the installed distributions' metadata, so the supervisor can say it
without importing mlx or mlx_lm.
"""

from __future__ import annotations

import importlib.metadata
import platform

DISTRIBUTIONS = ("mlx-guardian", "mlx-lm", "mlx")


def installed(name: str) -> str:
    """A distribution's installed version, or "not installed"."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def version_line() -> str:
    """``mlx-guardian 0.1.0 (mlx-lm 0.32.2, mlx 0.32.4, Python 3.11.7)``: what ``--version`` prints."""
    guardian, *rest = DISTRIBUTIONS
    runs_on = ", ".join(f"{name} {installed(name)}" for name in rest)
    return f"{guardian} {installed(guardian)} ({runs_on}, Python {platform.python_version()})"

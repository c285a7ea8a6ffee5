"""What every benchmark here reports with: percentiles and the machine it ran on."""

from __future__ import annotations

import importlib.metadata
import os
import platform


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def environment() -> str:
    """Versions and CPUs, for the first line of a report."""
    return (f"mlx-lm {importlib.metadata.version('mlx-lm')}, mlx {importlib.metadata.version('mlx')}, "
            f"Python {platform.python_version()}, {os.cpu_count()} CPUs ({platform.machine()})")

"""The benchmark that builds the guardian's engine in-process runs (bench/admission_cost.py):
it reaches into the engine's own classes, where a change elsewhere breaks it first. It
passed the engine where the hooks take its EngineView for a week, then hung on exit,
until a run of every benchmark as documented found it. The others start servers as
users do and are run by hand (bench/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_the_in_process_admission_benchmark_runs(model_cache):
    result = subprocess.run([sys.executable, "bench/admission_cost.py", "--requests", "5"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MLX_GUARDIAN_CACHE": str(model_cache)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the guard's own work" in result.stdout

"""What the supervisor's health check of its child costs, idle: each process's CPU per check.

``mlx-guardian --supervise`` asks its child ``GET /readyz`` every
``[supervisor] interval_s`` (1 s by default). This starts it on the demo
model twice, at the default pace and at ``--fast`` checks a second, lets each
idle for ``--seconds``, and reads the supervisor's and the child's CPU (psutil).
The difference between the two paces, over the checks it added, is
what one check costs each side; the default pace's figures are the pair's idle
CPU. It is a benchmark, not a test.

    .venv/bin/python bench/health_check_cost.py     # ~1 min
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from relay_cost import child_pid, cpu_seconds, demo_model, server_env, start_server
from stats import environment

DEFAULT_INTERVAL_S = 1.0
SETTLE_S = 3.0  # past start-up's faster checks and the first requests' work


def idle_cpu(model: Path, workdir: Path, interval_s: float, seconds: float) -> tuple[float, float]:
    """The supervisor's and the child's CPU, ms a second, idle at one check every ``interval_s``."""
    config = workdir / f"interval-{interval_s:g}.toml"
    config.write_text(f"[supervisor]\ninterval_s = {interval_s}\n")
    command = [sys.executable, "-m", "guardian", "--supervise", "--model", str(model), "--host", "127.0.0.1",
               "--guardian-config", str(config)]
    server = start_server("supervise", command, workdir, server_env(), None)  # its log: supervise.log
    try:
        time.sleep(SETTLE_S)
        child = child_pid(server)
        supervisor_before, child_before = cpu_seconds(server.proc.pid), cpu_seconds(child)
        time.sleep(seconds)
        return (1000 * (cpu_seconds(server.proc.pid) - supervisor_before) / seconds,
                1000 * (cpu_seconds(child) - child_before) / seconds)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="each idle window")
    parser.add_argument("--fast", type=float, default=20.0, help="checks a second in the second window")
    args = parser.parse_args()

    model = demo_model()
    with tempfile.TemporaryDirectory(prefix="bench-health-check-") as workdir:
        default = idle_cpu(model, Path(workdir), DEFAULT_INTERVAL_S, args.seconds)
        fast = idle_cpu(model, Path(workdir), 1 / args.fast, args.seconds)
    added_checks_per_s = args.fast - 1 / DEFAULT_INTERVAL_S
    print(f"Health check cost, {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}: {environment()}; demo model; "
          f"idle windows of {args.seconds:g} s at 1 and {args.fast:g} checks a second.\n")
    print("| | supervisor | child |\n|---|---|---|")
    print(f"| idle CPU, 1 check a second | {default[0]:.2f} ms/s | {default[1]:.2f} ms/s |")
    print(f"| idle CPU, {args.fast:g} checks a second | {fast[0]:.2f} ms/s | {fast[1]:.2f} ms/s |")
    print(f"| **CPU per check** | **{(fast[0] - default[0]) / added_checks_per_s:.2f} ms** | "
          f"**{(fast[1] - default[1]) / added_checks_per_s:.2f} ms** |")


if __name__ == "__main__":
    main()

"""Live configuration churn: saves every fraction of a second, under load and planted faults.

A fresh server on the offline demo model (``inprocess``: one process; ``supervise``:
``--supervise``, the supervisor and its child both reading the file) while 8 clients loop
as in ``soak.py``, and the fault-injection plugin raises the incident's error every 60 or
80 engine steps. Meanwhile the script saves the ``--guardian-config`` file every 0.1-0.6 s
(seeded), half the saves in place (truncate, then 0-20 ms later write: ``open(path, "w")``),
half by rename, each time with a random choice of values for the live settings of most tables
(each value one a deployment could run with: no save makes a client's request fail).

What it counts (goal: none of the first three):

- client-visible failures, judged as ``soak.py`` judges them;
- reads of an empty file: a save in place read between its truncate and its write put
  every setting at its default for a moment (a key file: every key gone). The server
  logs each read with the file's SHA-256, and an empty file's is well known;
- ``config_reload_failed`` and other errors the server logged (the planted faults'
  ``fault_injected`` and ``engine_error`` aside);
- the saves, and how many reads they made (saves that come before a read coalesce).

    .venv/bin/python bench/config_churn.py inprocess [--seconds 60]
    .venv/bin/python bench/config_churn.py supervise
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

import soak
from servers import Server, free_port, poll_until

EMPTY_FILE_SHA256 = hashlib.sha256(b"").hexdigest()
# Logged by the planted faults themselves, and expected by the hundred.
PLANTED = ("fault_injected", "engine_error")


def random_config(rng: random.Random, supervise: bool) -> str:
    """One save: every table's live settings drawn from values a deployment could run with."""
    pick = rng.choice
    tables = {
        "guardian": dict(log_level=pick(['""', '"INFO"', '"WARNING"']), retry_after_s=pick([1.0, 2.0]),
                         max_stop_sequences=pick([16, 32]), request_timeout_s=pick([0.0, 120.0])),
        "watchdog": dict(interval_s=pick([0.05, 0.25, 1.0]), stall_min_s=pick([3.0, 5.0]),
                         stall_pace_factor=pick([4.0, 8.0]), pace_samples=pick([16, 32, 64]),
                         probe_interval_s=pick([0.5, 30.0]), probe_retry_s=pick([1.0, 5.0]),
                         probe_timeout_s=pick([5.0, 10.0]), probe_max_age_s=pick([60.0, 120.0]),
                         deep_check_reuse_s=pick([0.0, 1.0]), resource_interval_s=pick([0.1, 5.0])),
        "http": dict(header_timeout_s=pick([5.0, 10.0]), idle_timeout_s=pick([2.0, 5.0]),
                     send_timeout_s=pick([10.0, 30.0]), max_header_count=pick([64, 99]),
                     send_buffer_bytes=pick([65536, 262144])),
        "prompt_guard": dict(max_queued=pick([16, 64]), max_queue_wait_s=pick([10.0, 30.0]),
                             kv_budget_margin=pick([0.1, 0.25]), max_body_bytes=pick([1 << 20, 32 << 20])),
        # Planted faults every 60-80 steps: as soak.py's, a budget no planted fault exhausts.
        "recovery": dict(max_failures=pick([100000, 200000]), window_s=pick([60.0, 120.0]),
                         backoff_base_s=pick([0.1, 0.25]), max_reruns=1000, max_continuations=1000,
                         reload_after_failures=0),
        "resources": dict(trim_above=pick([0.85, 0.9]), retry_after_s=pick([2.0, 3.0])),
        "access": dict(fair_admission=pick(["true", "false"]), client_max_concurrent=pick([0, 16])),
        "fault_injection": dict(enabled="true", every_n_steps=pick([60, 80])),
    }
    if supervise:
        tables["supervisor"] = dict(interval_s=pick([0.5, 1.0]), unhealthy_after_s=pick([10.0, 30.0]),
                                    max_restarts=1000, quarantine_s=0, hold_s=pick([30.0, 60.0]))
    lines = []
    for name, settings in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {value}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def save(path: Path, text: str, in_place: bool, pause_s: float) -> None:
    """A save by rename, or in place with ``pause_s`` between the truncate and the write (an
    editor's or a tool's own pace: its fsync, a write in parts)."""
    if in_place:
        with open(path, "w") as file:  # truncated first: the moment a read must not catch
            time.sleep(pause_s)
            file.write(text)
    else:
        staged = path.with_name(path.name + ".saving")
        staged.write_text(text)
        os.replace(staged, path)


def log_counts(log_path: Path) -> dict:
    reads, empty_reads, problems = 0, 0, collections.Counter()
    for line in log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event")
        if name in ("config_reloaded", "supervisor_config_reloaded"):
            reads += 1
            empty_reads += event.get("sha256") == EMPTY_FILE_SHA256
        if event.get("level") in ("error", "critical") and name not in PLANTED:
            problems[name] += 1
        if name == "config_reload_failed":
            problems[name] += 1
    return {"reads": reads, "empty_file_reads": empty_reads, "errors_logged": dict(problems)}


def run(mode: str, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix=f"config-churn-{mode}-"))
    config = workdir / "guardian.toml"
    config.write_text(random_config(rng, mode == "supervise"))
    port = free_port()
    command = [sys.executable, "-m", "guardian", *(["--supervise"] if mode == "supervise" else []),
               "--guardian-config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    server = Server(mode, command, port, workdir / "server.log", {**os.environ, "HF_HUB_OFFLINE": "1"})
    print(f"log: {server.log_path}", file=sys.stderr)

    def ready() -> bool:
        try:
            return httpx.get(server.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        if not poll_until(lambda: not server.alive() or ready(), 120, interval=0.3) or not server.alive():
            raise SystemExit("the server did not start:\n" + server.log_path.read_text()[-3000:])
        clients = soak.Clients(server.url + "/v1/chat/completions", 8)
        clients.start()
        saves = in_place = 0
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            this_in_place = rng.random() < 0.5
            save(config, random_config(rng, mode == "supervise"), this_in_place, rng.uniform(0.0, 0.02))
            saves, in_place = saves + 1, in_place + this_in_place
            time.sleep(rng.uniform(0.1, 0.6))  # the churn's own pace, not a wait on the server
        clients.finish()
        alive = server.alive()
    finally:
        server.stop()
    failures = collections.Counter(r["failure"] for r in clients.records if r["failure"])
    return {"mode": mode, **soak.environment(), "seconds": seconds, "seed": seed, "saves": saves,
            "saves_in_place": in_place, "requests": len(clients.records), "client_failures": sum(failures.values()),
            "failure_reasons": dict(failures), "server_alive_at_end": alive, **log_counts(server.log_path),
            "log": str(server.log_path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("inprocess", "supervise"))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    result = run(args.mode, args.seconds, args.seed)
    print(json.dumps(result, indent=1))
    print("| mode | saves (in place) | reads | empty-file reads | requests | client-visible failures | errors logged |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {result['mode']} | {result['saves']} ({result['saves_in_place']}) | {result['reads']} | "
          f"{result['empty_file_reads']} | {result['requests']} | {result['client_failures']} | "
          f"{result['errors_logged'] or 0} |")


if __name__ == "__main__":
    main()

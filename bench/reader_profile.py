"""Where a request's CPU goes in the readers: the in-process server's, the supervisor's, the child's.

``relay_cost.py`` measures what ``--supervise`` costs in all; this splits the
per-request part by step. The in-process guardian and ``--supervise`` serve
the demo model (or ``--sized``) in turn, pinned as in relay_cost, under
``--seconds`` of steady streaming load each. Every server process loads
``reader_profile_hooks/sitecustomize.py``, which adds up the thread CPU of
each step of its connection layer's reader (accept, read, select rounds,
the supervisor's hand-off and the child's word, the child's taking of a
hand-off, the dispatch to a handler thread). The figures are per request
(the reader's dispatches in the window) and include the steps' system calls
and the cold caches the engine leaves between them; the timing itself adds
a little to each.

    .venv/bin/python bench/reader_profile.py              # ~1 min

It is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from relay_cost import CpuWindow, child_pid, demo_model, model_size, sized_model, start_servers, steady
from servers import cpu_split
from stats import environment

HOOKS = Path(__file__).with_name("reader_profile_hooks")
ROLES = ("in-process", "supervisor", "child")
# The reader loop's own steps, which add up to its time; the others run inside one of them
# (dispatch inside read or take_handoffs, hand_off.* inside dispatch).
LOOP_STEPS = ("accept", "read", "take_handoffs", "child_word", "wake", "watched", "select", "loop")


def sums(folder: Path, pid: int) -> dict:
    try:
        return json.loads((folder / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return {}


def per_request(before: dict, after: dict) -> dict:
    """Each step's µs per request and calls per request, from two snapshots of one process."""
    requests = after.get("dispatch", [0, 0])[1] - before.get("dispatch", [0, 0])[1]
    if requests <= 0:
        return {}
    out = {}
    for step, (ns, calls) in after.items():
        ns_before, calls_before = before.get(step, [0, 0])
        out[step] = {"us": (ns - ns_before) / 1000 / requests, "calls": (calls - calls_before) / requests}
    out["requests"] = requests
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sized", metavar="HIDDEN,LAYERS", type=model_size)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model = sized_model(*args.sized) if args.sized else demo_model()
    split = cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-reader-profile-") as workdir:
        folder = Path(workdir)
        os.environ["READER_PROFILE_DIR"] = str(folder)  # the servers' environment is built from ours
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))
        try:
            servers = start_servers(model, folder, split[0] if split else None, ("in-process", "supervise"))
        finally:
            del os.environ["READER_PROFILE_DIR"]
        try:
            for kind, server in servers.items():
                pids = ({"supervisor": server.proc.pid, "child": child_pid(server)} if kind == "supervise"
                        else {"in-process": server.proc.pid})
                snapshots = {}

                class Snapshots(CpuWindow):  # taken as steady's measured window opens and closes
                    def __init__(self, server):
                        super().__init__(server)
                        snapshots["before"] = {role: sums(folder, pid) for role, pid in pids.items()}

                    def read(self):
                        time.sleep(1.5)  # the hooks write their sums once a second
                        snapshots["after"] = {role: sums(folder, pid) for role, pid in pids.items()}
                        return super().read()

                steady.__globals__["CpuWindow"] = Snapshots
                steady(server, 0, args.clients, args.max_tokens, True, args.seconds)
                for role in pids:
                    if not snapshots["after"][role]:  # sitecustomize reports its own errors on stderr
                        raise SystemExit(f"the profile hooks did not load in the {role}: see {folder}/*.log")
                    results[role] = per_request(snapshots["before"][role], snapshots["after"][role])
        finally:
            steady.__globals__["CpuWindow"] = CpuWindow
            for server in servers.values():
                server.stop()
    data = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "environment": environment(),
            "model": model.name, "seconds": args.seconds, "clients": args.clients, "max_tokens": args.max_tokens,
            "per_request": results}
    print(json.dumps(data, indent=2) if args.json else report(data))


def report(data: dict) -> str:
    found = {step for role in ROLES for step in data["per_request"].get(role, {}) if step != "requests"}
    steps = [step for step in LOOP_STEPS if step in found] + sorted(found - set(LOOP_STEPS))
    lines = [f"Reader profile, {data['when']}: {data['environment']}; {data['model']}; {data['clients']} "
             f"streaming clients, max_tokens={data['max_tokens']}, {data['seconds']:g} s each.", "",
             "| step (thread CPU per request, calls per request) | " + " | ".join(ROLES) + " |",
             "|---|" + "---|" * len(ROLES)]
    for step in steps:
        cells = []
        for role in ROLES:
            got = data["per_request"].get(role, {}).get(step)
            cells.append(f"{got['us']:.0f} µs ({got['calls']:.2f})" if got and got["calls"] else "")
        lines.append(f"| {step if step in LOOP_STEPS else '… ' + step} | " + " | ".join(cells) + " |")
    totals = [sum(data["per_request"].get(role, {}).get(step, {"us": 0})["us"] for step in LOOP_STEPS)
              for role in ROLES]
    lines.append("| **the reader, in all** | " + " | ".join(f"**{total:.0f} µs**" for total in totals) + " |")
    lines += ["", "Requests in the window: " + ", ".join(
        f"{role} {data['per_request'].get(role, {}).get('requests', 0)}" for role in ROLES) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

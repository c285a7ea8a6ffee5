"""Where a request's CPU goes in the readers: the in-process server's, the supervisor's, the child's.

``relay_cost.py`` measures what ``--supervise`` costs in all; this splits the
per-request part by step. The in-process guardian and ``--supervise`` serve
the demo model (or ``--sized``) in turn, pinned as in relay_cost, under
``--seconds`` of steady streaming load each. Every server process loads
``reader_profile_hooks/sitecustomize.py``, which adds up the thread CPU of
each step of its connection layer's reader (accept, read, select rounds,
the supervisor's hand-off and the child's word, the child's taking of a
hand-off, the dispatch to a handler thread) and of each request's handler
thread, start to end. The figures are per request
(the reader's dispatches in the window) and include the steps' system calls
and the cold caches the engine leaves between them; the timing itself adds
a little to each. A second table puts them beside each process's whole CPU
per streamed token (from /proc), so what is left (the engine's threads,
idle work) shows as the difference. A third splits that by thread, from each
thread's /proc counters at the window's ends (threads alive at both): the
generation loop, mlx's own threads (those Python did not start: its CPU
stream's worker) and the rest, with each one's context switches per token.

    .venv/bin/python bench/reader_profile.py              # ~1 min
    .venv/bin/python bench/reader_profile.py --rounds 8   # ~4 min: the per-token table steadier

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
from typing import Optional

from relay_cost import CpuWindow, child_pid, demo_model, model_size, sized_model, start_servers, steady
from servers import cpu_split
from stats import environment

HOOKS = Path(__file__).with_name("reader_profile_hooks")
ROLES = ("in-process", "supervisor", "child")
# The reader loop's own steps, which add up to its time; the others run inside one of them
# (dispatch inside read or take_handoffs, hand_off.* inside dispatch), or on a thread of
# their own (the handler).
LOOP_STEPS = ("accept", "read", "take_handoffs", "child_word", "wake", "watched", "select", "loop")
HANDLER = "handler"
MLX_THREADS = "mlx's own threads"


def sums(folder: Path, pid: int | str) -> dict:
    try:
        return json.loads((folder / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return {}


def added(total: dict, before: dict, after: dict) -> None:
    """Add to ``total`` each step's thread CPU (ns) and calls between two snapshots of one process."""
    for step, (ns, calls) in after.items():
        ns_before, calls_before = before.get(step, [0, 0])
        sums_so_far = total.setdefault(step, [0, 0])
        sums_so_far[0] += ns - ns_before
        sums_so_far[1] += calls - calls_before


def task_counters(pid: int) -> dict[int, tuple[int, int, int]]:
    """Each of a process's threads: its CPU so far (ns, schedstat) and its context switches
    (voluntary, involuntary). Empty where /proc has none."""
    counters = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return counters
    for tid in tids:
        try:
            cpu_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        counters[int(tid)] = (cpu_ns, int(fields["voluntary_ctxt_switches"]),
                              int(fields["nonvoluntary_ctxt_switches"]))
    return counters


def thread_kind(name: Optional[str]) -> str:
    """A thread's row: by the name Python gave it; one Python did not start is mlx's."""
    if name is None:
        return MLX_THREADS
    if name == "generation-loop":  # the hooks name the thread the engine's loop runs on
        return "the generation loop"
    if name.startswith("http"):
        return "HTTP threads (alive at both ends)"
    return "other Python threads"


def add_threads(total: dict, before: dict, after: dict, names: dict) -> None:
    """Add to ``total`` each kind of thread's [CPU ns, voluntary, involuntary switches] between
    two ``task_counters`` of one process, for the threads alive at both."""
    for tid, counters in after.items():
        if tid in before:
            sums = total.setdefault(thread_kind(names.get(str(tid))), [0, 0, 0])
            for i, (now, then) in enumerate(zip(counters, before[tid])):
                sums[i] += now - then


def per_request(total: dict) -> dict:
    """Each step's µs per request and calls per request, from a process's added snapshots."""
    requests = total.get("dispatch", [0, 0])[1]
    if requests <= 0:
        return {}
    out = {step: {"us": ns / 1000 / requests, "calls": calls / requests} for step, (ns, calls) in total.items()}
    out["requests"] = requests
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1, help="windows per server, taken in alternating order")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sized", metavar="HIDDEN,LAYERS", type=model_size)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    model = sized_model(*args.sized) if args.sized else demo_model()
    split = cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])
    steps = {role: {} for role in ROLES}  # step: [ns, calls], added over rounds
    whole_cpu_s = {role: 0.0 for role in ROLES}
    streamed = {role: [0, 0] for role in ROLES}  # tokens, requests
    threads = {role: {} for role in ROLES}  # kind: [CPU ns, voluntary, involuntary switches], added over rounds
    with tempfile.TemporaryDirectory(prefix="bench-reader-profile-") as workdir:
        folder = Path(workdir)
        os.environ["READER_PROFILE_DIR"] = str(folder)  # the servers' environment is built from ours
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))
        try:
            servers = start_servers(model, folder, split[0] if split else None, ("in-process", "supervise"))
        finally:
            del os.environ["READER_PROFILE_DIR"]
        try:
            for round_index in range(args.rounds):
                order = list(servers.items()) if round_index % 2 == 0 else list(servers.items())[::-1]
                for kind, server in order:
                    pids = ({"supervisor": server.proc.pid, "child": child_pid(server)} if kind == "supervise"
                            else {"in-process": server.proc.pid})
                    snapshots = {}

                    class Snapshots(CpuWindow):  # taken as steady's measured window opens and closes
                        def __init__(self, server):
                            super().__init__(server)
                            snapshots["before"] = {role: sums(folder, pid) for role, pid in pids.items()}
                            snapshots["tasks_before"] = {role: task_counters(pid) for role, pid in pids.items()}

                        def read(self):
                            # The window's CPU as it closes: the clients go on meanwhile.
                            snapshots["tasks_after"] = {role: task_counters(pid) for role, pid in pids.items()}
                            window = super().read()
                            time.sleep(1.5)  # the hooks write their sums once a second
                            snapshots["after"] = {role: sums(folder, pid) for role, pid in pids.items()}
                            snapshots["names"] = {role: sums(folder, f"{pid}.threads") for role, pid in pids.items()}
                            return window

                    steady.__globals__["CpuWindow"] = Snapshots
                    window = steady(server, 100_000 * round_index, args.clients, args.max_tokens, True, args.seconds)
                    # Each process's whole CPU (the engine's is the child's, or its own).
                    whole = ({"supervisor": window["process_cpu_s"], "child": window["engine_cpu_s"]}
                             if kind == "supervise" else {"in-process": window["process_cpu_s"]})
                    for role in pids:
                        if not snapshots["after"][role]:  # sitecustomize reports its own errors on stderr
                            raise SystemExit(f"the profile hooks did not load in the {role}: see {folder}/*.log")
                        added(steps[role], snapshots["before"][role], snapshots["after"][role])
                        add_threads(threads[role], snapshots["tasks_before"][role], snapshots["tasks_after"][role],
                                    snapshots["names"][role])
                        whole_cpu_s[role] += whole[role]
                        streamed[role][0] += window["tokens"]
                        streamed[role][1] += window["requests"]
        finally:
            steady.__globals__["CpuWindow"] = CpuWindow
            for server in servers.values():
                server.stop()
    results = {}
    for role in ROLES:
        results[role] = per_request(steps[role])
        tokens, requests = streamed[role]
        results[role]["process_us_per_token"] = 1e6 * whole_cpu_s[role] / max(tokens, 1)
        results[role]["tokens_per_request"] = tokens / max(requests, 1)
        results[role]["threads_per_token"] = {
            kind: {"us": cpu_ns / 1000 / max(tokens, 1), "voluntary": voluntary / max(tokens, 1),
                   "involuntary": involuntary / max(tokens, 1)}
            for kind, (cpu_ns, voluntary, involuntary) in threads[role].items()}
    data = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "environment": environment(),
            "model": model.name, "seconds": args.seconds, "rounds": args.rounds, "clients": args.clients,
            "max_tokens": args.max_tokens, "per_request": results}
    print(json.dumps(data, indent=2) if args.json else report(data))


def report(data: dict) -> str:
    found = {step for role in ROLES for step, value in data["per_request"].get(role, {}).items()
             if isinstance(value, dict) and "calls" in value}
    steps = [step for step in LOOP_STEPS if step in found] + sorted(found - set(LOOP_STEPS) - {HANDLER})
    lines = [f"Reader profile, {data['when']}: {data['environment']}; {data['model']}; {data['clients']} "
             f"streaming clients, max_tokens={data['max_tokens']}, {data.get('rounds', 1)} windows of "
             f"{data['seconds']:g} s each, alternating.", "",
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
    handlers = [data["per_request"].get(role, {}).get(HANDLER, {"us": 0})["us"] for role in ROLES]
    lines.append("| **the handler thread** (its own) | " + " | ".join(
        f"**{us:.0f} µs**" if us else "" for us in handlers) + " |")
    lines += ["", "Requests in the window: " + ", ".join(
        f"{role} {data['per_request'].get(role, {}).get('requests', 0)}" for role in ROLES) + ".", ""]
    # Per streamed token: each process's whole CPU, and the reader's and handler's part of it.
    lines += ["| µs of CPU per streamed token | " + " | ".join(ROLES) + " |", "|---|" + "---|" * len(ROLES)]
    rows = {"the whole process (/proc)": [], "… the reader": [], "… the handler threads": [], "… the rest": []}
    for role, reader, handler in zip(ROLES, totals, handlers):
        got = data["per_request"].get(role, {})
        if "process_us_per_token" not in got:
            for cells in rows.values():
                cells.append("")
            continue
        per_token = got["tokens_per_request"]
        whole, reader_t, handler_t = got["process_us_per_token"], reader / per_token, handler / per_token
        for name, value in zip(rows, (whole, reader_t, handler_t, whole - reader_t - handler_t)):
            rows[name].append(f"{value:.1f}")
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    return "\n".join(lines + thread_report(data))


def thread_report(data: dict) -> list[str]:
    """Per streamed token, by thread: CPU, and context switches (voluntary + involuntary)."""
    by_role = {role: data["per_request"].get(role, {}).get("threads_per_token", {}) for role in ROLES}
    kinds = sorted({kind for got in by_role.values() for kind in got}, key=lambda kind: (
        kind != "the generation loop", kind != MLX_THREADS, kind))
    if not kinds:
        return []
    lines = ["", "| per streamed token, by thread: µs of CPU (context switches: voluntary + involuntary) | "
             + " | ".join(ROLES) + " |", "|---|" + "---|" * len(ROLES)]
    for kind in kinds:
        cells = [f"{got['us']:.1f} ({got['voluntary']:.2f} + {got['involuntary']:.2f})" if got else ""
                 for got in (by_role[role].get(kind) for role in ROLES)]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()

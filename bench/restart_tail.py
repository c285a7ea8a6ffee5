"""The restart's tail: from an engine failure to the new loop polling, phase by phase.

Starts the in-process guardian (the demo model unless ``--model``) with the
fault-injection plugin raising the incident's error every N engine steps
(or with a probability per step), keeps 8 clients looping (half streaming,
mixed lengths, each prompt unique so nothing is quarantined) until the
engine has restarted ``--failures`` times, then reads every
``engine_restarted`` event of the server's log: ``duration_ms`` (the
lifecycle's: failure to first poll) and ``phases_ms`` (the restart path's
own split, guardian/engine/restart.py), and prints median, p90, p99 and max
per phase as a markdown table.

Phases, in order: ``classify`` (the classify_engine_error hook, the
lifecycle's ``failed``), ``judge`` (the dead loop's requests taken and
judged), ``log`` (``engine_error`` with its traceback), ``decide``
(on_engine_error), ``settle`` (re-queue or answer each request),
``unwind`` (leaving the except block; since the fix, clearing the dead
loop's frames, which frees its arrays), ``gc``, ``clear_cache``,
``backoff`` (a crash loop's wait; off here), ``loop_start`` (stock's loop
from its call to its first poll).

Usage::

    python bench/restart_tail.py                          # 300 failures, ~1-2 min
    python bench/restart_tail.py --failures 500 --save bench/results/restart_tail-after.json
    python bench/restart_tail.py --compare bench/results/restart_tail-before.json \\
        bench/results/restart_tail-after.json            # before/after, no server

The machine's load shows in the tail: run it on a quiet machine, or say how busy it was.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from servers import Server, free_port, poll_until
from stats import percentile

PHASES = ("classify", "judge", "log", "decide", "settle", "unwind", "gc", "clear_cache",
          "backoff", "loop_start")

CONFIG = """\
[fault_injection]
enabled = true
{trigger}
seed = 1

[recovery]
# Never give up, never reload, never quarantine, never back off: every failure
# is a plain restart (the before run, on the code without backoff, had no wait).
max_failures = 1000000
reload_after_failures = 0
quarantine_s = 0.0
backoff_base_s = 0.0
{recovery_extra}
[watchdog]
# Probes would share the engine with the clients; the clients keep it busy.
probe_interval_s = 3600.0
"""




def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "median": statistics.median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def client_loop(url: str, index: int, stop: threading.Event, counts: dict, lock: threading.Lock) -> None:
    """One client: requests back to back until ``stop``; every other one streams."""
    lengths = itertools.cycle((16, 48, 96, 32, 128))
    with httpx.Client(timeout=60) as client:
        for n in itertools.count():
            if stop.is_set():
                return
            stream = (index + n) % 2 == 0
            body = {
                "messages": [{"role": "user", "content": f"Client {index} request {n}: tell me a story."}],
                "max_tokens": next(lengths),
                "stream": stream,
            }
            outcome = "error"
            try:
                if stream:
                    with client.stream("POST", url, json=body) as response:
                        text = "".join(response.iter_text())
                        outcome = f"{response.status_code}" + (" cut" if '"error"' in text else "")
                else:
                    response = client.post(url, json=body)
                    outcome = str(response.status_code)
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            with lock:
                counts[outcome] = counts.get(outcome, 0) + 1


def run(args) -> dict:
    from guardian.demo_model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    trigger = (f"probability = {args.probability}" if args.probability
               else f"every_n_steps = {args.every_n_steps}")
    recovery_extra = "".join(f"{line}\n" for line in args.recovery)
    workdir = Path(tempfile.mkdtemp(prefix="restart-tail-"))
    config = workdir / "guardian.toml"
    config.write_text(CONFIG.format(trigger=trigger, recovery_extra=recovery_extra))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = Server("guardian", [sys.executable, "-m", "guardian", "--guardian-config", str(config),
                                 "--model", model, "--host", "127.0.0.1", "--port", str(port)],
                    port, workdir / "guardian.log", env)
    try:
        if not server.wait_ready():
            raise SystemExit("the guardian did not start:\n" + "\n".join(server.log_tail()))
        stop, lock, counts = threading.Event(), threading.Lock(), {}
        url = server.url + "/v1/chat/completions"
        clients = [threading.Thread(target=client_loop, args=(url, i, stop, counts, lock), daemon=True)
                   for i in range(args.clients)]
        started = time.monotonic()
        for thread in clients:
            thread.start()
        done = poll_until(lambda: not server.alive() or len(server.log_events("engine_restarted")) >= args.failures,
                          args.timeout, interval=0.5)
        stop.set()
        for thread in clients:
            thread.join(timeout=70)
        elapsed = time.monotonic() - started
        if not server.alive():
            raise SystemExit("the guardian exited:\n" + "\n".join(server.log_tail()))
        if not done:
            print(f"warning: only {len(server.log_events('engine_restarted'))} restarts within {args.timeout} s",
                  file=sys.stderr)
        restarted = server.log_events("engine_restarted")
    finally:
        server.stop()
    import mlx.core as mx
    import mlx_lm

    return {
        "label": args.label,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mlx_lm": mlx_lm.__version__,
        "mlx": mx.__version__,
        "python": sys.version.split()[0],
        "clients": args.clients,
        "trigger": trigger,
        "elapsed_s": round(elapsed, 1),
        "load_average": os.getloadavg(),
        "responses": counts,
        "restarts": [{"duration_ms": e["duration_ms"], "phases_ms": e.get("phases_ms") or {}} for e in restarted],
    }


def phase_rows(result: dict) -> dict[str, dict]:
    """Each phase's summary (phases the run did not log are left out), then the total."""
    restarts = result["restarts"]
    rows = {}
    for phase in PHASES:
        values = [r["phases_ms"][phase] for r in restarts if phase in r["phases_ms"]]
        if values:
            rows[phase] = summary(values)
    rows["total (duration_ms)"] = summary([r["duration_ms"] for r in restarts])
    return rows


def describe(result: dict) -> str:
    return (f"{result['label'] or 'run'}: {len(result['restarts'])} restarts, {result['clients']} clients, "
            f"{result['trigger']}, {result['elapsed_s']} s, mlx-lm {result['mlx_lm']}, mlx {result['mlx']}, "
            f"Python {result['python']}, {result['when']}, load average "
            f"{' '.join(f'{x:.2f}' for x in result['load_average'])}; responses {result['responses']}")


def table(result: dict) -> str:
    lines = ["| phase (ms) | median | p90 | p99 | max |", "|---|---|---|---|---|"]
    for phase, s in phase_rows(result).items():
        lines.append(f"| {phase} | {s['median']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | {s['max']:.2f} |")
    return "\n".join(lines)


def comparison(before: dict, after: dict) -> str:
    rows_before, rows_after = phase_rows(before), phase_rows(after)
    lines = ["| phase (ms) | median before → after | p90 | p99 | max |", "|---|---|---|---|---|"]
    for phase in [*PHASES, "total (duration_ms)"]:
        b, a = rows_before.get(phase), rows_after.get(phase)
        if b is None and a is None:
            continue
        cell = lambda key: f"{b[key]:.1f} → {a[key]:.1f}" if b and a else (
            f"{b[key]:.1f} → —" if b else f"— → {a[key]:.1f}")
        lines.append(f"| {phase} | {cell('median')} | {cell('p90')} | {cell('p99')} | {cell('max')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures", type=int, default=300, help="stop after this many restarts")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--every-n-steps", type=int, default=40)
    parser.add_argument("--probability", type=float, default=0.0, help="instead of --every-n-steps")
    parser.add_argument("--model", help="default: the demo model")
    parser.add_argument("--recovery", action="append", default=[],
                        help="an extra [recovery] line, e.g. 'backoff_after_failures = 8'")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--label", default="")
    parser.add_argument("--save", type=Path, help="write the raw result as JSON")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="print two saved results side by side; runs no server")
    args = parser.parse_args()

    if args.compare:
        before, after = (json.loads(path.read_text()) for path in args.compare)
        print(f"before: {describe(before)}\n\nafter: {describe(after)}\n")
        print(comparison(before, after))
        return
    result = run(args)
    if args.save:
        args.save.write_text(json.dumps(result, indent=1) + "\n")
    print(describe(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

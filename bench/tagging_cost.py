"""What a supervised child's token tags cost on their own, without a supervisor.

Under ``--supervise`` the child tags every streamed event with its tokens
(guardian.relay_protocol) and journals it (guardian.handoff); the supervisor
accepts, reads and hands off each request. ``relay_cost.py`` measures all of
it together. This splits off the first part: two in-process guardians serve
the demo model, one plain and one started with a relay key in its
environment, whose clients send that key, so it tags their streams exactly
as a child does, and writes the tags to the client (no journal, no
supervisor). Both are pinned to one CPU (the clients get the others), and
rounds of ``--seconds`` of continuous streaming load alternate between them.

    .venv/bin/python bench/tagging_cost.py --rounds 40     # ~14 min

The figures are tagged ÷ plain tokens/s and plain ÷ tagged CPU per token,
mean ± 95 % over rounds. It is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from relay_cost import SENTENCE, START_TIMEOUT_S, ci95, cpu_seconds
from servers import Server, cpu_split, free_port
from stats import environment

from guardian.relay_protocol import KEY_HEADER, RELAY_KEY_ENV, new_relay_key

WARMUP_S = 2.0


def steady(server: Server, headers: dict, seconds: float, clients: int, max_tokens: int) -> tuple[float, float]:
    """(tokens/s, CPU µs per token) over ``seconds`` of ``clients`` looping streams."""
    counted = [0]
    lock = threading.Lock()
    stop = threading.Event()
    numbers = itertools.count()

    def client_loop() -> None:
        with httpx.Client(timeout=300, headers=headers) as client:
            while not stop.is_set():
                body = {"messages": [{"role": "user", "content": f"Request {server.kind} {next(numbers)}. "
                                      + SENTENCE * 4}], "max_tokens": max_tokens, "stream": True}
                with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {") and '"content": "' in line:
                            with lock:
                                counted[0] += 1

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(WARMUP_S)  # every client under way (a benchmark's pace, not a wait for a condition)
    with lock:
        before = counted[0]
    cpu_before, started = cpu_seconds(server.proc.pid), time.monotonic()
    time.sleep(seconds)  # the measured window
    with lock:
        tokens = counted[0] - before
    wall, cpu = time.monotonic() - started, cpu_seconds(server.proc.pid) - cpu_before
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    return tokens / wall, 1e6 * cpu / max(tokens, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from guardian.demo_model import ensure_demo_model

    model = ensure_demo_model()
    split = cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])
    key = new_relay_key()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "guardian", "--model", str(model), "--host", "127.0.0.1"]
    headers = {"plain": {}, "tagged": {KEY_HEADER: key}}
    ratios, cpu_ratios = [], []
    with tempfile.TemporaryDirectory(prefix="bench-tagging-cost-") as workdir:
        servers = {}
        try:
            for kind, kind_env in (("plain", env), ("tagged", {**env, RELAY_KEY_ENV: key})):
                port = free_port()
                servers[kind] = Server(kind, [*command, "--port", str(port)], port,
                                       Path(workdir) / f"{kind}.log", kind_env, cpus=split[0] if split else None)
                if not servers[kind].wait_ready(START_TIMEOUT_S):
                    raise SystemExit(f"{kind} did not start:\n" + "\n".join(servers[kind].log_tail(20)))
            for kind, server in servers.items():  # weights loaded, caches warm
                steady(server, headers[kind], 3.0, args.clients, args.max_tokens)
            for round_index in range(args.rounds):
                order = ("plain", "tagged") if round_index % 2 == 0 else ("tagged", "plain")
                got = {kind: steady(servers[kind], headers[kind], args.seconds, args.clients, args.max_tokens)
                       for kind in order}
                ratios.append(got["tagged"][0] / got["plain"][0])
                cpu_ratios.append(got["plain"][1] / got["tagged"][1])
                print(f"round {round_index + 1}/{args.rounds}: plain {got['plain'][0]:.0f} tok/s, "
                      f"tagged {got['tagged'][0]:.0f} tok/s", file=sys.stderr, flush=True)
        finally:
            for server in servers.values():
                server.stop()
    pinned = f"servers pinned to CPU {sorted(split[0])}" if split else "unpinned"
    print(f"Tagging cost, {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}: {environment()}; demo model; "
          f"{args.clients} looping streaming clients, max_tokens={args.max_tokens}, {args.rounds} rounds of "
          f"{args.seconds:g} s alternating; {pinned}.\n")
    print("| tagged ÷ plain | mean ± 95 % | median | rounds min–max |\n|---|---|---|---|")
    for name, values in (("tokens/s", ratios), ("CPU per token (plain ÷ tagged)", cpu_ratios)):
        print(f"| {name} | **{statistics.fmean(values):.3f} ± {ci95(values):.3f}** | "
              f"{statistics.median(values):.3f} | {min(values):.3f}–{max(values):.3f} |")


if __name__ == "__main__":
    main()

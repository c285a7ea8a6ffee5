"""Innocents blamed: random engine failures, and how many requests took the blame.

A fresh in-process ``mlx-guardian`` on the offline demo model, with the
fault-injection plugin failing each engine step with ``--probability`` (the
seeded draws of ``[fault_injection] probability``, an ``unknown`` failure:
nobody's fault), while ``--clients`` clients loop with httpx (every request a
unique prompt, ``--max-tokens`` each, half of them streamed), for ``--seconds``.

Recovery at its defaults (``max_reruns`` 1, ``max_continuations`` 2), except
``max_failures``, raised so that the process stays up: the failures here are
planted far more often than any real server sees. Every request blamed
(``request_failed_repeatedly``) is an innocent one, since no request causes a
failure; the count is what this measures (goal 0). Also printed: the planted
failures, the probes run to prove the engine before a blame
(``proof_probe_queued``), and what the clients got.

    .venv/bin/python bench/random_faults_blame.py [--probability 0.05] [--seconds 45]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from servers import Server, free_port

CONFIG = """\
[fault_injection]
enabled = true
probability = {probability}
seed = {seed}
message = "planted random fault"
[recovery]
max_failures = 1000000
reload_after_failures = 0
[watchdog]
probe_interval_s = 3600.0
"""


def client_loop(url: str, stop: threading.Event, max_tokens: int, outcomes: collections.Counter,
                lock: threading.Lock, ids) -> None:
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            n = next(ids)
            body = {"messages": [{"role": "user", "content": f"Request {n}: tell me about rivers."}],
                    "max_tokens": max_tokens, "stream": n % 2 == 0}
            try:
                if body["stream"]:
                    outcome = "200"
                    with client.stream("POST", url, json=body) as response:
                        outcome = str(response.status_code)
                        for line in response.iter_lines():
                            if line.startswith("data: {") and '"error"' in line:
                                outcome = "stream error: " + json.loads(line[6:])["error"].get("code", "?")
                else:
                    response = client.post(url, json=body)
                    outcome = str(response.status_code)
                    if response.status_code != 200:
                        outcome += " " + response.json()["error"].get("code", "?")
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            with lock:
                outcomes[outcome] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probability", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="random-faults-"))
    config = folder / "guardian.toml"
    config.write_text(CONFIG.format(probability=args.probability, seed=args.seed))
    port = free_port()
    command = [sys.executable, "-m", "guardian", "--port", str(port), "--guardian-config", str(config)]
    server = Server("guardian", command, port, folder / "guardian.log", dict(os.environ))
    try:
        if not server.wait_ready():
            print("the server did not start:", *server.log_tail(), sep="\n")
            return 1
        outcomes: collections.Counter = collections.Counter()
        lock, stop, ids = threading.Lock(), threading.Event(), itertools.count()
        url = server.url + "/v1/chat/completions"
        threads = [threading.Thread(target=client_loop, args=(url, stop, args.max_tokens, outcomes, lock, ids))
                   for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        time.sleep(args.seconds)  # the run's length: the clients loop meanwhile
        stop.set()
        for thread in threads:
            thread.join(timeout=150)
        alive = server.alive()
    finally:
        server.stop()
    errors = server.log_events("engine_error")
    blamed = server.log_events("request_blamed")
    print(f"probability {args.probability}, {args.clients} clients, {args.max_tokens} tokens, "
          f"{args.seconds:g} s; the server {'stayed up' if alive else 'EXITED'}")
    print("| requests | engine failures | innocents blamed | proofs queued | failures awaiting a proof |")
    print("|---|---|---|---|---|")
    print(f"| {sum(outcomes.values())} | {len(errors)} | **{len(blamed)}** | "
          f"{len(server.log_events('proof_probe_queued'))} | "
          f"{sum(bool(e.get('awaiting_proof')) for e in errors)} |")
    print("what the clients got:", dict(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())

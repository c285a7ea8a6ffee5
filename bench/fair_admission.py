"""Fair admission: another client's time to first token while one client floods the server.

Three servers, one after the other, serve the offline demo model with the same
flags (``--decode-concurrency`` and ``--prompt-concurrency`` both ``--places``,
so stock's batch has that many places): stock ``python -m mlx_lm server``,
``mlx-guardian`` with ``[access] fair_admission = false``, and ``mlx-guardian``
with it on (the default). The guardians have two API keys, ``a`` and ``b``;
stock has no keys, so there the two clients are just two sets of client threads.

Client B sends one streaming chat request at a time (a short pause between
them) and measures its time to first token: the first ``data:`` event, from
the moment the request is sent. Three phases take turns (``--rounds``) on
the same server:

- unloaded: B alone;
- busy: client A keeps one place short of a full batch busy, so B finds the
  batch running but a place free: what sharing a busy batch costs B, whatever
  the admission;
- loaded: A keeps ``--flood`` times its fair share of requests outstanding (its
  share: half the places; at the defaults 10 x 2 = 20), so its queue is always
  deep.

A's requests are non-streaming, sent back to back by looping client threads
in a process of their own (B's client never waits for their interpreter
lock). Every prompt is new (no prompt-cache hits). The report gives B's p50
and p99 in each phase for each server, the ratios loaded / unloaded (the
issue's target: fair admission's loaded p99 within 1.2 x its unloaded p99)
and loaded / busy (what the flood's queue adds), and A's and B's tokens/s
while loaded: what B's turns and the place kept free for B cost the flood.

By default (Linux, 2+ CPUs) the server is pinned to one CPU and the clients to
the others, so the clients' own work is not taken from the server.

    .venv/bin/python bench/fair_admission.py            # ~5 min; writes bench/results/fair_admission.{json,md}
    .venv/bin/python bench/fair_admission.py --samples 50 --no-write

It is a benchmark, not a test: it never runs with the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from servers import Server, cpu_split, free_port
from stats import environment, percentile

KINDS = ("stock", "guardian, fair_admission = false", "guardian, fair_admission = true")
KEYS = {"a": "sk-bench-a-0123456789", "b": "sk-bench-b-0123456789"}
START_TIMEOUT_S = 120.0
RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ("unloaded", "busy", "loaded")
# How long A runs before B's block in a busy or loaded phase starts: its queue fills.
FILL_S = 1.0
SENTENCE = "The guardian watches a language model server and keeps it alive. "


def start(kind: str, model: Path, places: int, workdir: Path, cpus: set[int] | None) -> Server:
    flags = ["--model", str(model), "--host", "127.0.0.1",
             "--decode-concurrency", str(places), "--prompt-concurrency", str(places)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    port = free_port()
    if kind == "stock":
        command = [sys.executable, "-m", "mlx_lm", "server", *flags]
    else:
        fair = kind.endswith("true")
        config = workdir / f"guardian-{fair}.toml"
        config.write_text(f"[access]\nfair_admission = {str(fair).lower()}\n")
        keys = workdir / "keys"
        keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        command = [sys.executable, "-m", "guardian", *flags, "--guardian-config", str(config),
                   "--api-key-file", str(keys)]
    server = Server(kind, [*command, "--port", str(port)], port, workdir / f"{kind.split(',')[0]}-{port}.log",
                    env, cpus=cpus)
    if not server.wait_ready(START_TIMEOUT_S):
        raise SystemExit(f"{kind} did not start:\n" + "\n".join(server.log_tail(20)))
    return server


class Prompts:
    """A new prompt each time (no prompt-cache hits), from any thread."""

    def __init__(self):
        self._n = 0
        self._lock = threading.Lock()

    def next(self, who: str) -> str:
        with self._lock:
            self._n += 1
            return f"Request {self._n} from {who}. " + SENTENCE * 2


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream}


def time_to_first_token(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> float:
    """One streaming request of B, read to its end; seconds from sending it to its first event."""
    sent = time.monotonic()
    first = None
    with client.stream("POST", url + "/v1/chat/completions", json=body(prompt, max_tokens, True)) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"B: {response.status_code}: {response.text[:200]}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - sent
    if first is None:
        raise RuntimeError("B: a stream without a token")
    return first


def measure_b(server: Server, prompts: Prompts, samples: int, max_tokens: int, keyed: bool) -> list[float]:
    headers = {"Authorization": f"Bearer {KEYS['b']}"} if keyed else {}
    rng = random.Random(1)
    times = []
    with httpx.Client(timeout=300, headers=headers) as client:
        for _ in range(samples):
            times.append(time_to_first_token(client, server.url, prompts.next("b"), max_tokens))
            time.sleep(rng.uniform(0.005, 0.03))  # a pause, out of step with A's requests
    return times


def flood(url: str, headers: dict, threads: int, max_tokens: int, tag: str, ready, stop, tokens, errors) -> None:
    """Client A's process: ``threads`` looping clients, each with one request outstanding at all times."""
    prompts = Prompts()

    def loop() -> None:
        with httpx.Client(timeout=300, headers=headers) as client:
            while not stop.is_set():
                response = client.post(url + "/v1/chat/completions", json=body(prompts.next(tag), max_tokens, False))
                if response.status_code == 200:
                    with tokens.get_lock():
                        tokens.value += response.json()["usage"]["completion_tokens"]
                else:
                    with errors.get_lock():
                        errors.value += 1
                    print(f"A: {response.status_code}: {response.text[:200]}", file=sys.stderr)

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    for worker in workers:
        worker.start()
    ready.set()
    for worker in workers:
        worker.join()


class Flood:
    """Client A, in a process of its own: B's client, timing its first token,
    never waits for A's threads to let go of the interpreter."""

    _serial = itertools.count()

    def __init__(self, server: Server, threads: int, max_tokens: int, keyed: bool):
        context = multiprocessing.get_context("spawn")
        headers = {"Authorization": f"Bearer {KEYS['a']}"} if keyed else {}
        self._ready, self._stop = context.Event(), context.Event()
        self._tokens, self._errors = context.Value("q", 0), context.Value("i", 0)
        self._process = context.Process(
            target=flood, daemon=True,
            args=(server.url, headers, threads, max_tokens, f"a{next(self._serial)}", self._ready, self._stop,
                  self._tokens, self._errors))

    @property
    def tokens(self) -> int:
        return self._tokens.value

    @property
    def errors(self) -> int:
        return self._errors.value

    def __enter__(self) -> "Flood":
        self._process.start()
        if not self._ready.wait(60):
            raise RuntimeError("A's process did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._process.join(300)


def summary(times: list[float]) -> dict:
    return {"p50_ms": 1000 * percentile(times, 50), "p99_ms": 1000 * percentile(times, 99),
            "max_ms": 1000 * max(times), "samples": len(times)}


def run_one(kind: str, args, model: Path, workdir: Path, split) -> dict:
    server = start(kind, model, args.places, workdir, split[0] if split else None)
    keyed = kind != "stock"
    prompts = Prompts()
    # A's requests outstanding in each phase: none; one place short of a full batch; the flood.
    outstanding = {"unloaded": 0, "busy": max(1, args.places - 1), "loaded": args.flood * max(1, args.places // 2)}
    per_round = max(1, args.samples // args.rounds)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    a_tokens, a_seconds = 0, 0.0
    try:
        # Warm up: kernels for every batch shape, the server's thread pool, both clients' connections.
        measure_b(server, prompts, 10, args.b_tokens, keyed)
        with Flood(server, outstanding["loaded"], args.a_tokens, keyed):
            time.sleep(FILL_S)
            measure_b(server, prompts, 10, args.b_tokens, keyed)
        # The phases take turns, so that the machine's drifts touch them alike.
        for _ in range(args.rounds):
            times["unloaded"] += measure_b(server, prompts, per_round, args.b_tokens, keyed)
            for phase in ("busy", "loaded"):
                with Flood(server, outstanding[phase], args.a_tokens, keyed) as flood:
                    time.sleep(FILL_S)
                    started, tokens_before = time.monotonic(), flood.tokens
                    times[phase] += measure_b(server, prompts, per_round, args.b_tokens, keyed)
                    if phase == "loaded":
                        a_tokens += flood.tokens - tokens_before
                        a_seconds += time.monotonic() - started
                if flood.errors:
                    raise RuntimeError(f"{kind}: {flood.errors} of A's requests failed")
    finally:
        server.stop()
    result = {phase: summary(times[phase]) for phase in PHASES}
    result.update(outstanding={phase: outstanding[phase] for phase in PHASES}, times_s=times,
                  a_tokens_per_s=a_tokens / a_seconds,
                  # B's tokens while loaded (the demo model never stops early).
                  b_tokens_per_s=len(times["loaded"]) * args.b_tokens / a_seconds)
    for q in ("p50", "p99"):
        result[f"ratio_{q}"] = result["loaded"][f"{q}_ms"] / result["unloaded"][f"{q}_ms"]
    result["ratio_p99_busy"] = result["loaded"]["p99_ms"] / result["busy"]["p99_ms"]
    print(f"{kind}: B p99 {result['unloaded']['p99_ms']:.0f} / {result['busy']['p99_ms']:.0f} / "
          f"{result['loaded']['p99_ms']:.0f} ms (x{result['ratio_p99']:.2f}); A {result['a_tokens_per_s']:.0f} tok/s",
          file=sys.stderr, flush=True)
    return result


def report(data: dict) -> str:
    pinned = (f"server pinned to CPU {data['pinning']['server']}, clients on {data['pinning']['clients']}"
              if data["pinning"] else "unpinned")
    outstanding = data["results"][KINDS[-1]]["outstanding"]
    lines = [
        f"Fair admission, {data['when']}: {data['environment']}; demo model; {data['places']} places "
        f"(--decode-concurrency and --prompt-concurrency); B: {data['samples']} streaming requests one at a "
        f"time in each phase, max_tokens={data['b_tokens']}; A: {outstanding['busy']} requests outstanding "
        f"(busy) or {outstanding['loaded']} ({data['flood']} x its share; loaded), max_tokens={data['a_tokens']}; "
        f"{data['rounds']} rounds of the three phases; {pinned}; {data['wall_s'] / 60:.1f} min; load average "
        f"{data['load_average_before']:.1f} before, {data['load_average_after']:.1f} after.",
        "",
        "| server | B's TTFT p50 / p99: unloaded | busy batch | loaded | loaded / unloaded: p50 | p99 | "
        "loaded / busy: p99 | tokens/s loaded: A | B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        row = data["results"][kind]
        cells = " | ".join(f"{row[phase]['p50_ms']:.0f} / {row[phase]['p99_ms']:.0f} ms" for phase in PHASES)
        lines.append(f"| {kind} | {cells} | {row['ratio_p50']:.2f} | **{row['ratio_p99']:.2f}** | "
                     f"{row['ratio_p99_busy']:.2f} | {row['a_tokens_per_s']:.0f} | {row['b_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--places", type=int, default=4, help="--decode-concurrency and --prompt-concurrency")
    parser.add_argument("--flood", type=int, default=10, help="A's requests outstanding, in fair shares")
    parser.add_argument("--samples", type=int, default=120, help="B's requests in each phase")
    parser.add_argument("--rounds", type=int, default=4, help="turns of the three phases")
    parser.add_argument("--a-tokens", type=int, default=64)
    parser.add_argument("--b-tokens", type=int, default=16)
    parser.add_argument("--no-pin", action="store_true", help="let the server and the clients share every CPU")
    parser.add_argument("--no-write", action="store_true", help="print only; bench/results/ untouched")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from guardian.demo_model import ensure_demo_model

    model = ensure_demo_model()
    started = time.monotonic()
    split = None if args.no_pin else cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])  # the clients' threads inherit it
    data = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "environment": environment(),
            "places": args.places, "flood": args.flood, "samples": args.samples, "rounds": args.rounds,
            "a_tokens": args.a_tokens, "b_tokens": args.b_tokens,
            "pinning": {"server": sorted(split[0]), "clients": sorted(split[1])} if split else None,
            "results": {}, "load_average_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-fair-admission-") as workdir:
        for kind in KINDS:
            data["results"][kind] = run_one(kind, args, model, Path(workdir), split)
    data["wall_s"] = time.monotonic() - started
    # Other work on the machine shows in the tails: the 1-minute load average, for the reader.
    data["load_average_after"] = os.getloadavg()[0]
    table = report(data)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fair_admission.json").write_text(json.dumps(data, indent=1) + "\n")
        (RESULTS / "fair_admission.md").write_text(table + "\n")
    print(json.dumps(data, indent=1) if args.json else table)


if __name__ == "__main__":
    main()

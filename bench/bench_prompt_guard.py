"""What the prompt guard costs and what it saves: stock mlx_lm.server and
mlx-guardian side by side, in one run, on the same requests.

Servers serve the offline demo model (context 2048) on 127.0.0.1: stock
``mlx_lm.server``, ``mlx-guardian`` as it ships (the prompt guard on), and
``mlx-guardian`` with the prompt guard disabled, to tell the guard's own cost
from the rest of the guardian's. The script measures:

- throughput (completion tokens per second over all clients) and time to
  first token (p50, p99) of streaming chat requests with 1 and with 8
  concurrent clients. Every request has a prompt of its own (no prompt cache
  hits) and the same ``max_tokens``; the demo model never stops early.
  Each comparison runs as a pair of servers that take turns, round after
  round, in alternating order; a round's ratio compares two bursts run back
  to back, so slow drifts of the machine cancel. Each pair runs twice, once
  with each server started first, and the ratio reported is the geometric
  mean over both sessions' rounds with a 95 % bootstrap interval. A control
  pair of two identical stock servers shows what this method can resolve.
- the time the guardian takes to answer a ~145K-token chat prompt with its
  400, alone and while 8 clients stream.

By default (Linux, 2+ CPUs) the servers of a comparison share one CPU and the
load-generating client gets the others: on a 2-core machine the client
otherwise competes with the servers for CPU, and the scatter of A/A round
ratios measured here fell from 11 % to 4.6 % when pinned. A pinned server is
CPU-bound, so its throughput is the inverse of its CPU time per token, which
is what the guardian adds to. ``--no-pin`` measures the unpinned machine.

With ``--stock-long-prompt`` it also sends stock a prompt over the context
(~13K tokens, ``max_tokens=1``) and times how long stock spends on it and
what a small request sent beside it waits.

Usage::

    python bench/bench_prompt_guard.py              # a markdown report (~13 min)
    python bench/bench_prompt_guard.py --json       # the raw numbers
    python bench/bench_prompt_guard.py --rounds 4   # quicker, wider intervals

It is a benchmark, not a test: it never runs with the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import httpx
from servers import Server, cpu_split, free_port
from stats import environment, percentile

SENTENCE = "The guardian watches a language model server and keeps it alive. "
INCIDENT_SENTENCES = 8600  # ~146K demo tokens: the incident's ~145K history
STOCK_LONG_SENTENCES = 770  # ~13K tokens: the measurement in the issue
MAX_TOKENS = 128
PROMPT_SENTENCES = 6  # ~110 prompt tokens with the chat template
START_TIMEOUT_S = 60.0

# Throughput comparisons: (measured, baseline). The control pair is two
# identical stock servers: its interval is the method's resolution.
PAIRS = {
    "guardian_vs_stock": ("guardian", "stock"),
    "guard_on_vs_off": ("guardian", "unguarded"),
    "control_stock_vs_stock": ("stock_b", "stock"),
}

PAIR_LABELS = {
    "guardian_vs_stock": "guardian / stock",
    "guard_on_vs_off": "guard on / guard off",
    "control_stock_vs_stock": "stock / stock (control)",
}

LABELS = {
    "stock": "stock mlx_lm.server",
    "unguarded": "mlx-guardian, prompt_guard disabled",
    "guardian": "mlx-guardian (default: prompt_guard on)",
}


def start_servers(model: Path, workdir: Path, order: tuple, cpus: set[int] | None = None,
                  launcher: Callable[[str], list[str]] = lambda kind: []) -> dict[str, Server]:
    """The servers named in ``order``, started one after the other in that order.

    ``launcher(kind)``: what goes between the interpreter and ``-m MODULE``
    (a script that runs the module, as bench/profiled_server.py does).
    """
    common = ["--model", str(model), "--host", "127.0.0.1"]
    hf_cache = workdir / "hf-cache"  # stock's /v1/models needs one; nothing is downloaded
    hf_cache.mkdir(exist_ok=True)
    # One hash seed for all: dict and set layouts then differ less between processes.
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    unguarded = workdir / "unguarded.toml"
    unguarded.write_text('[guardian]\ndisabled_plugins = ["prompt_guard"]\n')
    stock = ["-m", "mlx_lm.server", *common]
    commands = {
        "stock": stock,
        "stock_b": stock,
        # The default configuration: the prompt guard is on.
        "guardian": ["-m", "guardian", *common],
        # The same without the prompt guard: what the guard itself costs.
        "unguarded": ["-m", "guardian", *common, "--guardian-config", str(unguarded)],
    }
    servers = {}
    for kind in order:
        port = free_port()
        command = [sys.executable, *launcher(kind), *commands[kind], "--port", str(port)]
        servers[kind] = Server(kind, command, port,
                               workdir / f"{kind}.log", env, cpus=cpus)
        # One at a time, so the start order is what it says.
        if not servers[kind].wait_ready(START_TIMEOUT_S):
            raise SystemExit(f"{kind} did not start:\n" + "\n".join(servers[kind].log_tail(20)))
    return servers


def chat(content: str, *, max_tokens: int = MAX_TOKENS, stream: bool = True) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}


def timed_stream(client: httpx.Client, url: str, body: dict) -> dict:
    """One streaming request: seconds to the first token, to the end, and the token count."""
    started = time.monotonic()
    first = None
    tokens = 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage") is not None:
                tokens = event["usage"]["completion_tokens"]
            delta = event["choices"][0].get("delta", {}) if event.get("choices") else {}
            if first is None and (delta.get("content") or delta.get("reasoning")):
                first = time.monotonic() - started
    return {"ttft_s": first, "duration_s": time.monotonic() - started, "tokens": tokens}


def run_load(url: str, prompts: list[str], clients: int) -> dict:
    """``clients`` clients share the prompts; returns tokens/s and each request's TTFT."""
    body = lambda prompt: {**chat(prompt), "stream_options": {"include_usage": True}}

    def client_loop(mine: list[str]) -> list[dict]:
        with httpx.Client(timeout=120) as client:
            return [timed_stream(client, url, body(p)) for p in mine]

    shares = [prompts[i::clients] for i in range(clients)]
    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for share in pool.map(client_loop, shares) for r in share]
    wall = time.monotonic() - started
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_s": [r["ttft_s"] for r in results]}




def burst_prompts(first: int, count: int) -> list[str]:
    """``count`` prompts of ~110 tokens, numbered from ``first``: no two share a prompt cache entry."""
    return [f"Request {n}. " + SENTENCE * PROMPT_SENTENCES for n in range(first, first + count)]


def measure_throughput(servers: dict, rounds: int, requests: dict[int, int]) -> dict:
    """Round after round, each server in turn, on the same prompts."""
    results = {clients: {kind: [] for kind in servers} for clients in requests}
    serial = 1
    for round_index in range(rounds):
        for clients, count in requests.items():
            prompts = burst_prompts(serial, count)
            serial += count
            kinds = list(servers)
            shift = round_index % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                results[clients][kind].append(run_load(servers[kind].url, prompts, clients))
    return results


def geometric_mean_interval(ratios: list[float], resamples: int = 10000) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` and its 95 % percentile-bootstrap interval."""
    logs = [math.log(r) for r in ratios]
    rng = random.Random(0)  # the same data gives the same interval
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return math.exp(statistics.fmean(logs)), math.exp(low), math.exp(high)


def summarize_throughput(sessions: dict) -> dict:
    """Per server: tokens/s and TTFT over every session; per pair: the round ratios.

    ``sessions`` maps (pair name, kind started first) to measure_throughput's result.
    """
    summary = {}
    clients_list = next(iter(sessions.values())).keys()
    for clients in clients_list:
        row = {"servers": {}, "pairs": {}}
        for kind in LABELS:
            runs = [r for (name, _), result in sessions.items() if name != "control_stock_vs_stock"
                    for r in result[clients].get(kind, [])]
            ttfts = [t for run in runs for t in run["ttft_s"]]
            row["servers"][kind] = {
                "tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
                "ttft_p50_ms": 1000 * percentile(ttfts, 50),
                "ttft_p99_ms": 1000 * percentile(ttfts, 99),
                "requests": len(ttfts),
            }
        for name, (a, b) in PAIRS.items():
            by_first = {}
            for first in (a, b):
                if (name, first) not in sessions:
                    continue
                by_kind = sessions[(name, first)][clients]
                by_first[first] = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(by_kind[a], by_kind[b])]
            if not by_first:
                continue
            ratios = [r for rounds in by_first.values() for r in rounds]
            mean, low, high = geometric_mean_interval(ratios)
            row["pairs"][name] = {
                "ratio": mean,
                "interval_95": [low, high],
                "by_started_first": {k: statistics.geometric_mean(v) for k, v in by_first.items()},
                "rounds": ratios,
            }
        summary[clients] = row
    return summary


def measure_rejection(guardian: Server, trials: int) -> dict:
    """Seconds to the 400 for a ~145K-token prompt, alone and beside 8 streams."""
    history = chat(SENTENCE * INCIDENT_SENTENCES, max_tokens=16, stream=False)

    def reject_once(client) -> tuple[float, dict]:
        started = time.monotonic()
        response = client.post(guardian.url + "/v1/chat/completions", json=history)
        elapsed = time.monotonic() - started
        if response.status_code != 400:
            raise RuntimeError(f"expected 400, got {response.status_code}: {response.text[:200]}")
        return elapsed, response.json()["error"]

    with httpx.Client(timeout=60) as client:
        alone = [reject_once(client) for _ in range(trials)]
        stop = threading.Event()

        def streamer(i: int) -> int:
            done = 0
            with httpx.Client(timeout=120) as streaming:
                while not stop.is_set():
                    timed_stream(streaming, guardian.url, chat(f"Busy {i}-{done}. " + SENTENCE * 6))
                    done += 1
            return done

        with ThreadPoolExecutor(8) as pool:
            busy = [pool.submit(streamer, i) for i in range(8)]
            time.sleep(1.0)  # let the 8 streams get going
            loaded = [reject_once(client) for _ in range(trials)]
            stop.set()
            served_beside = sum(f.result() for f in busy)
    error = alone[0][1]
    return {
        "n_prompt_tokens": error["n_prompt_tokens"],
        "n_ctx": error["n_ctx"],
        "code": error["code"],
        "alone_s": [t for t, _ in alone],
        "beside_8_streams_s": [t for t, _ in loaded],
        "streams_served_meanwhile": served_beside,
    }


def measure_stock_long_prompt(stock: Server) -> dict:
    """Stock on a prompt over the context: accepted, prefilled; a small request waits."""
    long_body = chat(SENTENCE * STOCK_LONG_SENTENCES, max_tokens=1, stream=False)
    result = {}

    def send_long():
        with httpx.Client(timeout=600) as client:
            started = time.monotonic()
            response = client.post(stock.url + "/v1/chat/completions", json=long_body)
            result["long_status"] = response.status_code
            result["long_s"] = time.monotonic() - started
            if response.status_code == 200:
                result["long_prompt_tokens"] = response.json()["usage"]["prompt_tokens"]

    sender = threading.Thread(target=send_long)
    sender.start()
    time.sleep(1.0)
    with httpx.Client(timeout=600) as client:
        small = timed_stream(client, stock.url, chat("A small request beside it.", max_tokens=8))
    result["small_ttft_s"] = small["ttft_s"]
    sender.join()
    return result




def report(data: dict) -> str:
    pinned = (f"servers pinned to CPU {data['pinning']['servers']}, client on CPUs {data['pinning']['client']}"
              if data["pinning"] else "unpinned")
    lines = [
        f"Prompt guard benchmark, {data['when']}: {data['environment']}; demo model "
        f"(context 2048), streaming chat, ~110 prompt tokens, max_tokens={MAX_TOKENS}; "
        f"{len(PAIRS)} pairs x 2 start orders x {data['rounds']} rounds, {pinned}; "
        f"wall time {data['wall_s'] / 60:.0f} min.",
        "",
        "| clients | comparison | ratio (geometric mean) | 95 % interval | each start order | rounds (min–max) |",
        "|---|---|---|---|---|---|",
    ]
    for clients, row in data["throughput"].items():
        for name, ratio in row["pairs"].items():
            orders = ", ".join(f"{v:.3f}" for v in ratio["by_started_first"].values())
            low, high = ratio["interval_95"]
            lines.append(
                f"| {clients} | {PAIR_LABELS[name]} | **{ratio['ratio']:.3f}** | {low:.3f}–{high:.3f} | "
                f"{orders} | {min(ratio['rounds']):.3f}–{max(ratio['rounds']):.3f} |"
            )
    lines += [
        "",
        "| clients | server | tokens/s | TTFT p50 / p99 | requests |",
        "|---|---|---|---|---|",
    ]
    for clients, row in data["throughput"].items():
        for kind, k in row["servers"].items():
            lines.append(f"| {clients} | {LABELS[kind]} | {k['tokens_per_s']:.1f} | "
                         f"{k['ttft_p50_ms']:.0f} / {k['ttft_p99_ms']:.0f} ms | {k['requests']} |")
    r = data["rejection"]
    lines += [
        "",
        f"Guardian (unpinned), a {r['n_prompt_tokens']}-token chat prompt (n_ctx {r['n_ctx']}): "
        f"400 `{r['code']}` in {fmt_times(r['alone_s'])} alone; "
        f"{fmt_times(r['beside_8_streams_s'])} while 8 clients stream "
        f"({r['streams_served_meanwhile']} streams served meanwhile).",
    ]
    if "stock_long_prompt" in data:
        s = data["stock_long_prompt"]
        lines.append(
            f"Stock, a {s.get('long_prompt_tokens', '?')}-token prompt (over the 2048 context): "
            f"HTTP {s['long_status']} after {s['long_s']:.1f} s of prefill; a small request sent "
            f"1 s later got its first token after {s['small_ttft_s']:.1f} s."
        )
    return "\n".join(lines)


def fmt_times(seconds: list[float]) -> str:
    ms = sorted(1000 * t for t in seconds)
    return f"{statistics.median(ms):.0f} ms median, {ms[-1]:.0f} ms max of {len(ms)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12,
                        help="rounds in each session (3 pairs x 2 start orders)")
    parser.add_argument("--single-requests", type=int, default=12,
                        help="requests a burst with 1 client")
    parser.add_argument("--concurrent-requests", type=int, default=48,
                        help="requests a burst with 8 clients")
    parser.add_argument("--no-pin", action="store_true",
                        help="let servers and client share every CPU")
    parser.add_argument("--no-control", action="store_true", help="skip the stock / stock pair")
    parser.add_argument("--rejection-trials", type=int, default=5)
    parser.add_argument("--stock-long-prompt", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from guardian.demo_model import ensure_demo_model

    model = ensure_demo_model()
    started = time.monotonic()
    split = None if args.no_pin else cpu_split()
    server_cpus = None
    if split is not None:
        server_cpus, client_cpus = split
        os.sched_setaffinity(0, client_cpus)  # threads started from now on inherit it
    data = {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "environment": environment(),
        "rounds": args.rounds,
        "pinning": {"servers": sorted(split[0]), "client": sorted(split[1])} if split else None,
    }
    requests = {1: args.single_requests, 8: args.concurrent_requests}
    sessions = {}
    pairs = {k: v for k, v in PAIRS.items() if not (args.no_control and k == "control_stock_vs_stock")}
    for name, pair in pairs.items():
        for order in (pair, pair[::-1]):
            with tempfile.TemporaryDirectory(prefix="bench-prompt-guard-") as workdir:
                servers = start_servers(model, Path(workdir), order, server_cpus)
                try:
                    for server in servers.values():  # load the weights, warm the caches
                        run_load(server.url, [f"Warm-up {i}. " + SENTENCE for i in range(8)], 8)
                    sessions[(name, order[0])] = measure_throughput(servers, args.rounds, requests)
                finally:
                    for server in servers.values():
                        server.stop()
    data["throughput"] = summarize_throughput(sessions)
    if split is not None:
        os.sched_setaffinity(0, split[0] | split[1])
    with tempfile.TemporaryDirectory(prefix="bench-prompt-guard-") as workdir:
        kinds = ("guardian", "stock") if args.stock_long_prompt else ("guardian",)
        servers = start_servers(model, Path(workdir), kinds)
        try:
            data["rejection"] = measure_rejection(servers["guardian"], args.rejection_trials)
            if args.stock_long_prompt:
                data["stock_long_prompt"] = measure_stock_long_prompt(servers["stock"])
        finally:
            for server in servers.values():
                server.stop()
    data["wall_s"] = time.monotonic() - started
    print(json.dumps(data, indent=2) if args.json else report(data))


if __name__ == "__main__":
    main()

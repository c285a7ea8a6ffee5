"""What subprocess mode's relay costs: the in-process guardian and ``--supervise``, side by side.

Two servers serve the offline demo model on 127.0.0.1: ``mlx-guardian`` (the
engine in the process that serves HTTP) and ``mlx-guardian --supervise`` (a
supervisor on the public port relays every request with httpx to the same
guardian running as its child). N looping clients each send their share of a
burst of chat requests, streamed or not; every request has a prompt of its
own (no prompt-cache hits) and the same ``max_tokens`` (the demo model never
stops early). Round after round, each server takes its turn with each kind of
request, in alternating order, and a round's ratio compares two bursts run
back to back, so slow drifts of the machine cancel. The ratio reported is the
median over rounds (supervise / in-process tokens/s) with the rounds' range
and interquartile spread.

By default (Linux, 2+ CPUs) both servers are pinned to one CPU (the
supervisor and its child share it, so everything the relay does is taken from
generation) and the clients get the others; ``--no-pin`` measures the machine
unpinned. The supervisor's own CPU time per request and per token (read from
/proc) is the relay's cost without the noise of throughput.

    .venv/bin/python bench/relay_cost.py                 # ~5 min, a markdown table
    .venv/bin/python bench/relay_cost.py --rounds 4 --json

It is a benchmark, not a test: it never runs with the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx
from servers import Server, free_port
from stats import environment

SENTENCE = "The guardian watches a language model server and keeps it alive. "
KINDS = ("in-process", "supervise")
MODES = ("stream", "non-stream")
START_TIMEOUT_S = 120.0


def cpu_split() -> tuple[set[int], set[int]] | None:
    """(the servers' CPU, the clients' CPUs), or None where pinning is not possible."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[-1]}, set(cpus[:-1])


def start_servers(model: Path, workdir: Path, cpus: set[int] | None) -> dict[str, Server]:
    """Both servers, one after the other; a pinned supervisor's child inherits its CPU."""
    common = ["--model", str(model), "--host", "127.0.0.1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    commands = {
        "in-process": [sys.executable, "-m", "guardian", *common],
        "supervise": [sys.executable, "-m", "guardian", "--supervise", *common],
    }
    servers = {}
    for kind in KINDS:
        port = free_port()
        servers[kind] = Server(kind, [*commands[kind], "--port", str(port)], port,
                               workdir / f"{kind}.log", env, cpus=cpus)
        if not servers[kind].wait_ready(START_TIMEOUT_S):
            raise SystemExit(f"{kind} did not start:\n" + "\n".join(servers[kind].log_tail(20)))
    return servers


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (its own threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int, stream: bool) -> int:
    """One chat request; its completion tokens."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream}
    if not stream:
        response = client.post(url + "/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
        return response.json()["usage"]["completion_tokens"]
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[len("data: "):]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def burst(server: Server, prompts: list[str], clients: int, max_tokens: int, stream: bool) -> dict:
    """``clients`` looping clients share ``prompts``: tokens/s, requests/s, the supervisor's CPU."""
    def client_loop(mine: list[str]) -> int:
        with httpx.Client(timeout=300) as client:
            return sum(one_request(client, server.url, p, max_tokens, stream) for p in mine)

    pid = server.proc.pid
    cpu_before = cpu_seconds(pid) if Path(f"/proc/{pid}/stat").exists() else None
    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client_loop, [prompts[i::clients] for i in range(clients)]))
    wall = time.monotonic() - started
    result = {"tokens": tokens, "requests": len(prompts), "wall_s": wall,
              "tokens_per_s": tokens / wall, "requests_per_s": len(prompts) / wall}
    if cpu_before is not None:
        result["process_cpu_s"] = cpu_seconds(pid) - cpu_before
    return result


def measure(servers: dict, rounds: int, requests: int, clients: int, max_tokens: int) -> dict:
    """Round after round, each mode, each server in turn (the order alternates), same prompts."""
    results = {mode: {kind: [] for kind in KINDS} for mode in MODES}
    serial = 0
    for round_index in range(rounds):
        for mode in MODES:
            prompts = [f"Request {serial + n}. " + SENTENCE * 4 for n in range(requests)]
            serial += requests
            order = KINDS if (round_index % 2 == 0) else KINDS[::-1]
            for kind in order:
                results[mode][kind].append(burst(servers[kind], prompts, clients, max_tokens,
                                                 stream=mode == "stream"))
            print(f"round {round_index + 1}/{rounds} {mode}: " + ", ".join(
                f"{kind} {results[mode][kind][-1]['tokens_per_s']:.0f} tok/s" for kind in KINDS),
                file=sys.stderr, flush=True)
    return results


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def summarize(results: dict) -> dict:
    summary = {}
    pooled = []
    for mode in MODES:
        runs = results[mode]
        ratios = [s["tokens_per_s"] / i["tokens_per_s"] for s, i in zip(runs["supervise"], runs["in-process"])]
        pooled += ratios
        row = {
            "ratio_median": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "ratio_iqr": list(quartiles(ratios)),
            "rounds": ratios,
        }
        for kind in KINDS:
            row[kind] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[kind]),
                         "requests_per_s": statistics.median(r["requests_per_s"] for r in runs[kind])}
        supervisor = [r for r in runs["supervise"] if "process_cpu_s" in r]
        if supervisor:
            row["supervisor_cpu_ms_per_request"] = statistics.median(
                1000 * r["process_cpu_s"] / r["requests"] for r in supervisor)
            row["supervisor_cpu_us_per_token"] = statistics.median(
                1e6 * r["process_cpu_s"] / r["tokens"] for r in supervisor)
            row["supervisor_cpu_share"] = statistics.median(r["process_cpu_s"] / r["wall_s"] for r in supervisor)
        summary[mode] = row
    summary["both"] = {"ratio_median": statistics.median(pooled), "ratio_range": [min(pooled), max(pooled)],
                       "ratio_iqr": list(quartiles(pooled))}
    return summary




def report(data: dict) -> str:
    pinned = (f"servers pinned to CPU {data['pinning']['servers']}, clients on {data['pinning']['client']}"
              if data["pinning"] else "unpinned")
    lines = [
        f"Relay cost, {data['when']}: {data['environment']}; demo model; {data['clients']} looping clients, "
        f"bursts of {data['requests']} chat requests, max_tokens={data['max_tokens']}, {data['rounds']} rounds "
        f"alternating; {pinned}; {data['wall_s'] / 60:.1f} min.",
        "",
        "| requests | in-process tok/s | supervise tok/s | ratio (median) | rounds min–max | IQR | "
        "supervisor CPU / request | / token | supervisor CPU share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        row = data["summary"][mode]
        cpu = ("| {:.2f} ms | {:.0f} µs | {:.1%} |".format(row["supervisor_cpu_ms_per_request"],
                                                          row["supervisor_cpu_us_per_token"],
                                                          row["supervisor_cpu_share"])
               if "supervisor_cpu_ms_per_request" in row else "| – | – | – |")
        lines.append(f"| {mode} | {row['in-process']['tokens_per_s']:.0f} | {row['supervise']['tokens_per_s']:.0f} | "
                     f"**{row['ratio_median']:.3f}** | {row['ratio_range'][0]:.3f}–{row['ratio_range'][1]:.3f} | "
                     f"{row['ratio_iqr'][0]:.3f}–{row['ratio_iqr'][1]:.3f} {cpu}")
    both = data["summary"]["both"]
    lines.append(f"| both | | | **{both['ratio_median']:.3f}** | {both['ratio_range'][0]:.3f}–"
                 f"{both['ratio_range'][1]:.3f} | {both['ratio_iqr'][0]:.3f}–{both['ratio_iqr'][1]:.3f} | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48, help="requests in a burst")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-pin", action="store_true", help="let servers and clients share every CPU")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from guardian.demo_model import ensure_demo_model

    model = ensure_demo_model()
    started = time.monotonic()
    split = None if args.no_pin else cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])  # the clients' threads inherit it
    data = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "environment": environment(),
            "rounds": args.rounds, "clients": args.clients, "requests": args.requests,
            "max_tokens": args.max_tokens,
            "pinning": {"servers": sorted(split[0]), "client": sorted(split[1])} if split else None}
    with tempfile.TemporaryDirectory(prefix="bench-relay-cost-") as workdir:
        servers = start_servers(model, Path(workdir), split[0] if split else None)
        try:
            for server in servers.values():  # load the weights, warm the caches and the pools
                for mode in MODES:
                    burst(server, [f"Warm-up {i}. " + SENTENCE for i in range(args.clients)], args.clients,
                          args.max_tokens, stream=mode == "stream")
            data["results"] = measure(servers, args.rounds, args.requests, args.clients, args.max_tokens)
        finally:
            for server in servers.values():
                if server.alive():
                    server.proc.terminate()  # a supervisor stops its child first
                    try:
                        server.proc.wait(timeout=30)
                    except Exception:  # noqa: BLE001 - stop() kills it
                        pass
                server.stop()
    data["summary"] = summarize(data["results"])
    data["wall_s"] = time.monotonic() - started
    print(json.dumps(data, indent=2) if args.json else report(data))


if __name__ == "__main__":
    main()

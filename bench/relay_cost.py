"""What subprocess mode costs: the in-process guardian and ``--supervise``, side by side.

Three servers serve the offline demo model on 127.0.0.1: ``mlx-guardian`` (the
engine in the process that serves HTTP), ``mlx-guardian --supervise`` (a
supervisor on the public port hands each request's connection to the same
guardian running as its child, which answers on it: guardian.handoff), and
``--supervise`` with ``[supervisor] hand_off = false`` ("supervise-relay": the
supervisor relays every byte, as where the hand-off cannot be used: TLS, macOS). N looping clients each send their share of a
burst of chat requests, streamed or not; every request has a prompt of its
own (no prompt-cache hits) and the same ``max_tokens`` (the demo model never
stops early). Round after round, each server takes its turn with each kind of
request, in alternating order, and a round's ratio compares two bursts run
back to back, so slow drifts of the machine cancel. The ratio reported is the
median over rounds (supervise / in-process tokens/s, and supervise-relay's) with the rounds' range
and interquartile spread.

By default (Linux, 2+ CPUs) both servers are pinned to one CPU (the
supervisor and its child share it, so everything the relay does is taken from
generation) and the clients get the others; ``--no-pin`` measures the machine
unpinned. The supervisor's own CPU time per request and per token (read from
/proc) is the relay's cost without the noise of throughput.

``--per-event`` measures what relaying one streamed event costs, apart from
any engine: a stand-in child (a process that answers each connection with
paced SSE events, one write each, as the engine's are) and a reading client
(another process); between them, on one thread here, the supervisor's own
``Upstream`` and ``ProxyHandler.relay_events``; the same with its own work
timed, from each read's return to its write; and a bare loop (one read, one
write per event: what any relay in Python pays, mostly the thread's
wake-up), in turn. The thread's CPU time per event is the figure.

    .venv/bin/python bench/relay_cost.py                 # 1-3 min, a markdown table
    .venv/bin/python bench/relay_cost.py --rounds 4 --json
    .venv/bin/python bench/relay_cost.py --steady 5 --rounds 3 --modes stream
    .venv/bin/python bench/relay_cost.py --per-event     # ~20 s
    .venv/bin/python bench/relay_cost.py --steady 8 --rounds 20 --modes stream --no-relay  # ~7 min
    .venv/bin/python bench/relay_cost.py --sized 256,4 --steady 8 --rounds 12 --modes stream --no-relay  # ~6 min
    .venv/bin/python bench/relay_cost.py --steady 6 --epochs 4 --rounds 8 --modes stream --no-relay  # ~12 min

``--sized HIDDEN,LAYERS`` serves a random-weight model of that shape instead of the
demo model (made offline once, into the guardian's cache): the demo model's tokens
cost ~0.4 ms of CPU, mostly per-step overhead, so every fixed cost of the hand-off
weighs on it ~10-100 times as much as on a real model's.

``--steady S`` measures S seconds of continuous load per server and round
instead of a burst: the window opens once every client is under way and
closes before any stops, so no burst's ramp or tail (where the servers idle
and any ratio is near 1) is in it.

``--epochs N`` starts fresh servers N times, in alternating order, for ``--rounds``
rounds each, and prints each epoch's median beside the whole run's: rounds share
their processes, so what a process owes to its start (where its memory fell, which
started first) would be in every round of a single epoch.

``--varied`` (with ``--steady``) draws each request's ``max_tokens`` from a quarter
to seven quarters of ``--max-tokens``: with one length for all (the demo model
never stops early), requests that start in one step end in one step, and stock's
loop, which takes new requests only between runs of steps, keeps its batch in
such cohorts.

``--stock`` adds stock ``mlx_lm.server`` on the same model, in the same rounds:
its row's ratio is stock's tokens/s over the in-process guardian's (above 1:
stock is faster), and its CPU column the in-process guardian's CPU per token
over stock's, the same way round.

It is a benchmark, not a test: it never runs with the test suite.
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx
import psutil
from servers import Server, cpu_split, free_port
from stats import environment

SENTENCE = "The guardian watches a language model server and keeps it alive. "
KINDS = ("in-process", "supervise", "supervise-relay")
SUPERVISED = ("supervise", "supervise-relay")
STOCK = "stock"  # --stock: the reference every guardian server is a drop-in for
MODES = ("stream", "non-stream")
START_TIMEOUT_S = 120.0


def server_env(**extra: str) -> dict[str, str]:
    """Every server's environment: offline, the same hash seed, plus ``extra``."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0", **extra}


def start_server(kind: str, command: list[str], workdir: Path, env: dict, cpus: set[int] | None) -> Server:
    """``command`` on a free port, its log in ``workdir``, once it answers ready."""
    port = free_port()
    server = Server(kind, [*command, "--port", str(port)], port, workdir / f"{kind}.log", env, cpus=cpus)
    if not server.wait_ready(START_TIMEOUT_S):
        raise SystemExit(f"{kind} did not start:\n" + "\n".join(server.log_tail(20)))
    return server


def start_servers(model: Path, workdir: Path, cpus: set[int] | None, kinds=KINDS) -> dict[str, Server]:
    """The servers, one after the other; a pinned supervisor's child inherits its CPU."""
    common = ["--model", str(model), "--host", "127.0.0.1"]
    commands = {
        "in-process": [sys.executable, "-m", "guardian", *common],
        "supervise": [sys.executable, "-m", "guardian", "--supervise", *common],
        "supervise-relay": [sys.executable, "-m", "guardian", "--supervise", *common,
                            "--guardian-config", str(relaying_config(workdir))],
        STOCK: [sys.executable, "-m", "mlx_lm.server", *common],
    }
    return {kind: start_server(kind, commands[kind], workdir, server_env(), cpus) for kind in kinds}


def relaying_config(workdir: Path) -> Path:
    path = workdir / "relay.toml"
    path.write_text("[supervisor]\nhand_off = false\n")
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (its own threads, not its children)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


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


class CpuWindow:
    """The CPU a server spends between ``__init__`` and ``read()``: the process itself
    (a supervisor, or the in-process server) and the engine's process (its child, or
    itself). From /proc: nothing where there is none."""

    def __init__(self, server: Server):
        self.pid, self.child = server.proc.pid, child_pid(server)
        self.available = Path(f"/proc/{self.pid}/stat").exists()
        if self.available:
            self.process_before = cpu_seconds(self.pid)
            self.child_before = cpu_seconds(self.child) if self.child is not None else None

    def read(self) -> dict:
        """``process_cpu_s`` and ``engine_cpu_s`` so far, or {} without /proc."""
        if not self.available:
            return {}
        process = cpu_seconds(self.pid) - self.process_before
        engine = cpu_seconds(self.child) - self.child_before if self.child is not None else process
        return {"process_cpu_s": process, "engine_cpu_s": engine}


def burst(server: Server, prompts: list[str], clients: int, max_tokens: int, stream: bool) -> dict:
    """``clients`` looping clients share ``prompts``: tokens/s, requests/s, the supervisor's CPU."""
    def client_loop(mine: list[str]) -> int:
        with httpx.Client(timeout=300) as client:
            return sum(one_request(client, server.url, p, max_tokens, stream) for p in mine)

    cpu = CpuWindow(server)
    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client_loop, [prompts[i::clients] for i in range(clients)]))
    wall = time.monotonic() - started
    # The load average says how much else ran: other work on a shared machine skews a round.
    result = {"tokens": tokens, "requests": len(prompts), "wall_s": wall,
              "tokens_per_s": tokens / wall, "requests_per_s": len(prompts) / wall,
              "load_1min": os.getloadavg()[0], **cpu.read()}
    return result


def steady(server: Server, serial: int, clients: int, max_tokens: int, stream: bool, seconds: float,
           warmup_s: float = 2.0, headers: dict | None = None, varied: bool = False) -> dict:
    """``clients`` looping clients, each sending request after request; measured over a
    window of ``seconds`` once they all run, so no burst's ramp up or tail is in it.
    ``varied``: each request's ``max_tokens`` drawn from a quarter of ``max_tokens`` to
    seven quarters (the same mean), so requests that start together do not end together.

    Streamed tokens are counted as they arrive (one per content event: the demo model's);
    a non-streamed answer's tokens when it arrives.
    """
    counted = [0, 0]  # tokens, requests
    lock = threading.Lock()
    stop = threading.Event()
    numbers = itertools.count(serial)
    clients_started = itertools.count()

    def client_loop() -> None:
        lengths = random.Random(f"{serial}-{next(clients_started)}")
        with httpx.Client(timeout=300, headers=headers) as client:
            while not stop.is_set():
                body = {"messages": [{"role": "user", "content": f"Request {next(numbers)}. " + SENTENCE * 4}],
                        "max_tokens": lengths.randint(max(1, max_tokens // 4), max_tokens * 7 // 4)
                        if varied else max_tokens, "stream": stream}
                if stream:
                    with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: {") and '"content": "' in line:
                                with lock:
                                    counted[0] += 1
                else:
                    response = client.post(server.url + "/v1/chat/completions", json=body)
                    with lock:
                        counted[0] += response.json()["usage"]["completion_tokens"]
                with lock:
                    counted[1] += 1

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(warmup_s)  # every client under way (a benchmark's pace, not a wait for a condition)
    with lock:
        tokens_before, requests_before = counted
    cpu = CpuWindow(server)
    started = time.monotonic()
    time.sleep(seconds)  # the measured window
    with lock:
        tokens, requests = counted[0] - tokens_before, counted[1] - requests_before
    wall = time.monotonic() - started
    result = {"tokens": tokens, "requests": max(requests, 1),  # per-request figures divide by it
              "wall_s": wall, "tokens_per_s": tokens / wall, "requests_per_s": requests / wall,
              "load_1min": os.getloadavg()[0], **cpu.read()}
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    return result


def child_pid(server: Server):
    """A supervisor's child, from its status; None for a server that is not a supervisor."""
    if server.kind not in SUPERVISED:
        return None
    return httpx.get(server.url + "/guardian/supervisor", timeout=10).json()["child"]["pid"]


def measure(servers: dict, rounds: int, requests: int, clients: int, max_tokens: int, modes=MODES,
            steady_s: float = 0.0, varied: bool = False) -> dict:
    """Round after round, each mode, each server in turn (the order alternates), same prompts
    (``steady_s``: a window of continuous load each instead of a burst; ``varied``: its
    requests' lengths vary, see ``steady``)."""
    kinds = tuple(servers)
    results = {mode: {kind: [] for kind in kinds} for mode in modes}
    serial = 0
    for round_index in range(rounds):
        for mode in modes:
            prompts = [f"Request {serial + n}. " + SENTENCE * 4 for n in range(requests)]
            serial += requests
            order = kinds if (round_index % 2 == 0) else kinds[::-1]
            for kind in order:
                if steady_s:
                    serial += 10_000
                    results[mode][kind].append(steady(servers[kind], serial, clients, max_tokens,
                                                      stream=mode == "stream", seconds=steady_s,
                                                      varied=varied))
                else:
                    results[mode][kind].append(burst(servers[kind], prompts, clients, max_tokens,
                                                     stream=mode == "stream"))
            print(f"round {round_index + 1}/{rounds} {mode}: " + ", ".join(
                f"{kind} {results[mode][kind][-1]['tokens_per_s']:.0f} tok/s" for kind in kinds),
                file=sys.stderr, flush=True)
    return results


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def ci95(values: list[float]) -> float:
    """Half the width of the mean's 95 % interval (normal approximation; 0 for one value)."""
    return 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def cpu_per_token(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs) / sum(r["tokens"] for r in runs)


def throughput(runs: list[dict]) -> float:
    return sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs)


def summarize(results: dict) -> dict:
    """Per mode and supervised kind (and stock): the ratio to in-process over rounds, and the supervisor's CPU."""
    summary = {}
    compared = [kind for kind in (*SUPERVISED, STOCK) if kind in next(iter(results.values()))]
    pooled = {kind: [] for kind in compared}
    for mode in results:
        runs = results[mode]
        row = {kind: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[kind]),
                      "requests_per_s": statistics.median(r["requests_per_s"] for r in runs[kind])}
               for kind in runs}
        for kind in compared:
            ratios = [s["tokens_per_s"] / i["tokens_per_s"] for s, i in zip(runs[kind], runs["in-process"])]
            pooled[kind] += ratios
            row[kind].update(ratio_median=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)],
                             ratio_mean=statistics.fmean(ratios), ratio_ci95=ci95(ratios),
                             ratio_iqr=list(quartiles(ratios)), rounds=ratios,
                             # Every round's tokens over every round's time: the longest view.
                             ratio_pooled=throughput(runs[kind]) / throughput(runs["in-process"]))
            if kind == STOCK:  # one process, no supervisor: its CPU per token against the guardian's
                if all("engine_cpu_s" in r for r in runs[kind]):
                    row[kind]["cpu_per_token_ratio"] = (cpu_per_token(runs["in-process"], "engine_cpu_s")
                                                        / cpu_per_token(runs[kind], "engine_cpu_s"))
                continue
            supervisor = [r for r in runs[kind] if "process_cpu_s" in r]
            if supervisor:
                # CPU per token, supervisor and child, against the in-process server's: what
                # subprocess mode costs, free of the rounds' throughput noise.
                row[kind]["cpu_per_token_ratio"] = cpu_per_token(runs["in-process"], "engine_cpu_s") / (
                    cpu_per_token(runs[kind], "engine_cpu_s") + cpu_per_token(runs[kind], "process_cpu_s"))
                row[kind]["child_cpu_per_token_ratio"] = (cpu_per_token(runs["in-process"], "engine_cpu_s")
                                                          / cpu_per_token(runs[kind], "engine_cpu_s"))
                row[kind].update(
                    supervisor_cpu_ms_per_request=statistics.median(
                        1000 * r["process_cpu_s"] / r["requests"] for r in supervisor),
                    supervisor_cpu_us_per_token=statistics.median(
                        1e6 * r["process_cpu_s"] / r["tokens"] for r in supervisor),
                    supervisor_cpu_share=statistics.median(r["process_cpu_s"] / r["wall_s"] for r in supervisor))
        summary[mode] = row
    summary["both"] = {kind: {"ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                              "ratio_mean": statistics.fmean(ratios), "ratio_ci95": ci95(ratios),
                              "ratio_iqr": list(quartiles(ratios))} for kind, ratios in pooled.items()}
    return summary


def model_label(model) -> str:
    if model is None or model["name"].startswith("demo-model"):
        return "demo model"
    return (f"random-weight Llama, hidden {model['hidden_size']}, {model['num_hidden_layers']} layers "
            f"(--sized)")


def report(data: dict) -> str:
    pinned = (f"servers pinned to CPU {data['pinning']['servers']}, clients on {data['pinning']['client']}"
              if data["pinning"] else "unpinned")
    loads = [run["load_1min"] for mode in data["results"] for runs in data["results"][mode].values() for run in runs
             if "load_1min" in run]
    load = f"; load average {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    lines = [
        f"Relay cost, {data['when']}: {data['environment']}; {model_label(data.get('model'))}; "
        f"{data['clients']} looping clients, "
        + (f"{data['steady_s']:g} s of continuous load" if data.get("steady_s") else
           f"bursts of {data['requests']} chat requests")
        + (f", max_tokens {data['max_tokens'] // 4}-{data['max_tokens'] * 7 // 4} (mean {data['max_tokens']})"
           if data.get("varied") else f", max_tokens={data['max_tokens']}")
        + f", {epochs_label(data)}{data['rounds']} rounds alternating; {pinned}; {data['wall_s'] / 60:.1f} min{load}.",
        "",
        "| requests | supervisor | in-process tok/s | supervised tok/s | ratio (median) | rounds min–max | IQR | "
        "mean ± 95 % | pooled | CPU per token (in-process ÷ child + supervisor) | supervisor CPU / request | / token | "
        "supervisor CPU share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in (*data["results"], "both"):
        for kind in data["summary"]["both"]:
            row = data["summary"][mode][kind]
            cpu = ("| {:.2f} ms | {:.0f} µs | {:.1%} |".format(row["supervisor_cpu_ms_per_request"],
                                                              row["supervisor_cpu_us_per_token"],
                                                              row["supervisor_cpu_share"])
                   if "supervisor_cpu_ms_per_request" in row else "| | | |")
            speeds = (f"{data['summary'][mode]['in-process']['tokens_per_s']:.0f} | {row['tokens_per_s']:.0f}"
                      if mode != "both" else " | ")
            how = {"supervise": "hands off", STOCK: "stock mlx_lm.server (no guardian)"}.get(kind, "relays")
            mean = f"{row['ratio_mean']:.3f} ± {row['ratio_ci95']:.3f}" if "ratio_mean" in row else ""
            pooled = f"{row['ratio_pooled']:.3f}" if "ratio_pooled" in row else ""
            if "cpu_per_token_ratio" in row:
                pooled += f" | **{row['cpu_per_token_ratio']:.3f}**"
                if "child_cpu_per_token_ratio" in row:  # JSON written before it was kept has none
                    pooled += f" (child alone {row['child_cpu_per_token_ratio']:.3f})"
            elif mode != "both":
                pooled += " | –"
            else:
                pooled += " |"
            lines.append(f"| {mode} | {how} | {speeds} | **{row['ratio_median']:.3f}** | "
                         f"{row['ratio_range'][0]:.3f}–{row['ratio_range'][1]:.3f} | "
                         f"{row['ratio_iqr'][0]:.3f}–{row['ratio_iqr'][1]:.3f} | {mean} | {pooled} {cpu}")
    epochs = data.get("epochs", [])
    if len(epochs) > 1:  # each epoch's own median: apart by more than the rounds' noise, the processes differ
        lines.append("")
        for kind in data["summary"]["both"]:
            lines.append(f"Each epoch's median ratio, {kind}: " + ", ".join(
                f"{epoch['summary']['both'][kind]['ratio_median']:.3f} ({epoch['started'][0]} started first)"
                for epoch in epochs) + ".")
    return "\n".join(lines)


def epochs_label(data: dict) -> str:
    epochs = len(data.get("epochs", []))
    return f"{epochs} epochs of fresh servers × " if epochs > 1 else ""


# --per-event: a stand-in child, an event as the guardian's child writes it (its
# token tag, then a chat chunk), and a client that reads until the end.
PACED_CHILD = r'''
import socket, sys, time
events, gap_s = int(sys.argv[1]), float(sys.argv[2])
event = (b": guardian-tokens %d\ndata: {\"id\": \"chatcmpl-d3b47202-5b10-45d6-94a3-2af447450a52\", "
         b"\"object\": \"chat.completion.chunk\", \"model\": \"default_model\", \"created\": 1796157108, "
         b"\"choices\": [{\"index\": 0, \"finish_reason\": null, \"delta\": {\"content\": \" guardian\"}}]}\n\n")
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    request = b""
    while not request.endswith(b"\r\n\r\n{}"):
        request += conn.recv(1 << 16)
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nX-Guardian-Continuable: 1\r\n\r\n")
    for i in range(events):
        conn.sendall(event % i)
        time.sleep(gap_s)
    conn.sendall(b"data: [DONE]\n\n")
    conn.close()
'''
READING_CLIENT = r'''
import socket, sys
for _ in sys.stdin:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as sock:
        print("connected", flush=True)
        while sock.recv(1 << 16):
            pass
    print("read", flush=True)
'''
# As the connection layer sets a handler's socket ([http] send_timeout_s).
CLIENT_SEND_TIMEOUT_S = 30.0


def relay_events_loop(client, upstream, events: int) -> None:
    """The supervisor's own relay of one stream: tags taken, events whole, one write per read."""
    from guardian.relay_protocol import RelayedStream
    from guardian.supervise.proxy import ProxyHandler

    handler = ProxyHandler.__new__(ProxyHandler)  # relay_events needs only the client's connection
    handler.connection = client
    stream = RelayedStream()
    cut = handler.relay_events(upstream, stream)
    if cut is not None or len(stream.tokens) != events:
        raise RuntimeError(f"relay_events: {cut!r}, {len(stream.tokens)} of {events} tokens")


class StampedReads:
    """The Upstream, each of its reads stamped as it returns."""

    def __init__(self, upstream, stamps: list):
        self.upstream, self.stamps = upstream, stamps

    def chunks(self):
        for chunk in self.upstream.chunks():
            self.stamps.append(time.perf_counter())
            yield chunk


class StampedWrites:
    """The client's connection, each write stamped as it starts, then written as the relay writes."""

    def __init__(self, sock: socket.socket, stamps: list):
        from guardian.supervise.client_writes import client_writer

        self.write, self.stamps = client_writer(sock), stamps

    def sendall(self, data: bytes) -> None:
        self.stamps.append(time.perf_counter())
        self.write(data)


def relay_events_timed(client: socket.socket, upstream, events: int) -> list[float]:
    """relay_events with its own work timed, event by event: from a read's return to its write."""
    reads, writes = [], []
    relay_events_loop(StampedWrites(client, writes), StampedReads(upstream, reads), events)
    # Each paced event is one read and one write; anything else cannot be paired.
    return [1e6 * (w - r) for r, w in zip(reads, writes)] if len(reads) == len(writes) else []


def bare_loop(client: socket.socket, upstream, events: int) -> None:
    """One read and one write per event, nothing else: the floor of any relay written in Python."""
    fd = client.fileno()
    for chunk in upstream.chunks():
        os.write(fd, chunk)


# What a child writes per streamed event, untagged (the client's bytes).
CHILD_EVENT = (b"data: {\"id\": \"chatcmpl-d3b47202-5b10-45d6-94a3-2af447450a52\", \"object\": "
               b"\"chat.completion.chunk\", \"model\": \"default_model\", \"created\": 1796157108, "
               b"\"choices\": [{\"index\": 0, \"finish_reason\": null, \"delta\": {\"content\": \" guardian\"}}]}\n\n")


def child_plain_writes(client: socket.socket, upstream, events: int) -> None:
    """The in-process server's part, for comparison: one write per event."""
    for _ in range(events):
        client.sendall(CHILD_EVENT)


def child_handoff_writes(client: socket.socket, upstream, events: int) -> None:
    """A handed-off child's part: each event's tokens checked against its text and tagged
    (guardian.relay_protocol), the tag and event journaled, the event written (guardian.handoff)."""
    import struct

    from guardian import handoff
    from guardian.relay_protocol import TokenTaggingOutput

    journal = handoff._anonymous_file()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
    os.write(journal, struct.pack("<Q", len(request)) + request)
    other_end, control = os.pipe()  # the supervisor's end, the child's
    received = handoff.Received(client, journal, control)
    received.write(client, b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nX-Guardian-Continuable: 1\r\n\r\n")
    # As guardian.serving.connection.HandedOffConnection.write_tagged gives it.
    output = TokenTaggingOutput(io.BytesIO(), functools.partial(received.write_tagged, client))
    for token in range(events):
        output.consumed(token, " guardian")
        output.write(CHILD_EVENT)
    received.finish()
    os.close(other_end)


CHILD_LOOPS = (child_plain_writes, child_handoff_writes)


def per_event(events: int, gap_s: float, repeats: int) -> dict:
    """The relaying thread's CPU per event, for each loop, ``repeats`` times alternately."""
    from guardian.supervise.upstream import Upstream

    child = subprocess.Popen([sys.executable, "-c", PACED_CHILD, str(events), str(gap_s)],
                             stdout=subprocess.PIPE, text=True)
    listener = socket.create_server(("127.0.0.1", 0))
    client = subprocess.Popen([sys.executable, "-c", READING_CLIENT, str(listener.getsockname()[1])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    loops = {"relay_events": relay_events_loop, "relay_events, its work timed": relay_events_timed,
             "bare read + write": bare_loop,
             "the child's write, in process": child_plain_writes,
             "the child's write, handed off (tag + journal)": child_handoff_writes}
    cpu_us = {name: [] for name in loops}
    work_us = []
    try:
        child_port = int(child.stdout.readline())
        for _ in range(repeats):
            for name, loop in loops.items():
                client.stdin.write("go\n")
                client.stdin.flush()
                conn, _ = listener.accept()
                client.stdout.readline()
                conn.settimeout(CLIENT_SEND_TIMEOUT_S)
                relaying = loop not in CHILD_LOOPS  # the stand-in child is for relays only
                upstream = Upstream(child_port, "POST", "/v1/chat/completions", [], b"{}") if relaying else None
                started = time.thread_time()
                work_us += loop(conn, upstream, events) or []
                cpu_us[name].append(1e6 * (time.thread_time() - started) / events)
                if upstream is not None:
                    upstream.close()
                conn.close()
                client.stdout.readline()
    finally:
        child.kill()
        client.kill()
        listener.close()
    return {"events": events, "gap_s": gap_s, "repeats": repeats, "cpu_us_per_event": cpu_us,
            "relay_work_us_per_event": statistics.median(work_us) if work_us else None}


def per_event_report(data: dict) -> str:
    lines = [
        f"Relay CPU per event, {data['when']}: {data['environment']}; {data['events']} events a stream, "
        f"one every {data['gap_s'] * 1e3:g} ms (plus the write), {data['repeats']} streams per loop, alternating.",
        "",
        "| loop | the thread's CPU per event (median) | min–max |",
        "|---|---|---|",
    ]
    for name, values in data["cpu_us_per_event"].items():
        lines.append(f"| {name} | **{statistics.median(values):.1f} µs** | {min(values):.1f}–{max(values):.1f} |")
    if data["relay_work_us_per_event"] is not None:
        lines += ["", f"relay_events' own work, from a read's return to its write (median over every event): "
                      f"**{data['relay_work_us_per_event']:.1f} µs**; the rest is the thread's wake-up, the read "
                      f"and the write."]
    return "\n".join(lines)


def demo_model() -> Path:
    from guardian.demo_model import ensure_demo_model

    return ensure_demo_model()


def model_size(text: str) -> tuple[int, int]:
    hidden, _, layers = text.partition(",")
    if not (hidden.isdigit() and layers.isdigit() and int(hidden) % 64 == 0):
        raise argparse.ArgumentTypeError("HIDDEN,LAYERS: two numbers, HIDDEN a multiple of 64")
    return int(hidden), int(layers)


def sized_model(hidden: int, layers: int) -> Path:
    """The demo model's tokenizer and architecture at another size, its weights random
    (seed 1): each token costs the engine what a real model of that shape's would,
    where the demo model's cost ~0.4 ms of CPU, mostly per-step overhead. Made once
    into the guardian's cache; nothing is downloaded."""
    from guardian.demo_model import default_cache_dir, write_demo_model

    path = default_cache_dir() / f"relay-cost-model-{hidden}x{layers}"
    heads = hidden // 64
    # Grouped-query attention, a third as many KV heads or fewer: a divisor of the heads.
    kv_heads = max(d for d in range(1, max(1, heads // 3) + 1) if heads % d == 0)
    if not made_with(path, kv_heads):  # never made, or made before the KV heads divided the heads
        shutil.rmtree(path, ignore_errors=True)
        write_demo_model(path, seed=1, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=64)
    return path


def made_with(path: Path, kv_heads: int) -> bool:
    """Whether ``path`` holds a model of these KV heads (write_demo_model writes a folder whole)."""
    try:
        return json.loads((path / "config.json").read_text()).get("num_key_value_heads") == kv_heads
    except (OSError, ValueError):
        return False


def model_description(model: Path) -> dict:
    config = json.loads((model / "config.json").read_text())
    return {"name": model.name, **{key: config.get(key) for key in
                                   ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")}}


def serve_epoch(model, kinds: tuple, split, args) -> dict:
    """Start ``kinds`` (in that order), warm them up, measure ``args.rounds`` rounds, stop them."""
    with tempfile.TemporaryDirectory(prefix="bench-relay-cost-") as workdir:
        servers = start_servers(model, Path(workdir), split[0] if split else None, kinds)
        try:
            # Load the weights, warm the caches and the pools, with prompts the size of those
            # measured (on a GPU a new shape compiles kernels: a round 1 at a quarter of the pace).
            for server in servers.values():
                for mode in args.modes:
                    burst(server, [f"Warm-up {i}. " + SENTENCE * 4 for i in range(args.clients)], args.clients,
                          args.max_tokens, stream=mode == "stream")
            return measure(servers, args.rounds, args.requests, args.clients, args.max_tokens,
                           args.modes, args.steady, args.varied)
        finally:
            for server in servers.values():
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48, help="requests in a burst")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steady", type=float, default=0.0, metavar="S",
                        help="measure S seconds of continuous load per server and round, instead of bursts")
    parser.add_argument("--no-pin", action="store_true", help="let servers and clients share every CPU")
    parser.add_argument("--no-relay", action="store_true",
                        help="leave out supervise-relay: the hand-off against in-process alone, each round in 2/3 of the time")
    parser.add_argument("--varied", action="store_true",
                        help="--steady: each request's max_tokens drawn from 1/4 to 7/4 of --max-tokens")
    parser.add_argument("--stock", action="store_true",
                        help="stock mlx_lm.server in the same rounds: what the in-process guardian costs against it")
    parser.add_argument("--epochs", type=int, default=1,
                        help="start fresh servers this many times (in alternating order), --rounds each")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="streamed requests, or not, or both")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--per-event", action="store_true",
                        help="the relay's CPU per streamed event, against a stand-in child (no engine)")
    parser.add_argument("--events", type=int, default=2000, help="--per-event: events a stream")
    parser.add_argument("--repeats", type=int, default=5, help="--per-event: streams per loop")
    parser.add_argument("--sized", metavar="HIDDEN,LAYERS", type=model_size,
                        help="serve a random-weight Llama of this width and depth, made offline, "
                             "instead of the demo model (256,4: ~3 ms of CPU a token on this 2-core machine)")
    args = parser.parse_args()

    if args.per_event:
        data = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "environment": environment(),
                **per_event(args.events, 0.0005, args.repeats)}
        print(json.dumps(data, indent=2) if args.json else per_event_report(data))
        return

    model = sized_model(*args.sized) if args.sized else demo_model()
    started = time.monotonic()
    split = None if args.no_pin else cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])  # the clients' threads inherit it
    data = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "environment": environment(),
            "rounds": args.rounds, "clients": args.clients, "requests": args.requests,
            "max_tokens": args.max_tokens, "varied": args.varied, "steady_s": args.steady,
            "model": model_description(model),
            "pinning": {"servers": sorted(split[0]), "client": sorted(split[1])} if split else None}
    kinds = (KINDS[:2] if args.no_relay else KINDS) + ((STOCK,) if args.stock else ())
    data["results"], data["epochs"] = {}, []
    for epoch in range(args.epochs):
        # Each epoch's servers are fresh processes, started in the other order than the
        # last's: what one process's start or memory owes to chance is not in every round.
        order = kinds if epoch % 2 == 0 else kinds[::-1]
        results = serve_epoch(model, order, split, args)
        for mode, by_kind in results.items():
            for kind, runs in by_kind.items():
                data["results"].setdefault(mode, {k: [] for k in kinds})[kind] += runs
        data["epochs"].append({"started": list(order), "summary": summarize(results)})
    data["summary"] = summarize(data["results"])
    data["wall_s"] = time.monotonic() - started
    print(json.dumps(data, indent=2) if args.json else report(data))


if __name__ == "__main__":
    main()

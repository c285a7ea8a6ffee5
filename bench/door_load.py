"""What the door holds under a flood of idle and slow connections: stock, the guardian, --supervise.

For each server, one after the other in one run, on the same demo model, three
phases of ``--seconds`` each, sampled all through (a ``/health`` GET and a
streaming request's time to first token, ten times a second):

1. unloaded;
2. twin flooded: an attacker holds ``--connections`` connections (10,000 by
   default) open to a second server of the same kind on the same machine,
   not to this one;
3. held: the same attacker, on this server.

The attacker runs in a process of its own. Half its connections send
nothing, half send half a request line and then a byte every second; each
connection the server closes is opened again at once, so the pressure lasts
the whole phase (and a server's timeouts come in waves: sampling all through a
phase meets them as often as they happen, a single burst of samples might not).

Phase 2 is the control. On a small machine the attacker and its twin take CPU
from the measuring client too, so time to first token rises whatever the
server does; "held ÷ twin" is what the door itself costs, "held ÷ unloaded"
what a client sees on this machine.

Targets (issue 22): /health p99 under 50 ms; time to first token within 10 %
of the unloaded run; threads within the handler cap; resident memory growth
under 200 MB. Stock starts a thread per connection that waits for its
headers with no timeout.

    .venv/bin/python bench/door_load.py [--connections 10000] [--seconds 20]

Results: bench/results/door_load.json, .md (the table) and .png (the plot;
needs matplotlib, ``.venv/bin/pip install matplotlib``). Raises its own file
limit (and its servers'), to the hard limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import Server, free_port, poll_until  # noqa: E402
from stats import environment, percentile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLE_EVERY_S = 0.1
UNLOADED_SAMPLES_MIN = 100
BODY = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "stream": True}
COMMANDS = {
    "stock": [sys.executable, "-m", "mlx_lm", "server"],
    "guardian": [sys.executable, "-m", "guardian"],
    "supervise": [sys.executable, "-m", "guardian", "--supervise"],
}


def raise_file_limit() -> int:
    """The soft limit raised as the servers raise theirs (macOS: an unlimited hard limit,
    and a soft one capped by kern.maxfilesperproc)."""
    from guardian.serving.open_files import raise_open_files_limit

    return raise_open_files_limit()


def threads_and_rss(pid: int) -> tuple[int, int]:
    """Threads and resident bytes of a server's whole process tree."""
    threads = rss = 0
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for member in members:
        try:
            threads += member.num_threads()
            rss += member.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return threads, rss


class Peaks:
    """A server tree's most threads and resident memory, sampled as a phase goes."""

    def __init__(self, pid: int):
        self.pid = pid
        self.threads_before, self.rss_before = threads_and_rss(pid)
        self.threads, self.rss = self.threads_before, self.rss_before

    def sample(self) -> None:
        threads, rss = threads_and_rss(self.pid)
        self.threads, self.rss = max(self.threads, threads), max(self.rss, rss)


def time_to_first_token(client: httpx.Client, url: str) -> float | None:
    started = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/chat/completions", json=BODY) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    return first


def measure(url: str, seconds: float, on_sample=None, min_samples: int = 0) -> dict:
    """/health latencies and streaming times to first token, sampled every
    SAMPLE_EVERY_S for ``seconds`` (and at least ``min_samples`` times)."""
    health, ttft, failures = [], [], 0
    # A request that takes this long is a failure, counted: a server that stops
    # answering under the flood must not stall the benchmark for hours.
    with httpx.Client(timeout=5) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or len(ttft) + failures < min_samples:
            next_at = time.monotonic() + SAMPLE_EVERY_S
            started = time.perf_counter()
            try:
                ok = client.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            health.append(time.perf_counter() - started)
            try:
                first = time_to_first_token(client, url)
                if first is not None:
                    ttft.append(first)
                else:
                    failures += 1
            except httpx.HTTPError:
                failures += 1
            failures += not ok
            if on_sample is not None:
                on_sample()
            time.sleep(max(0.0, next_at - time.monotonic()))  # the sampling pace
    return {"health_p50_ms": 1000 * percentile(health, 50), "health_p99_ms": 1000 * percentile(health, 99),
            "ttft_p50_ms": 1000 * percentile(ttft, 50) if ttft else None,
            "ttft_p99_ms": 1000 * percentile(ttft, 99) if ttft else None,
            "samples": len(health), "failures": failures}


class Attacker:
    """Holds ``count`` connections to a port from a process of its own (asyncio):
    half idle, half sending a request line a byte a second; reopens whatever the
    server closes. Its own process: its event loop never takes turns at the
    measuring client's GIL."""

    def __init__(self, port: int, count: int):
        context = multiprocessing.get_context("spawn")
        self._counts = context.Array("q", 3)  # open, reopened, refused
        self._stop = context.Event()
        self._process = context.Process(target=attack, args=(port, count, self._counts, self._stop),
                                        daemon=True)

    open = property(lambda self: self._counts[0])
    reopened = property(lambda self: self._counts[1])
    refused = property(lambda self: self._counts[2])

    def start(self) -> None:
        self._process.start()

    def stop(self) -> None:
        if self._process.pid is None:  # never started
            return
        self._stop.set()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def attack(port: int, count: int, counts, stop) -> None:
    """The attacker process: ``count`` connections until ``stop`` is set."""
    raise_file_limit()

    async def hold(slow: bool) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                counts[2] += 1
                await asyncio.sleep(0.5)
                continue
            counts[0] += 1
            try:
                if slow:
                    for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n":
                        writer.write(bytes([byte]))
                        await writer.drain()
                        if await closed_within(reader, 1.0):
                            break
                else:
                    await reader.read(1)  # returns when the server closes
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                counts[0] -= 1
                writer.close()
            counts[1] += 1

    async def closed_within(reader, seconds: float) -> bool:
        try:
            await asyncio.wait_for(reader.read(1024), seconds)  # an answer (408) or the close
            return True
        except asyncio.TimeoutError:
            return False

    async def main() -> None:
        tasks = [asyncio.create_task(hold(i % 2 == 1)) for i in range(count)]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def start_server(kind: str, model: str, log_path: Path) -> Server:
    port = free_port()
    server = Server(kind, [*COMMANDS[kind], "--model", model, "--port", str(port)], port, log_path,
                    {**os.environ, "HF_HUB_OFFLINE": "1"})
    if not server.wait_ready(120):
        server.stop()
        raise RuntimeError(f"{kind} did not start: {server.log_tail()}")
    return server


def flood(attacker: Attacker, connections: int, on_sample=lambda: None) -> None:
    """Start ``attacker``; return once its connections are open (or 15 s have passed)."""
    attacker.start()
    poll_until(lambda: on_sample() or attacker.open >= connections, 15, interval=0.2)


def run_server(kind: str, model: str, folder: Path, connections: int, seconds: float) -> dict:
    server = start_server(kind, model, folder / f"{kind}.log")
    try:
        measure(server.url, 0, min_samples=10)  # warm: compiled kernels, the prompt cache
        peaks = Peaks(server.proc.pid)
        unloaded = measure(server.url, seconds, min_samples=UNLOADED_SAMPLES_MIN)
        twin = start_server(kind, model, folder / f"{kind}-twin.log")
        twin_attacker = Attacker(twin.port, connections)
        try:
            flood(twin_attacker, connections)
            beside = measure(server.url, seconds)
        finally:
            twin_attacker.stop()
            twin.stop()
        attacker = Attacker(server.port, connections)
        held = [0]

        def on_sample() -> None:
            peaks.sample()
            held.append(attacker.open)

        try:
            flood(attacker, connections, on_sample)
            loaded = measure(server.url, seconds, on_sample) if server.alive() else {"failures": "server died"}
        finally:
            attacker.stop()
        return {"server": kind, "unloaded": unloaded, "twin_flooded": beside, "loaded": loaded,
                "threads_before": peaks.threads_before, "threads_peak": peaks.threads,
                "rss_growth_mb": (peaks.rss - peaks.rss_before) / 2**20,
                "attacker_open_peak": max(held), "attacker_reopened": attacker.reopened,
                "attacker_refused": attacker.refused, "alive": server.alive()}
    finally:
        server.stop()


def table(results: list[dict], connections: int) -> str:
    def ms(phase: dict, key: str) -> str:
        return f"{phase[key]:.1f} ms" if phase.get(key) is not None else "-"

    def failed(phase: dict) -> str:
        # Each sample is a /health GET and a streamed request; a client gives up after 5 s.
        return f"{phase['failures']} of {2 * phase['samples']}" if "samples" in phase else str(phase["failures"])

    def ratio(r: dict, over: str) -> str:
        held, base = r["loaded"].get("ttft_p50_ms"), r[over].get("ttft_p50_ms")
        return f"{held / base:.2f}" if held and base else "-"

    lines = [f"| server | /health p99: unloaded | twin flooded | {connections:,} held "
             "| TTFT p50: unloaded | twin flooded | held | held ÷ twin | held ÷ unloaded "
             "| requests failed, held | threads (peak) | RSS growth | attacker's connections open (peak) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        u, t, l = r["unloaded"], r["twin_flooded"], r["loaded"]
        lines.append(f"| {r['server']} | {ms(u, 'health_p99_ms')} | {ms(t, 'health_p99_ms')} | "
                     f"{ms(l, 'health_p99_ms')} | {ms(u, 'ttft_p50_ms')} | {ms(t, 'ttft_p50_ms')} | "
                     f"{ms(l, 'ttft_p50_ms')} | **{ratio(r, 'twin_flooded')}** | {ratio(r, 'unloaded')} | "
                     f"{failed(l)} | {r['threads_before']} -> {r['threads_peak']} | {r['rss_growth_mb']:.0f} MB | "
                     f"{r['attacker_open_peak']:,} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = [r["server"] for r in results]
    x = range(len(names))
    phases = [("unloaded", "unloaded"), ("twin_flooded", "flood on a twin"), ("loaded", "connections held")]
    for ax, (key, title, log_scale) in zip(axes, [("health_p99_ms", "/health p99 (ms)", True),
                                                  ("ttft_p50_ms", "time to first token, p50 (ms)", False)]):
        for offset, (phase, label) in zip((-0.27, 0, 0.27), phases):
            values = [r[phase].get(key) for r in results]
            ax.bar([i + offset for i in x], [v or 0 for v in values], 0.27, label=label)
            for i, value in enumerate(values):
                if value is None:  # nothing answered within the client's 5 s
                    ax.text(i + offset, 0.5, "none\nin 5 s", ha="center", va="bottom", fontsize=7,
                            transform=ax.get_xaxis_transform())
        if log_scale:
            ax.set_yscale("log")
            ax.axhline(50, color="grey", linestyle="--", linewidth=0.8)
            ax.text(len(names) - 0.5, 50, "target", color="grey", fontsize=7, va="bottom", ha="right")
        ax.set_xticks(list(x), names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[2].bar(names, [r["threads_peak"] for r in results])
    axes[2].set_yscale("log")
    axes[2].set_title("threads (peak, connections held)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(results: list[dict], connections: int, environment_line: str) -> str:
    """The table, the JSON and the plot under bench/results; the table."""
    report = table(results, connections)
    (RESULTS / "door_load.json").write_text(json.dumps(
        {"environment": environment_line, "connections": connections, "results": results}, indent=1))
    (RESULTS / "door_load.md").write_text(f"{environment_line}\n\n{report}\n")
    try:
        plot(results, RESULTS / "door_load.png")
    except ImportError:
        print("matplotlib is not installed: no plot (the older one, which no longer matches the table, removed)")
        (RESULTS / "door_load.png").unlink(missing_ok=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--servers", default="stock,guardian,supervise")
    parser.add_argument("--render", action="store_true",
                        help="only write the table and plot again from bench/results/door_load.json")
    args = parser.parse_args()
    if args.render:
        saved = json.loads((RESULTS / "door_load.json").read_text())
        print(write_results(saved["results"], saved.get("connections", args.connections), saved["environment"]))
        return
    limit = raise_file_limit()
    print(f"file limit {limit}; {environment()}")
    from guardian.demo_model import ensure_demo_model

    model = str(ensure_demo_model())
    RESULTS.mkdir(exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="door-load-"))
    results = []
    for kind in args.servers.split(","):
        print(f"{kind}: {args.connections:,} connections for {args.seconds:g} s (logs in {logs}) ...", flush=True)
        results.append(run_server(kind, model, logs, args.connections, args.seconds))
        print(json.dumps(results[-1]), flush=True)
    print(write_results(results, args.connections, environment()))


if __name__ == "__main__":
    main()

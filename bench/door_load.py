"""What the door holds under a flood of idle and slow connections: stock, the guardian, --supervise.

For each server, one after the other in one run, on the same demo model:

1. unloaded: ``/health`` latency (sequential GETs) and a streaming request's
   time to first token, with the server's threads and resident memory;
2. loaded: the same, while an attacker holds ``--connections`` connections
   open (10,000 by default): half send nothing, half send half a request
   line and then a byte every second. Each connection the server closes is
   opened again at once, so the pressure lasts the whole phase.

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
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import Server, free_port  # noqa: E402
from stats import environment, percentile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HEALTH_SAMPLES = 200
TTFT_SAMPLES = 12
BODY = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "stream": True}


def raise_file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


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


def measure(url: str) -> dict:
    """/health latencies and streaming times to first token."""
    health, ttft, failures = [], [], 0
    # A request that takes this long is a failure, counted: a server that stops
    # answering under the flood must not stall the benchmark for hours.
    with httpx.Client(timeout=5) as client:
        for _ in range(HEALTH_SAMPLES):
            started = time.perf_counter()
            try:
                ok = client.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            health.append(time.perf_counter() - started)
            failures += not ok
            if failures > 10:
                break
        for _ in range(TTFT_SAMPLES):
            started = time.perf_counter()
            try:
                with client.stream("POST", url + "/v1/chat/completions", json=BODY) as response:
                    first = None
                    for line in response.iter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter() - started
                    if first is not None:
                        ttft.append(first)
            except httpx.HTTPError:
                failures += 1
    return {"health_p50_ms": 1000 * percentile(health, 50), "health_p99_ms": 1000 * percentile(health, 99),
            "ttft_p50_ms": 1000 * percentile(ttft, 50) if ttft else None,
            "ttft_p99_ms": 1000 * percentile(ttft, 99) if ttft else None, "failures": failures}


class Attacker:
    """Holds ``count`` connections to a port in its own thread (asyncio): half idle,
    half sending a request line a byte a second; reopens whatever the server closes."""

    def __init__(self, port: int, count: int):
        self.port = port
        self.count = count
        self.open = 0
        self.reopened = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def _main(self) -> None:
        tasks = [asyncio.create_task(self._hold(i % 2 == 1)) for i in range(self.count)]
        while not self._stop.is_set():
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _hold(self, slow: bool) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                self.refused += 1
                await asyncio.sleep(0.5)
                continue
            self.open += 1
            try:
                if slow:
                    for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n":
                        writer.write(bytes([byte]))
                        await writer.drain()
                        if await self._closed_within(reader, 1.0):
                            break
                else:
                    await reader.read(1)  # returns when the server closes
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                self.open -= 1
                writer.close()
            self.reopened += 1

    @staticmethod
    async def _closed_within(reader, seconds: float) -> bool:
        try:
            await asyncio.wait_for(reader.read(1024), seconds)  # an answer (408) or the close
            return True
        except asyncio.TimeoutError:
            return False


def run_server(kind: str, model: str, folder: Path, connections: int, seconds: float) -> dict:
    port = free_port()
    commands = {
        "stock": [sys.executable, "-m", "mlx_lm", "server", "--model", model],
        "guardian": [sys.executable, "-m", "guardian", "--model", model],
        "supervise": [sys.executable, "-m", "guardian", "--supervise", "--model", model],
    }
    server = Server(kind, [*commands[kind], "--port", str(port)], port, folder / f"{kind}.log",
                    {**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        if not server.wait_ready(120):
            raise RuntimeError(f"{kind} did not start: {server.log_tail()}")
        measure(server.url)  # warm: compiled kernels, the prompt cache
        threads_before, rss_before = threads_and_rss(server.proc.pid)
        unloaded = measure(server.url)
        attacker = Attacker(port, connections)
        attacker.start()
        deadline = time.monotonic() + seconds
        peak_threads, peak_rss, held = threads_before, rss_before, 0
        while time.monotonic() < deadline:
            threads, rss = threads_and_rss(server.proc.pid)
            peak_threads, peak_rss, held = max(peak_threads, threads), max(peak_rss, rss), max(held, attacker.open)
            time.sleep(0.5)
        loaded = measure(server.url) if server.alive() else {"failures": "server died"}
        threads, rss = threads_and_rss(server.proc.pid)
        peak_threads, peak_rss = max(peak_threads, threads), max(peak_rss, rss)
        attacker.stop()
        return {"server": kind, "unloaded": unloaded, "loaded": loaded, "threads_before": threads_before,
                "threads_peak": peak_threads, "rss_growth_mb": (peak_rss - rss_before) / 2**20,
                "attacker_open_peak": held, "attacker_reopened": attacker.reopened,
                "attacker_refused": attacker.refused, "alive": server.alive()}
    finally:
        server.stop()


def table(results: list[dict], connections: int) -> str:
    def ms(phase: dict, key: str) -> str:
        return f"{phase[key]:.1f} ms" if phase.get(key) is not None else "-"

    lines = [f"| server | /health p99 unloaded | /health p99, {connections:,} held | TTFT p50 unloaded "
             "| TTFT p50 held | TTFT ratio | threads (peak) | RSS growth | attacker's connections open (peak) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        u, l = r["unloaded"], r["loaded"]
        ratio = f"{l['ttft_p50_ms'] / u['ttft_p50_ms']:.2f}" if l.get("ttft_p50_ms") and u.get("ttft_p50_ms") else "-"
        lines.append(f"| {r['server']} | {ms(u, 'health_p99_ms')} | {ms(l, 'health_p99_ms')} | "
                     f"{ms(u, 'ttft_p50_ms')} | {ms(l, 'ttft_p50_ms')} | {ratio} | "
                     f"{r['threads_before']} -> {r['threads_peak']} | {r['rss_growth_mb']:.0f} MB | "
                     f"{r['attacker_open_peak']:,} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    names = [r["server"] for r in results]
    for ax, (key, title) in zip(axes, [("health_p99_ms", "/health p99 (ms)"), ("ttft_p50_ms", "TTFT p50 (ms)")]):
        unloaded = [r["unloaded"].get(key) or 0 for r in results]
        loaded = [r["loaded"].get(key) or 0 for r in results]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], unloaded, 0.4, label="unloaded")
        ax.bar([i + 0.2 for i in x], loaded, 0.4, label="connections held")
        ax.set_xticks(list(x), names)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend()
    axes[2].bar(names, [r["threads_peak"] for r in results])
    axes[2].set_yscale("log")
    axes[2].set_title("threads (peak)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--servers", default="stock,guardian,supervise")
    args = parser.parse_args()
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
    report = table(results, args.connections)
    print(report)
    (RESULTS / "door_load.json").write_text(json.dumps({"environment": environment(), "results": results}, indent=1))
    (RESULTS / "door_load.md").write_text(f"{environment()}\n\n{report}\n")
    try:
        plot(results, RESULTS / "door_load.png")
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()

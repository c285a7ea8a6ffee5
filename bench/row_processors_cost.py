"""What keeping 0.31's logits processors in step with the batch rows costs.

On mlx-lm 0.31 the guardian gives each request a truthy list of logits
processors (``AlwaysTruthyProcessors`` in guardian/stock/sampling.py), so stock's
``GenerationBatch.filter`` keeps the list in step with the rows; as a side
effect stock steps each row's (empty) processors separately. This runs two
guardians side by side, one as shipped and one with plain lists (stock's
behaviour, and its bug), each pinned to one CPU, and prints tokens/s for 8
concurrent clients in rounds of alternating order, and the ratio.

    .venv-0313/bin/python bench/row_processors_cost.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from servers import Server, free_port

REPO = Path(__file__).resolve().parent.parent
CLIENTS = 8
MAX_TOKENS = 150

# The guardian's command with ROW_PROCESSORS swapped back to stock's plain lists.
# (Set where it is read, guardian.stock.sampling: set on guardian.stock it changed nothing,
# and the two servers were the same.)
PLAIN_LISTS = ("import sys, guardian.stock.sampling as sampling\n"
               "sampling.ROW_PROCESSORS = list\n"
               "assert sampling.ROW_PROCESSORS is list\n"
               "sys.argv = ['mlx-guardian', *sys.argv[1:]]\n"
               "from guardian.cli import main\nmain()\n")


def start(kind: str, folder: Path, cpu: int) -> Server:
    port = free_port()
    args = ["--port", str(port)]
    if kind == "truthy lists (shipped)":
        command = [sys.executable, "-m", "guardian", *args]
    else:
        command = [sys.executable, "-c", PLAIN_LISTS, *args]
    server = Server(kind, command, port, folder / f"{port}.log", dict(os.environ), cpus={cpu})
    if not server.wait_ready(120):
        raise SystemExit(f"{kind} did not start:\n" + "\n".join(server.log_tail()))
    return server


def tokens_per_second(server: Server) -> float:
    def one(i: int) -> int:
        body = {"messages": [{"role": "user", "content": f"Tell story {i}."}],
                "max_tokens": MAX_TOKENS, "temperature": 0.0}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        return response.json()["usage"]["completion_tokens"]

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        tokens = sum(pool.map(one, range(CLIENTS)))
    return tokens / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="row-processors-"))
    servers = [start("truthy lists (shipped)", folder, 0), start("plain lists (stock)", folder, 0)]
    if hasattr(os, "sched_setaffinity"):  # Linux: the clients off the first CPU; macOS pins nothing
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - {0} or {0})
    results = {server.kind: [] for server in servers}
    try:
        for round_ in range(options.rounds):
            for server in servers if round_ % 2 == 0 else servers[::-1]:
                results[server.kind].append(tokens_per_second(server))
    finally:
        for server in servers:
            server.stop()
    print(f"| {CLIENTS} clients, {MAX_TOKENS} tokens each | tokens/s per round | median |")
    print("|---|---|---|")
    for kind, values in results.items():
        print(f"| {kind} | {', '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.0f} |")
    shipped, plain = (statistics.median(v) for v in results.values())
    print(f"\nshipped / plain: {shipped / plain:.3f}")


if __name__ == "__main__":
    main()

"""Where a throughput difference comes from: CPU per token, engine steps, batch sizes.

Runs two servers (default: mlx-guardian with and without the prompt guard)
pinned to one CPU, the client on the others, through the same rounds of
concurrent streaming requests as bench/bench_prompt_guard.py, each server
under bench/profiled_server.py. For each server it reports tokens/s, the CPU
time per generated token split by thread (the generation loop; the HTTP
threads, which end with their requests, together with mlx's own threads),
the ``BatchGenerator`` steps taken and time spent in them, and how many
tokens each step generated.

Usage::

    python bench/engine_profile.py                      # guardian vs unguarded, ~3 min
    python bench/engine_profile.py --pair guardian,stock
    python bench/engine_profile.py --rounds 12 --clients 8 --requests 48

A pinned server is CPU-bound only while it has work: equal CPU per token
and equal steps with unequal tokens/s mean the difference is idle time. The
client's CPU share says whether the client, not the server, sets the pace.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_prompt_guard import LABELS, SENTENCE, burst_prompts, run_load, start_servers
from servers import cpu_split, poll_until

PROFILED_SERVER = Path(__file__).resolve().parent / "profiled_server.py"


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of ``pid``."""
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        cpu[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return cpu


def engine_counts(server, out_path: Path) -> dict:
    out_path.unlink(missing_ok=True)
    os.kill(server.proc.pid, signal.SIGUSR1)
    if not poll_until(out_path.exists, 10):
        raise SystemExit(f"{server.kind} wrote no counts")
    return json.loads(out_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="guardian,unguarded", help="two of: " + ", ".join(LABELS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48, help="requests per burst")
    args = parser.parse_args()
    kinds = tuple(args.pair.split(","))
    if len(kinds) != 2 or not set(kinds) <= set(LABELS):
        parser.error(f"--pair takes two of {', '.join(LABELS)}")
    split = cpu_split()
    if split is None:
        raise SystemExit("needs Linux with 2+ CPUs: the servers are pinned to one")
    server_cpus, client_cpus = split
    os.sched_setaffinity(0, client_cpus)

    from guardian.demo_model import ensure_demo_model

    model = ensure_demo_model()
    with tempfile.TemporaryDirectory(prefix="engine-profile-") as workdir:
        workdir = Path(workdir)
        counts_path = {kind: workdir / f"{kind}-counts.json" for kind in kinds}
        servers = start_servers(model, workdir, kinds, server_cpus,
                                launcher=lambda kind: [str(PROFILED_SERVER), str(counts_path[kind])])
        try:
            for server in servers.values():
                run_load(server.url, [f"Warm-up {i}. " + SENTENCE for i in range(8)], 8)
                os.kill(server.proc.pid, signal.SIGUSR2)  # count from here
            tokens = {kind: 0 for kind in kinds}
            rates = {kind: [] for kind in kinds}
            cpu = {kind: {} for kind in kinds}
            client_cpu = {kind: 0.0 for kind in kinds}
            wall = {kind: 0.0 for kind in kinds}
            for round_index in range(args.rounds):
                prompts = burst_prompts(1 + round_index * args.requests, args.requests)
                for kind in kinds if round_index % 2 == 0 else kinds[::-1]:
                    pid = servers[kind].proc.pid
                    before, client_before = thread_cpu_s(pid), time.process_time()
                    load = run_load(servers[kind].url, prompts, args.clients)
                    after = thread_cpu_s(pid)
                    client_cpu[kind] += time.process_time() - client_before
                    wall[kind] += load["wall_s"]
                    tokens[kind] += load["tokens"]
                    rates[kind].append(load["tokens_per_s"])
                    for tid, seconds in after.items():
                        cpu[kind][tid] = cpu[kind].get(tid, 0.0) + seconds - before.get(tid, 0.0)
            counts = {kind: engine_counts(servers[kind], counts_path[kind]) for kind in kinds}
        finally:
            for server in servers.values():
                server.stop()

    ratios = [a / b for a, b in zip(rates[kinds[0]], rates[kinds[1]])]
    print(f"{args.rounds} rounds x {args.requests} requests, {args.clients} clients; servers on CPU "
          f"{sorted(server_cpus)}, client on {sorted(client_cpus)}")
    print(f"tokens/s {LABELS[kinds[0]]} / {LABELS[kinds[1]]}: geometric mean "
          f"{statistics.geometric_mean(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    for kind in kinds:
        n = tokens[kind]
        names = {int(tid): name for tid, name in counts[kind]["threads"].items()}
        by_thread: dict[str, float] = {}
        for tid, seconds in cpu[kind].items():
            name = names.get(tid, "ended threads (HTTP) and mlx's own")
            if "_run_generate" in name or name == "generation":
                name = "generation loop"
            by_thread[name] = by_thread.get(name, 0.0) + seconds
        sizes = {int(size): steps for size, steps in counts[kind]["batch_sizes"].items()}
        print(f"\n{LABELS[kind]}: {statistics.fmean(rates[kind]):.0f} tokens/s, {n} tokens")
        server_cpu = sum(by_thread.values())
        print(f"  CPU per token: {1000 * server_cpu / n:.4f} ms; the server's CPU busy "
              f"{100 * server_cpu / wall[kind]:.0f} % of the time, the client's "
              f"{100 * client_cpu[kind] / wall[kind]:.0f} %")
        for name, seconds in sorted(by_thread.items(), key=lambda item: -item[1]):
            if seconds > 0:
                print(f"    {name}: {1000 * seconds / n:.4f} ms")
        print(f"  engine steps: {counts[kind]['steps']} ({counts[kind]['step_s']:.2f} s in them), "
              f"{counts[kind]['prefill_steps']} of them prefilling")
        print("  steps by tokens generated: " + ", ".join(f"{size}: {steps}" for size, steps in sorted(sizes.items())))


if __name__ == "__main__":
    sys.exit(main())

"""Did a change make serving faster or slower? Two trees of the guardian, side by side in one run.

Two runs of ``relay_cost.py`` an hour apart differ by more than each run's
interval says (on this 2-core machine: 0.954 ± 0.013 and 0.970 ± 0.011 for
two trees whose own comparison by this script reads 1.011 ± 0.017): the machine's
pace drifts. So a change is measured against its parent in one run: each
tree serves the demo model from a checkout of its own (``git worktree add``;
the server imports the guardian from it, ahead of the installed one), both
started the same way and pinned to the same CPU, and rounds of steady
streaming load alternate between them (``relay_cost.steady``). The figure is
the new tree's tokens/s over the old one's, mean ± 95 % over rounds, and
the CPU each spends per token (the supervisor and its child, with
``--supervise``), old over new round by round. The same tree on both sides
reads 1.002 ± 0.017 (``results/compare-trees-aa-*.json``): the method's
floor.

    git worktree add /tmp/parent HEAD~1
    .venv/bin/python bench/compare_trees.py --old /tmp/parent --new . --supervise   # ~8 min

It is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from relay_cost import ci95, cpu_per_token, demo_model, model_size, server_env, sized_model, start_server, steady
from servers import cpu_split
from stats import environment

TREES = ("old", "new")


def tree_revision(tree: Path) -> str:
    """The tree's commit, and whether files differ from it (a plain name where it is not a checkout)."""
    try:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(tree)
    return commit + (" with changes" if dirty else "")


def engine_and_supervisor_cpu(window: dict, supervised: bool) -> float:
    """A window's CPU seconds: the server's, plus its child's under a supervisor."""
    return window["process_cpu_s"] + (window["engine_cpu_s"] if supervised else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the tree before the change (a checkout)")
    parser.add_argument("--new", type=Path, required=True, help="the tree with it")
    parser.add_argument("--supervise", action="store_true", help="serve each under --supervise")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sized", metavar="HIDDEN,LAYERS", type=model_size)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for name, tree in trees.items():
        if not (tree / "guardian" / "__init__.py").exists():
            raise SystemExit(f"--{name} {tree}: no guardian package there")
    model = sized_model(*args.sized) if args.sized else demo_model()
    split = cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])  # the clients' threads inherit it
    command = [sys.executable, "-m", "guardian", *(["--supervise"] if args.supervise else []),
               "--model", str(model), "--host", "127.0.0.1"]
    windows = {name: [] for name in TREES}
    with tempfile.TemporaryDirectory(prefix="bench-compare-trees-") as workdir:
        # The kind names the role relay_cost's CPU window reads: a supervisor's child counts.
        kind = "supervise" if args.supervise else "in-process"
        servers = {}
        try:
            for name in TREES:
                folder = Path(workdir) / name  # each its own log
                folder.mkdir()
                servers[name] = start_server(kind, command, folder, server_env(PYTHONPATH=str(trees[name])),
                                             split[0] if split else None)
            for round_index in range(args.rounds):
                order = TREES if round_index % 2 == 0 else TREES[::-1]
                for name in order:
                    serial = 100_000 * round_index + (50_000 if name == "new" else 0)
                    windows[name].append(steady(servers[name], serial, args.clients, args.max_tokens, True,
                                                args.seconds))
                print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{name} {windows[name][-1]['tokens_per_s']:.0f} tok/s" for name in TREES),
                    file=sys.stderr, flush=True)
        finally:
            for server in servers.values():
                server.stop()
    ratios = [new["tokens_per_s"] / old["tokens_per_s"] for old, new in zip(windows["old"], windows["new"])]
    for runs in windows.values():
        for window in runs:
            window["server_cpu_s"] = engine_and_supervisor_cpu(window, args.supervise)
    # Old ÷ new CPU per token, round by round: above 1, the new tree spends less.
    cpu_ratios = [(old["server_cpu_s"] / old["tokens"]) / (new["server_cpu_s"] / new["tokens"])
                  for old, new in zip(windows["old"], windows["new"])]
    data = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "environment": environment(),
            "model": model.name, "supervise": args.supervise, "rounds": args.rounds, "seconds": args.seconds,
            "clients": args.clients, "max_tokens": args.max_tokens,
            "pinning": {"servers": sorted(split[0]), "clients": sorted(split[1])} if split else None,
            "trees": {name: tree_revision(tree) for name, tree in trees.items()},
            "ratio_mean": statistics.mean(ratios), "ratio_ci95": ci95(ratios), "ratio_median": statistics.median(ratios),
            "cpu_us_per_token": {name: 1e6 * cpu_per_token(windows[name], "server_cpu_s") for name in TREES},
            "cpu_ratio_mean": statistics.mean(cpu_ratios), "cpu_ratio_ci95": ci95(cpu_ratios),
            "windows": windows}
    print(json.dumps(data, indent=2) if args.json else report(data))


def report(data: dict) -> str:
    pinned = (f"servers pinned to CPU {data['pinning']['servers']}, clients on {data['pinning']['clients']}"
              if data["pinning"] else "unpinned")
    mode = "--supervise" if data["supervise"] else "in process"
    cpu = data["cpu_us_per_token"]
    return "\n".join([
        f"Trees compared, {data['when']}: {data['environment']}; {data['model']}, {mode}; {data['clients']} "
        f"streaming clients, max_tokens={data['max_tokens']}, {data['rounds']} rounds of {data['seconds']:g} s "
        f"alternating; {pinned}.", "",
        "| old | new | new ÷ old tokens/s, mean ± 95 % | median | CPU per token, old → new | old ÷ new, mean ± 95 % |",
        "|---|---|---|---|---|---|",
        f"| {data['trees']['old']} | {data['trees']['new']} | **{data['ratio_mean']:.3f} ± {data['ratio_ci95']:.3f}** "
        f"| {data['ratio_median']:.3f} | {cpu['old']:.1f} → {cpu['new']:.1f} µs "
        f"| {cpu_ratio(data)} |",
    ])


def cpu_ratio(data: dict) -> str:
    """Old ÷ new CPU per token over rounds (results saved before it was kept: from their windows)."""
    if "cpu_ratio_mean" in data:
        return f"{data['cpu_ratio_mean']:.3f} ± {data['cpu_ratio_ci95']:.3f}"
    return ""


if __name__ == "__main__":
    main()

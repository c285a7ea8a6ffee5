"""What a supervised child's token tags cost on their own, without a supervisor.

Under ``--supervise`` the child tags every streamed event with its tokens
(guardian.relay_protocol) and journals it (guardian.handoff); the supervisor
accepts, reads and hands off each request. ``relay_cost.py`` measures all of
it together. This splits off the first part: two in-process guardians serve
the demo model, one plain and one started with a relay key in its
environment, whose clients send that key, so it tags their streams exactly
as a child does, and writes the tags to the client (no journal, no
supervisor). Both are pinned to one CPU (the clients get the others), and
rounds of ``--seconds`` of continuous streaming load alternate between them.

``--hand-off`` adds a third, "handed-off": the tagging server, which hands
each request to itself through guardian.handoff (``self_handoff_hooks``):
the hand-off's whole work on both sides, in one process, with no supervisor
and none of its scheduling. Against ``relay_cost.py``'s figure for
``--supervise`` it says what a second process costs beyond that work.

``--child-side`` adds a fourth, "child-side": the tagging server doing only
what a child that accepted its own connections would do per request, with a
supervisor that costs nothing (``self_handoff_hooks``): its own journal and
control pipe, one message to a channel drained every 64 requests, the tags,
the journal records and the word. It says what the child's part of the
hand-off costs, and so how far moving the accepting into the child could go.

    .venv/bin/python bench/tagging_cost.py --rounds 40     # ~14 min
    .venv/bin/python bench/tagging_cost.py --rounds 16 --seconds 6 --hand-off   # ~8 min
    .venv/bin/python bench/tagging_cost.py --rounds 16 --seconds 6 --hand-off --child-side   # ~10 min

The figures are each server's tokens/s ÷ the plain one's, and the plain
one's CPU per token ÷ each one's, mean ± 95 % over rounds. It is a benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from relay_cost import ci95, cpu_per_token, demo_model, server_env, start_server, steady
from servers import cpu_split
from stats import environment

from guardian import handoff
from guardian.relay_protocol import KEY_HEADER, RELAY_KEY_ENV, new_relay_key


HOOKS = Path(__file__).with_name("self_handoff_hooks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hand-off", action="store_true", help="add a server that hands each request to itself")
    parser.add_argument("--child-side", action="store_true",
                        help="add a server doing only a child's part of each hand-off")
    args = parser.parse_args()
    if (args.hand_off or args.child_side) and not handoff.supported():
        # There a server serves every request itself (no hand-off), so the row would time the
        # plain server under another name; and a journal past its first mapping cannot grow (no mremap).
        parser.error("--hand-off and --child-side time the hand-off, which this platform does not do (Linux only)")

    model = demo_model()
    split = cpu_split()
    if split is not None:
        os.sched_setaffinity(0, split[1])
    key = new_relay_key()
    command = [sys.executable, "-m", "guardian", "--model", str(model), "--host", "127.0.0.1"]
    tagging = {RELAY_KEY_ENV: key}
    kinds = {"plain": (server_env(), {}), "tagged": (server_env(**tagging), {KEY_HEADER: key})}
    hooked = os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))
    if args.hand_off:
        kinds["handed-off"] = (server_env(**tagging, GUARDIAN_BENCH_SELF_HANDOFF="1", PYTHONPATH=hooked),
                               {KEY_HEADER: key})
    if args.child_side:
        kinds["child-side"] = (server_env(**tagging, GUARDIAN_BENCH_CHILD_SIDE="1", PYTHONPATH=hooked),
                               {KEY_HEADER: key})
    measured = [kind for kind in kinds if kind != "plain"]
    ratios = {kind: [] for kind in measured}
    cpu_ratios = {kind: [] for kind in measured}
    with tempfile.TemporaryDirectory(prefix="bench-tagging-cost-") as workdir:
        servers = {}
        try:
            for kind, (env, _) in kinds.items():
                servers[kind] = start_server(kind, command, Path(workdir), env, split[0] if split else None)
            for kind, server in servers.items():  # weights loaded, caches warm
                steady(server, 0, args.clients, args.max_tokens, True, 3.0, headers=kinds[kind][1])
            for round_index in range(args.rounds):
                order = list(kinds) if round_index % 2 == 0 else list(kinds)[::-1]
                serial = 100_000 * (round_index + 1)  # prompts of their own: no prompt-cache hits
                got = {kind: steady(servers[kind], serial, args.clients, args.max_tokens, True, args.seconds,
                                    headers=kinds[kind][1]) for kind in order}
                for kind in measured:
                    ratios[kind].append(got[kind]["tokens_per_s"] / got["plain"]["tokens_per_s"])
                    cpu_ratios[kind].append(cpu_per_token([got["plain"]], "engine_cpu_s")
                                            / cpu_per_token([got[kind]], "engine_cpu_s"))
                print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{kind} {got[kind]['tokens_per_s']:.0f} tok/s" for kind in kinds), file=sys.stderr, flush=True)
        finally:
            for server in servers.values():
                server.stop()
    pinned = f"servers pinned to CPU {sorted(split[0])}" if split else "unpinned"
    print(f"Tagging cost, {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}: {environment()}; demo model; "
          f"{args.clients} looping streaming clients, max_tokens={args.max_tokens}, {args.rounds} rounds of "
          f"{args.seconds:g} s alternating; {pinned}.\n")
    print("| ÷ plain | mean ± 95 % | median | rounds min–max |\n|---|---|---|---|")
    for kind in measured:
        for name, values in ((f"{kind}: tokens/s", ratios[kind]),
                             (f"{kind}: CPU per token (plain ÷ {kind})", cpu_ratios[kind])):
            print(f"| {name} | **{statistics.fmean(values):.3f} ± {ci95(values):.3f}** | "
                  f"{statistics.median(values):.3f} | {min(values):.3f}–{max(values):.3f} |")


if __name__ == "__main__":
    main()

"""What a stream continuation costs its client: the gap at the seam.

A stream is cut by an engine failure planted at its Nth token
(tests/plugins/token_faults.py) and continued on the restarted engine,
which prefills the prompt plus the tokens already sent before it samples
the next one. The client sees a longer gap between two chunks at the seam.
This compares that gap with stock's prompt cache (the default) and without
it (``--prompt-cache-size 0``), for a chat whose long system prompt stock
caches at the end of its segment (so do the user messages of a chat), and
for a text completion, a single segment that stock caches only once the
request ends; it prints a table.

The fault falls between two steps, where the failed batch's KV caches are kept for
the re-run (guardian/engine/kept_kv.py, since 2026-12-02): the continuation prefills
one token whether the prompt cache is on or off, and the rows agree (7 ms at the seam).
What the "off" row measured before, 538-612 ms for ~1,250 tokens, is what a failure
inside a step (nothing kept) costs without the prompt cache
(bench/results/continuation_cost.md).

Note: after a stall (not a failure) the engine drops the prompt cache on
purpose (the stuck loop's arrays cannot be used on a new thread), so a
continuation after a stall always pays the "without" column.

    .venv/bin/python bench/continuation_cost.py [--rounds 8] [--system-words 600]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from servers import Server, free_port

REPO = Path(__file__).resolve().parent.parent
MARKER = 2  # top_logprobs of the requests the fault is planted in
SEAM = 20  # the engine fails while stock formats a request's 20th token


def config_text() -> str:
    return (
        '[guardian]\nplugins = ["tests.plugins.token_faults:TokenFaults"]\n'
        f"[token_faults]\nmarker_top_logprobs = {MARKER}\nfail_at_token = {SEAM}\ntimes = 0\n"
        # One failure per round: no crash loop, no reload.
        "[recovery]\nmax_failures = 1000\nreload_after_failures = 0\n"
    )


def stream_chunks(url: str, body: dict) -> tuple[list[float], bool, int]:
    """Arrival times of the stream's content chunks, whether it ended cleanly (no
    error event, [DONE]), completion tokens."""
    times, clean, tokens, done = [], True, 0, False
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as response:
        for line in response.iter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                clean = False
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") or c.get("text") for c in event.get("choices", [])):
                times.append(time.monotonic())
    return times, clean and done, tokens


def measure(prompt_cache: bool, in_system: bool, rounds: int, system_words: int, log_dir: Path) -> dict:
    config = log_dir / f"guardian-{prompt_cache}-{in_system}.toml"
    config.write_text(config_text())
    port = free_port()
    args = [sys.executable, "-m", "guardian", "--port", str(port), "--guardian-config", str(config)]
    if not prompt_cache:
        args += ["--prompt-cache-size", "0"]
    server = Server("guardian", args, port, log_dir / f"server-{prompt_cache}-{in_system}.log",
                    env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    try:
        if not server.wait_ready():
            raise SystemExit("\n".join(server.log_tail()))
        seams, steady, ttft, clean = [], [], [], 0
        for i in range(rounds):
            # A system prompt of its own each round: no earlier request's cache matches it.
            long_text = f"Round {i} {time.time_ns()}. " + "word " * system_words
            if in_system:
                body = {"messages": [{"role": "system", "content": long_text},
                                     {"role": "user", "content": "Tell me a story."}]}
            else:
                body = {"prompt": long_text}
            url = server.url + ("/v1/chat/completions" if in_system else "/v1/completions")
            body |= {"max_tokens": SEAM + 12, "temperature": 0.0, "stream": True, "top_logprobs": MARKER,
                     "stream_options": {"include_usage": True}}
            sent = time.monotonic()
            times, ok, tokens = stream_chunks(url, body)
            # Clean: no error, [DONE], usage right (the demo model may stop at its EOS).
            clean += ok and 0 < tokens <= SEAM + 12
            if not ok or tokens < SEAM:
                print(f"round {i}: clean={ok} completion_tokens={tokens}", file=sys.stderr)
            gaps = [b - a for a, b in zip(times, times[1:])]
            seam = max(gaps)
            seams.append(seam)
            steady.append(statistics.median(g for g in gaps if g != seam))
            ttft.append(times[0] - sent)
        restarts = [e["duration_ms"] for e in server.log_events("engine_restarted")]
        cached = [e["cached_tokens"] for e in server.log_events("request_continuation_started")]
        return {
            "seam_ms": statistics.median(seams) * 1000,
            "seam_max_ms": max(seams) * 1000,
            "steady_ms": statistics.median(steady) * 1000,
            "ttft_ms": statistics.median(ttft) * 1000,
            "restart_ms": statistics.median(restarts) if restarts else float("nan"),
            "clean": clean,
            "rounds": rounds,
            "continued": len([e for e in server.log_events("request_rerun") if e.get("continued")]),
            "cached_tokens": statistics.median(cached) if cached else 0,
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=600, help="~2 demo-model tokens a word")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {mode: measure(*mode, options.rounds, options.system_words, Path(tmp))
                for mode in ((True, True), (False, True), (True, False))}
    print(f"demo model, ~{2 * options.system_words} prompt tokens, failure at token {SEAM}, "
          f"medians of {options.rounds} rounds")
    print("| prompt cache | request | time to next token at the seam (max) | steady inter-token | "
          "first token (full prefill) | restart | cached tokens at the continuation | clean streams |")
    print("|---|---|---|---|---|---|---|---|")
    for (cache, in_system), row in rows.items():
        print(f"| {'on (default)' if cache else 'off (--prompt-cache-size 0)'} "
              f"| {'chat, long system message' if in_system else 'text completion'} "
              f"| {row['seam_ms']:.0f} ms ({row['seam_max_ms']:.0f}) | {row['steady_ms']:.1f} ms "
              f"| {row['ttft_ms']:.0f} ms | {row['restart_ms']:.0f} ms | {row['cached_tokens']:.0f} "
              f"| {row['clean']}/{row['rounds']} ({row['continued']} continued) |")


if __name__ == "__main__":
    main()

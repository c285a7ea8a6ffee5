"""Rehearse the incident against stock mlx_lm.server and mlx-guardian, side by side.

The incident (shared/seeds/000_*.txt): ``BatchGenerator.next()`` raised
``RuntimeError: [metal::malloc] Resource limit (499000) exceeded.`` inside
stock's generation thread; the thread died, the process did not, and every
later completion hung. This script injects that same exception into both
servers while 8 clients are mid-generation, then looks at what the clients,
``/health``, ``/v1/models`` and the next request see.

It uses whichever mlx-lm the running Python has installed, the offline demo
model, and 127.0.0.1 only. Usage::

    python bench/incident.py          # a markdown table
    python bench/incident.py --json   # the raw observations

It is a rehearsal, not a test: it prints what happened and never fails on it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import httpx
from servers import Server, free_port, poll_until

INCIDENT = "[metal::malloc] Resource limit (499000) exceeded."
# The fault fires at the AT_STEP-th engine step counted while at least
# MIN_STARTED requests are in the engine: all 8 clients are mid-generation.
AT_STEP = 12
MIN_STARTED = 8
CLIENTS = 8
MAX_TOKENS = 600  # the demo model never stops early: every client is still generating
CLIENT_TIMEOUT_S = 20.0
AFTER_TIMEOUT_S = 10.0  # for the next completion, and for /health to come back
START_TIMEOUT_S = 30.0

# Stock gets the fault from outside: this runs as ``python -c`` and wraps the
# class method before stock's main() builds anything, so no mlx_lm file is
# touched. ``mlx_lm.generate`` as an attribute is the generate *function*,
# hence import_module. The count mirrors the guardian's min_started: a request
# counts from its insertion into the BatchGenerator (when stock hands it a
# context) until its removal, so queued + prefilling + decoding.
STOCK_LAUNCHER = f"""
import importlib, json, sys, time
import mlx_lm.server

BatchGenerator = importlib.import_module("mlx_lm.generate").BatchGenerator
stock_next = BatchGenerator.next
at_step, min_started = int(sys.argv[1]), int(sys.argv[2])
armed_steps = 0

def requests_in(generator):
    return (len(generator._unprocessed_sequences) + len(generator._prompt_batch)
            + len(generator._generation_batch))

def next_with_fault(self):
    global armed_steps
    if requests_in(self) >= min_started:
        armed_steps += 1
        if armed_steps == at_step:
            print(json.dumps({{"event": "fault_injected", "timestamp": time.time()}}),
                  file=sys.stderr, flush=True)
            raise RuntimeError({INCIDENT!r})
    return stock_next(self)

BatchGenerator.next = next_with_fault
sys.argv = ["mlx_lm.server", *sys.argv[3:]]
mlx_lm.server.main()
"""

GUARDIAN_CONFIG = f"""
[fault_injection]
enabled = true
at_step = {AT_STEP}
min_started = {MIN_STARTED}
"""

TRIGGERS = {
    "stock": f"`python -c` launcher wraps `BatchGenerator.next`: RuntimeError at the {AT_STEP}th call "
             f"made with ≥ {MIN_STARTED} requests in the batch",
    "guardian": f"`[fault_injection]` `at_step = {AT_STEP}`, `min_started = {MIN_STARTED}` "
                f"(raised in `BatchGenerator.next` too)",
}


def fault_time(server: Server) -> Optional[float]:
    """Wall time the injected fault was raised, from the server's own log line."""
    for event in server.log_events("fault_injected"):
        stamp = event["timestamp"]
        if isinstance(stamp, (int, float)):
            return float(stamp)
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    return None


def start_servers(model: Path, workdir: Path) -> dict[str, Server]:
    """Both servers at once, so their start-ups overlap."""
    stock_port, guardian_port = free_port(), free_port()
    config = workdir / "guardian.toml"
    config.write_text(GUARDIAN_CONFIG)
    common = ["--model", str(model), "--host", "127.0.0.1"]
    # Stock's /v1/models scans the Hugging Face cache and, when that folder
    # does not exist, dies after sending "200" with no body. An empty cache
    # makes it answer as it did in the incident: a list with the --model.
    hf_cache = workdir / "hf-cache"
    hf_cache.mkdir()
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    return {
        "stock": Server(
            "stock",
            [sys.executable, "-c", STOCK_LAUNCHER, str(AT_STEP), str(MIN_STARTED),
             *common, "--port", str(stock_port)],
            stock_port, workdir / "stock.log", env),
        "guardian": Server(
            "guardian",
            [sys.executable, "-m", "guardian", "--guardian-config", str(config),
             *common, "--port", str(guardian_port)],
            guardian_port, workdir / "guardian.log", env),
    }


class HealthWatch(threading.Thread):
    """Polls /health from before the clients start, recording (answer time, status).

    Answer time, not send time: while the engine restarts, the HTTP threads
    may not run at all (the restart holds the GIL), so a poll sent just
    before the fault can be answered well after it.
    """

    def __init__(self, server: Server, interval: float = 0.01):
        super().__init__(daemon=True)
        self.server = server
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            status = self.server.health()
            self.samples.append((time.time(), status))
            self.stopped.wait(self.interval)

    def after(self, fault: float) -> list[tuple[float, int]]:
        return [(t, status) for t, status in self.samples if t >= fault]

    def settled(self, fault: float) -> bool:
        """Seen 200 since the fault, or waited AFTER_TIMEOUT_S for it."""
        return any(s == 200 for _, s in self.after(fault)) or time.time() > fault + AFTER_TIMEOUT_S


def chat_body(content: str, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}


def error_text(response: httpx.Response) -> str:
    """The error's code or message from a JSON error body, whichever shape it has."""
    try:
        error = response.json().get("error")
    except (json.JSONDecodeError, AttributeError):
        return response.text[:60]
    if isinstance(error, dict):
        return error.get("code") or error.get("message", "")
    return "" if error is None else str(error)


def read_stream(response: httpx.Response, result: dict, deadline: float) -> None:
    """Count content chunks; note an error event, [DONE], or the end without them."""
    for line in response.iter_lines():
        if time.monotonic() > deadline:  # SSE keepalives must not stretch the timeout
            raise httpx.ReadTimeout("client deadline")
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            result["done"] = True
            continue
        event = json.loads(data)
        error = event.get("error")
        if error:
            result["error_event"] = error.get("code") or error.get("message") \
                if isinstance(error, dict) else str(error)
        for choice in event.get("choices", []):
            if (choice.get("delta") or {}).get("content"):
                result["tokens"] += 1
    if result["error_event"] and result["done"]:
        result["outcome"] = f"200, error event `{result['error_event']}` + [DONE]"
    elif result["done"]:
        result["outcome"] = "200, [DONE], complete"
    else:
        result["outcome"] = "200, closed without error event or [DONE]"


def run_client(url: str, i: int, stream: bool, max_tokens: int, timeout: float) -> dict:
    """One client: what it received, classified in a few words (``outcome``)."""
    result = {"client": i, "stream": stream, "status": None, "tokens": 0,
              "error_event": None, "done": False, "outcome": None}
    started = time.monotonic()
    body = chat_body(f"Client {i} says hello.", max_tokens, stream)
    try:
        with httpx.Client(timeout=timeout) as client:
            with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                result["status"] = response.status_code
                if response.status_code != 200:
                    response.read()
                    result["outcome"] = f"{response.status_code} {error_text(response)}"
                elif stream:
                    read_stream(response, result, started + timeout)
                else:
                    response.read()
                    result["tokens"] = response.json()["usage"]["completion_tokens"]
                    result["outcome"] = "200 with completion"
    except httpx.TimeoutException:
        got = "no bytes" if result["status"] is None else f"{result['status']}, then nothing"
        result["outcome"] = f"hung: {got} until the client timeout"
    except httpx.TransportError:
        got = "no bytes" if result["status"] is None else f"{result['status']}, then cut"
        result["outcome"] = f"connection dropped: {got}"
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def rehearse(server: Server, mlx_lm_version: str) -> dict:
    """The scenario against one running server; every wait has a deadline."""
    watch = HealthWatch(server)
    watch.start()
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(run_client, server.url, i, i % 2 == 0, MAX_TOKENS, CLIENT_TIMEOUT_S)
                       for i in range(CLIENTS)]
            clients = [f.result() for f in futures]
        clients_done = time.time()
        fault = fault_time(server)
        after = {
            "health": probe(lambda: httpx.get(server.url + "/health", timeout=2)),
            "models": probe(lambda: httpx.get(server.url + "/v1/models", timeout=2)),
            "next_completion": probe(lambda: httpx.post(
                server.url + "/v1/chat/completions",
                json=chat_body("Are you still there?", 8, False), timeout=AFTER_TIMEOUT_S)),
        }
        if fault is not None:
            poll_until(lambda: watch.settled(fault), AFTER_TIMEOUT_S)
    finally:
        watch.stopped.set()
        watch.join()
    return {
        "kind": server.kind,
        "mlx_lm": mlx_lm_version,
        "trigger": TRIGGERS[server.kind],
        "fault_injected": fault is not None,
        "clients": clients,
        "last_client_after_fault_s": None if fault is None else round(clients_done - fault, 2),
        "health_after_fault": [] if fault is None else
            [(round(t - fault, 3), s) for t, s in watch.after(fault)],
        **after,
        # Only the guardian logs this; stock has no restart to log.
        "restarts_ms": [e.get("duration_ms") for e in server.log_events("engine_restarted")],
        "process_alive": server.alive(),
        "exit_code": server.proc.poll(),
        "log_tail": server.log_tail(),
    }


def probe(send: Callable[[], httpx.Response]) -> dict:
    """A request after the failure: its status and error, or how it failed."""
    started = time.monotonic()
    try:
        response = send()
        result = {"status": response.status_code, "bytes": len(response.content),
                  "error": None if response.status_code == 200 else error_text(response)}
    except httpx.TimeoutException:
        result = {"status": None, "error": "timeout"}
    except httpx.TransportError as e:
        result = {"status": None, "error": f"dropped ({type(e).__name__})"}
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


# -- the table ----------------------------------------------------------------
def clients_cell(clients: list[dict]) -> str:
    """E.g. "2 × 200, error event + [DONE] (3–5 tokens); 2 × 200, [DONE], complete (600 tokens)"."""
    groups = Counter(c["outcome"] for c in clients)
    parts = []
    for outcome, count in groups.items():
        tokens = sorted(c["tokens"] for c in clients if c["outcome"] == outcome)
        span = f"{tokens[0]}" if tokens[0] == tokens[-1] else f"{tokens[0]}–{tokens[-1]}"
        seconds = f"≤ {max(c['seconds'] for c in clients if c['outcome'] == outcome):.1f} s"
        detail = f"{span} token{'' if tokens[-1] == 1 else 's'}; {seconds}" if tokens[-1] else seconds
        parts.append(f"{count} × {outcome} ({detail})")
    return "; ".join(parts)


def health_cell(samples: list[tuple[float, int]]) -> str:
    """What /health answered from the fault on (polled every 10 ms or so)."""
    if not samples:
        return "not measured"
    runs = [samples[0][1]]
    for _, status in samples[1:]:
        if status != runs[-1]:
            runs.append(status)
    shown = " → ".join("no answer" if s == 0 else str(s) for s in runs)
    if runs == [200]:
        # No 503 seen: either nothing noticed the failure, or no poll was
        # answered during the restart. The first answer's delay tells which.
        return f"200 throughout; first answer {samples[0][0]:.2f} s after the fault"
    first_bad = next(i for i, (_, s) in enumerate(samples) if s != 200)
    first_ok = next((t for t, s in samples[first_bad:] if s == 200), None)
    if first_ok is None:
        return f"{shown}, never 200 within {AFTER_TIMEOUT_S:.0f} s"
    return f"{shown}: 200 again {first_ok:.2f} s after the fault"


def probe_cell(result: dict) -> str:
    if result["status"] == 200 and not result["bytes"]:
        return "200, empty body"
    if result["status"] == 200 or (result["status"] and not result["error"]):
        return str(result["status"])
    if result["status"] is None:
        return f"{result['error']} after {result['seconds']:.0f} s" if result["error"] == "timeout" \
            else result["error"]
    return f"{result['status']} `{result['error']}`"


def restart_cell(r: dict) -> str:
    if not r["restarts_ms"]:
        return "none"
    return ", ".join(f"{ms:.0f} ms" for ms in r["restarts_ms"]) + " (`engine_restarted` in its log)"


def process_cell(r: dict) -> str:
    state = "alive" if r["process_alive"] else f"exited ({r['exit_code']})"
    return f"{state}, {'generating' if r['next_completion']['status'] == 200 else 'not generating'}"


def markdown_table(results: dict[str, dict]) -> str:
    stock, guardian = results["stock"], results["guardian"]
    nonstream = [c for c in stock["clients"] if not c["stream"]]
    rows = [
        ("fault", lambda r: r["trigger"] if r["fault_injected"] else "**fault not injected**"),
        (f"non-streaming clients ({len(nonstream)})",
         lambda r: clients_cell([c for c in r["clients"] if not c["stream"]])),
        (f"streaming clients ({CLIENTS - len(nonstream)})",
         lambda r: clients_cell([c for c in r["clients"] if c["stream"]])),
        ("engine restart", restart_cell),
        ("/health from the fault on", lambda r: health_cell(r["health_after_fault"])),
        ("/health after the clients", lambda r: probe_cell(r["health"])),
        ("/v1/models", lambda r: probe_cell(r["models"])),
        ("next completion", lambda r: probe_cell(r["next_completion"])),
        ("process", process_cell),
    ]
    lines = [f"| observation | stock mlx-lm {stock['mlx_lm']} | mlx-guardian |", "|---|---|---|"]
    lines += [f"| {name} | {cell(stock)} | {cell(guardian)} |" for name, cell in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the raw observations as JSON")
    args = parser.parse_args()

    from guardian.demo_model import ensure_demo_model

    model = ensure_demo_model()
    mlx_lm_version = importlib.metadata.version("mlx-lm")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="incident-") as workdir:
        servers = start_servers(model, Path(workdir))
        try:
            for kind, server in servers.items():
                if not server.wait_ready(START_TIMEOUT_S):
                    sys.exit(f"{kind} server did not start:\n" + "\n".join(server.log_tail(40)))
            # One after the other: 8 clients at a time on a shared CPU.
            for kind, server in servers.items():
                results[kind] = rehearse(server, mlx_lm_version)
        finally:
            for server in servers.values():
                server.stop()

    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"Incident rehearsal, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: "
          f"mlx-lm {mlx_lm_version}, mlx {importlib.metadata.version('mlx')}, "
          f"Python {sys.version.split()[0]}; {CLIENTS} clients (half streaming), "
          f"max_tokens={MAX_TOKENS}, client timeout {CLIENT_TIMEOUT_S:.0f} s.\n")
    print(markdown_table(results))


if __name__ == "__main__":
    main()

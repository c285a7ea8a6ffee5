"""Soak: engine failures under 8 looping clients, and what the clients saw.

Two runs, each against a fresh server on the offline demo model (no --model):

``inprocess``: ``python -m guardian`` with the fault-injection plugin raising
the incident's ``RuntimeError`` inside ``BatchGenerator.next`` every
``--every-n-steps`` engine steps (or with ``--probability`` per step), while 8
clients loop with httpx (every request a unique prompt; ``max_tokens`` drawn
from 8..256; each request streams with probability 1/2), until ``--failures``
faults are planted (``fault_injected`` events in the server's JSON log).

``supervise``: ``python -m guardian --supervise`` with the same clients and
real faults on the child, ``--rounds`` rounds of each of SIGKILL, SIGSEGV and
SIGSTOP (the child's pid from ``GET /guardian/supervisor``); ``--engine stock`` makes the
child stock's own server (which tags no tokens: a stream it began cannot be continued, and
ends with an error event). Between faults
the script waits for a new child to be ready, then lets the clients run a
few seconds so the next fault lands mid-generation. After SIGSTOP the
supervisor replaces the frozen child once its checks have failed for
``unhealthy_after_s`` (3 s here, 30 s by default).

Recovery settings of the in-process run, and why. A failure every N steps
is far more than any real server sees, so the defaults (chosen for a real
crash loop) would end the soak within seconds, by design:

- ``max_failures = 1000000`` within ``window_s = 60``: the default (5 per
  60 s) exits with code 4 at the sixth failure; the soak plants ~2 a second.
  Every planted failure here is followed by completed requests, which is
  exactly what a crash loop is not.
- ``max_reruns = 1000`` and ``max_continuations = 1000``: a 256-token request
  lives through several planted failures (one every N steps, one token per
  request per step). With the defaults (1 and 2) its second failure makes it
  a suspect, run alone; a fault planted while it runs alone blames it (500
  ``request_failed_repeatedly``) and a stream past 2 continuations gets an
  error event. Those are the designed answers to a request that keeps failing
  the engine, not what this soak measures: that a failure the request is not
  to blame for is invisible. The number of continuations a single request
  needed is reported (``max continuations of one request``), so the bound a
  deployment would need at this fault rate is visible.
- ``reload_after_failures = 0``: the planted error is not the weights' fault;
  the default reloads the weights from the third failure in a window on.
- ``backoff_*`` stay at their defaults (2 failures in a row without a
  completed request, 0.25 s doubling to 8 s). With 8 clients a request
  completes between most planted failures, so backoff seldom fires; when it
  does, its wait is part of the added latency measured (``engine_backoff``
  events are counted).
- ``quarantine_s`` stays at its default; every prompt is unique.
- ``[watchdog] probe_interval_s = 3600``: the clients keep the engine busy.

The supervise run sets ``[supervisor] unhealthy_after_s = 3``,
``max_restarts = 1000`` (the default 5 in 300 s exits with code 6 after the
sixth fault), ``interval_s = 0.5``, ``quarantine_s = 0`` (a fault every few
seconds lands on the same long request twice: the crash quarantine would
refuse it with a 500, its designed answer to a request in flight at two
crashes, which is a poison body's signature, not what this soak plants from
outside); everything else default (``max_resends``
1, ``hold_s`` 30).

Client-visible failures (goal 0): any non-200; any exception (timeouts,
dropped connections); a stream with an ``error`` event, without ``[DONE]``,
or without a ``finish_reason``; a stream whose content chunks outnumber its
``usage.completion_tokens``, or a request with ``finish_reason == "length"``
whose ``usage.completion_tokens`` is not its ``max_tokens`` (a token lost or
counted twice at a seam). Stock sends one chunk per token that decodes to
text, so chunks <= tokens; ``chunk_mismatch`` counts streams where the two
differ at all, for requests with and without a failure, so a seam effect
would show as a difference between the two.

A request "lived through a failure" when a planted fault (in-process: a
``fault_injected`` event's timestamp; supervise: the moment the signal was
sent) falls between its start and its end.

Usage::

    .venv/bin/python bench/soak.py inprocess --failures 1000 --every-n-steps 40
    .venv/bin/python bench/soak.py supervise --rounds 5
    .venv/bin/python bench/soak.py inprocess --failures 30      # a quick look

Results: bench/results/soak-<mode>.json and soak-<mode>.png (``--out``).
Plots with matplotlib when it is installed (not declared by pyproject; ``.venv/bin/pip install
matplotlib``); without it, the JSON and the tables alone.
Timings depend on the machine's load; the JSON records the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

from servers import Server, free_port, poll_until
from stats import percentile

RESULTS = Path(__file__).resolve().parent / "results"

INPROCESS_CONFIG = """\
[fault_injection]
enabled = true
{trigger}
seed = 1

[recovery]
max_failures = 1000000
window_s = 60.0
reload_after_failures = 0
max_reruns = 1000
max_continuations = 1000

[watchdog]
probe_interval_s = 3600.0
"""

SUPERVISE_CONFIG = """\
[supervisor]
interval_s = 0.5
unhealthy_after_s = 3.0
max_restarts = 1000
quarantine_s = 0
"""
# A guardian child's probes: the clients keep it busy. (A stock child reads no file: the
# supervisor refuses any table of the child's with --engine stock.)
GUARDIAN_CHILD_CONFIG = """
[watchdog]
probe_interval_s = 3600.0
"""




def summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 4),
            "p99": round(percentile(values, 99), 4), "max": round(max(values), 4)}


def server_cpu_s(server) -> float:
    """CPU seconds the server process has used, all its threads (user + system)."""
    import psutil

    try:
        times = psutil.Process(server.proc.pid).cpu_times()
    except psutil.NoSuchProcess:  # it died: the run reports that
        return float("nan")
    return times.user + times.system


def completed_tokens(records: list[dict]) -> int:
    """Completion tokens of the requests that succeeded."""
    return sum(r["tokens"] or 0 for r in records if not r["failure"])


def log_time(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


# --- clients ---------------------------------------------------------------

def one_request(client: httpx.Client, url: str, body: dict) -> dict:
    """Send one request; what came back, judged."""
    rec = {"stream": body["stream"], "max_tokens": body["max_tokens"], "status": 0,
           "failure": None, "tokens": None, "chunks": None, "finish_reason": None}
    try:
        if body["stream"]:
            with client.stream("POST", url, json=body) as response:
                rec["status"] = response.status_code
                chunks, done, error, usage, finish = 0, False, None, None, None
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        continue
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            chunks += 1
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                rec.update(chunks=chunks, finish_reason=finish,
                           tokens=usage and usage.get("completion_tokens"))
                if response.status_code != 200:
                    rec["failure"] = f"status {response.status_code}"
                elif error is not None:
                    rec["failure"] = f"error event {error.get('code') if isinstance(error, dict) else error}"
                elif not done:
                    rec["failure"] = "no [DONE]"
                elif finish is None:
                    rec["failure"] = "no finish_reason"
                elif rec["tokens"] is None:
                    rec["failure"] = "no usage"
                elif chunks > rec["tokens"]:
                    rec["failure"] = f"chunks {chunks} > usage {rec['tokens']}"
                elif finish == "length" and rec["tokens"] != body["max_tokens"]:
                    rec["failure"] = f"length with {rec['tokens']} of {body['max_tokens']} tokens"
        else:
            response = client.post(url, json=body)
            rec["status"] = response.status_code
            if response.status_code != 200:
                rec["failure"] = f"status {response.status_code}"
                rec["body"] = response.text[:300]
            else:
                payload = response.json()
                finish = payload["choices"][0].get("finish_reason")
                tokens = (payload.get("usage") or {}).get("completion_tokens")
                rec.update(finish_reason=finish, tokens=tokens)
                if finish is None:
                    rec["failure"] = "no finish_reason"
                elif finish == "length" and tokens != body["max_tokens"]:
                    rec["failure"] = f"length with {tokens} of {body['max_tokens']} tokens"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        rec["failure"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def client_loop(url: str, index: int, stop: threading.Event, records: list, lock: threading.Lock) -> None:
    rng = random.Random(index)
    with httpx.Client(timeout=120) as client:
        n = 0
        while not stop.is_set():
            body = {
                "messages": [{"role": "user", "content": f"Soak client {index} request {n}: tell me a story."}],
                "max_tokens": rng.randint(8, 256),
                "stream": rng.random() < 0.5,
            }
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            start = time.time()
            rec = one_request(client, url, body)
            rec.update(client=index, n=n, start=start, end=time.time())
            if rec["failure"]:
                rec["request"] = body
            with lock:
                records.append(rec)
            n += 1


class Clients:
    def __init__(self, url: str, count: int):
        self.stop, self.lock, self.records = threading.Event(), threading.Lock(), []
        self.threads = [threading.Thread(target=client_loop, args=(url, i, self.stop, self.records, self.lock),
                                         daemon=True) for i in range(count)]

    def start(self):
        for t in self.threads:
            t.start()

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)


# --- analysis ---------------------------------------------------------------

def outcomes(records: list[dict], faults: list[float]) -> dict:
    """Counts and latencies, streams and non-streams apart, by whether a fault hit them."""
    faults = sorted(faults)

    def hit(rec):
        import bisect
        i = bisect.bisect_left(faults, rec["start"])
        return i < len(faults) and faults[i] <= rec["end"]

    out = {}
    for label, stream in (("streams", True), ("non-streams", False)):
        recs = [r for r in records if r["stream"] is stream]
        failed = [r for r in recs if r["failure"]]
        reasons = {}
        for r in failed:
            key = r["failure"].split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        through = [r for r in recs if hit(r)]
        clean = [r for r in recs if not hit(r)]
        row = {
            "requests": len(recs),
            "failed": len(failed),
            "failure_reasons": reasons,
            "lived_through_fault": len(through),
            "failed_of_those": sum(1 for r in through if r["failure"]),
            "latency_s_through_fault": summary([r["end"] - r["start"] for r in through if not r["failure"]]),
            "latency_s_no_fault": summary([r["end"] - r["start"] for r in clean if not r["failure"]]),
            # Length-neutral: most long requests live through a fault, so the raw
            # latencies above compare long requests with short ones.
            "ms_per_token_through_fault": summary([1000 * (r["end"] - r["start"]) / r["tokens"] for r in through
                                                   if not r["failure"] and r["tokens"]]),
            "ms_per_token_no_fault": summary([1000 * (r["end"] - r["start"]) / r["tokens"] for r in clean
                                              if not r["failure"] and r["tokens"]]),
        }
        if stream:
            row["chunk_mismatch_through_fault"] = sum(
                1 for r in through if r["tokens"] is not None and r["chunks"] != r["tokens"])
            row["chunk_mismatch_no_fault"] = sum(
                1 for r in clean if r["tokens"] is not None and r["chunks"] != r["tokens"])
        out[label] = row
    return out


def plot(records: list[dict], faults: list[float], t0: float, title: str, path: Path,
         fault_labels: list[str] | None = None) -> None:
    try:
        import matplotlib
    except ImportError:  # the run's JSON and tables stand without it
        print("no plot: matplotlib is not installed (.venv/bin/pip install matplotlib)", file=sys.stderr)
        path.unlink(missing_ok=True)  # an older run's plot would not match this run
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5), dpi=110)
    many = len(faults) > 60
    colors = {"SIGKILL": "tab:red", "SIGSEGV": "tab:purple", "SIGSTOP": "tab:brown"}
    seen = set()
    for i, f in enumerate(faults):
        kind = fault_labels[i] if fault_labels else "planted failure"
        label = None if kind in seen else kind
        seen.add(kind)
        ax.axvline(f - t0, color=colors.get(kind, "0.6"), lw=0.3 if many else 1.0,
                   alpha=0.35 if many else 0.8, zorder=0, label=label)
    for stream, color, name in ((False, "tab:blue", "non-streaming"), (True, "tab:orange", "streaming")):
        ok = [r for r in records if r["stream"] is stream and not r["failure"]]
        bad = [r for r in records if r["stream"] is stream and r["failure"]]
        ax.scatter([r["end"] - t0 for r in ok], [r["end"] - r["start"] for r in ok], s=4, c=color,
                   alpha=0.5, label=f"{name} ({len(ok)} ok)", zorder=2, linewidths=0)
        if bad:
            ax.scatter([r["end"] - t0 for r in bad], [r["end"] - r["start"] for r in bad], s=40, c=color,
                       marker="x", label=f"{name} failed ({len(bad)})", zorder=3)
    ax.set_xlabel("time since start (s), at the request's end")
    ax.set_ylabel("request latency (s)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=8, markerscale=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def environment() -> dict:
    import mlx.core as mx
    import mlx_lm
    return {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mlx_lm": mlx_lm.__version__,
            "mlx": mx.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


# --- runs --------------------------------------------------------------------

def run_inprocess(args) -> dict:
    from guardian.demo_model import ensure_demo_model

    model = str(ensure_demo_model())
    trigger = (f"probability = {args.probability}" if args.probability
               else f"every_n_steps = {args.every_n_steps}")
    workdir = Path(tempfile.mkdtemp(prefix="soak-inprocess-"))
    config = workdir / "guardian.toml"
    config.write_text(INPROCESS_CONFIG.format(trigger=trigger))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = Server("guardian", [sys.executable, "-m", "guardian", "--guardian-config", str(config),
                                 "--model", model, "--host", "127.0.0.1", "--port", str(port)],
                    port, workdir / "guardian.log", env)
    print(f"log: {server.log_path}", file=sys.stderr)
    try:
        if not server.wait_ready():
            raise SystemExit("the guardian did not start:\n" + "\n".join(server.log_tail()))
        clients = Clients(server.url + "/v1/chat/completions", args.clients)
        cpu_at_start = server_cpu_s(server)
        t0 = time.time()
        clients.start()
        done = poll_until(lambda: not server.alive() or len(server.log_events("fault_injected")) >= args.failures,
                          args.timeout, interval=1.0)
        clients.finish()
        elapsed = time.time() - t0
        cpu_s = server_cpu_s(server) - cpu_at_start
        alive = server.alive()
        events = {name: server.log_events(name) for name in
                  ("fault_injected", "engine_error", "engine_restarted", "request_rerun", "engine_backoff",
                   "request_failed", "request_blamed", "engine_gave_up")}
        status = None
        if alive:
            try:
                status = httpx.get(server.url + "/guardian/status", timeout=5).json()
            except httpx.HTTPError:
                pass
    finally:
        server.stop()
    if not done:
        print(f"warning: only {len(events['fault_injected'])} faults within {args.timeout} s", file=sys.stderr)
    faults = [log_time(e) for e in events["fault_injected"]]
    reruns = events["request_rerun"]
    restarted = events["engine_restarted"]
    records = clients.records
    result = {
        "mode": "inprocess", **environment(), "clients": args.clients, "trigger": trigger,
        "elapsed_s": round(elapsed, 1), "server_alive_at_end": alive,
        "faults_planted": len(faults), "engine_errors": len(events["engine_error"]),
        "restarts": len(restarted),
        "restart_duration_ms": summary([e["duration_ms"] for e in restarted]),
        "backoffs": len(events["engine_backoff"]),
        "reruns": {"total": len(reruns), "continued": sum(1 for e in reruns if e.get("continued")),
                   "from_nothing": sum(1 for e in reruns if not e.get("continued")),
                   "isolated": sum(1 for e in reruns if e.get("isolated")),
                   "max_continuations_of_one_request": max((e.get("continuations", 0) for e in reruns), default=0)},
        "server_request_failed": len(events["request_failed"]),
        "server_request_blamed": len(events["request_blamed"]),
        # Throughput: what a run with faults compares with a fault-free one. Per
        # CPU-second of the server too: on a machine shared with other jobs the
        # wall clock measures their load as much as the server's work.
        "completion_tokens_per_s": round(completed_tokens(records) / elapsed, 1),
        "server_cpu_s": round(cpu_s, 2),
        "completion_tokens_per_cpu_s": round(completed_tokens(records) / cpu_s, 1) if cpu_s > 0 else None,
        "rerun_prompt_tokens": (status or {}).get("rerun_prompt_tokens"),
        "rerun_prompt_tokens_cached": (status or {}).get("rerun_prompt_tokens_cached"),
        "outcomes": outcomes(records, faults),
        "failed_requests": [r for r in records if r["failure"]][:50],
        "status_at_end": status,
        "log": str(server.log_path),
    }
    title = (f"in-process guardian, demo model, {args.clients} clients: {len(faults)} planted engine failures "
             f"({trigger}) in {elapsed:.0f} s")
    out = args.out / "soak-inprocess"
    plot(records, faults, t0, title, out.with_suffix(".png"))
    result["records"] = [{k: r[k] for k in ("start", "end", "stream", "max_tokens", "status", "tokens", "failure")}
                         for r in records]
    result["fault_times"] = faults
    result["t0"] = t0
    return result


def supervisor_state(url: str) -> dict:
    try:
        return httpx.get(url + "/guardian/supervisor", timeout=2).json()
    except (httpx.HTTPError, json.JSONDecodeError):
        return {}


def run_supervise(args) -> dict:
    from guardian.demo_model import ensure_demo_model

    model = str(ensure_demo_model())
    workdir = Path(tempfile.mkdtemp(prefix="soak-supervise-"))
    config = workdir / "guardian.toml"
    config.write_text(SUPERVISE_CONFIG + (GUARDIAN_CHILD_CONFIG if args.engine == "guardian" else ""))
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = Server("supervise", [sys.executable, "-m", "guardian", "--supervise", "--engine", args.engine,
                                  "--guardian-config", str(config),
                                  "--model", model, "--host", "127.0.0.1", "--port", str(port)],
                    port, workdir / "supervise.log", env)
    print(f"log: {server.log_path}", file=sys.stderr)
    kinds = [("SIGKILL", signal.SIGKILL), ("SIGSEGV", signal.SIGSEGV), ("SIGSTOP", signal.SIGSTOP)]
    faults, labels, replaced_s = [], [], []

    def ready_child():
        s = supervisor_state(server.url)
        child = s.get("child") or {}
        return child if s.get("state") == "ready" and child.get("ready") else None

    try:
        if not poll_until(lambda: not server.alive() or ready_child(), 90, interval=0.2) or not server.alive():
            raise SystemExit("the supervisor did not start:\n" + "\n".join(server.log_tail()))
        clients = Clients(server.url + "/v1/chat/completions", args.clients)
        t0 = time.time()
        clients.start()
        schedule = [kind for _ in range(args.rounds) for kind in kinds]
        for name, sig in schedule:
            time.sleep(args.settle)
            child = poll_until(lambda: not server.alive() or ready_child(), 60, interval=0.2)
            if not server.alive() or not child:
                print(f"warning: no ready child before {name}", file=sys.stderr)
                break
            pid = child["pid"]
            faults.append(time.time())
            labels.append(name)
            os.kill(pid, sig)
            back = poll_until(lambda: not server.alive() or ((c := ready_child()) and c["pid"] != pid), 60,
                              interval=0.05)
            replaced_s.append(round(time.time() - faults[-1], 2) if back and server.alive() else None)
            print(f"{name} pid {pid}: ready again after {replaced_s[-1]} s", file=sys.stderr)
        time.sleep(args.settle)
        clients.finish()
        elapsed = time.time() - t0
        alive = server.alive()
        final = supervisor_state(server.url) if alive else {}
        events = {name: server.log_events(name) for name in
                  ("child_exited", "child_ready", "request_resent", "stream_continuing", "request_not_held",
                   "request_refused_by_stopping_child", "child_unhealthy",
                   "supervisor_gave_up", "request_rerun", "engine_restarted")}
    finally:
        server.stop()
    records = clients.records
    per_kind = {}
    for name, _ in kinds:
        times = [t for t, k in zip(faults, labels) if k == name]
        kind_replaced = [s for s, k in zip(replaced_s, labels) if k == name and s is not None]
        # Requests attributed to this kind: those alive at one of its signals.
        import bisect
        def hit(rec, times=sorted(times)):
            i = bisect.bisect_left(times, rec["start"])
            return i < len(times) and times[i] <= rec["end"]
        mine = [r for r in records if hit(r)]
        per_kind[name] = {"faults": len(times), "ready_again_s": summary(kind_replaced),
                          "outcomes": outcomes(mine, times)}
    result = {
        "mode": "supervise", "engine": args.engine, **environment(), "clients": args.clients, "rounds": args.rounds,
        "elapsed_s": round(elapsed, 1), "server_alive_at_end": alive,
        "faults": [{"kind": k, "t": round(t - t0, 2), "ready_again_s": s}
                   for k, t, s in zip(labels, faults, replaced_s)],
        "per_kind": per_kind,
        "overall": outcomes(records, faults),
        "child_exits": [e.get("reason") for e in events["child_exited"]],
        "child_ready_downtime_s": summary([e["downtime_s"] for e in events["child_ready"] if e.get("downtime_s")]),
        "requests_resent": len(events["request_resent"]),
        "streams_continued": len(events["stream_continuing"]),
        "refused_by_stopping_child": len(events["request_refused_by_stopping_child"]),
        "requests_not_held": len(events["request_not_held"]),
        "child_reruns": {"total": len(events["request_rerun"]),
                         "continued": sum(1 for e in events["request_rerun"] if e.get("continued"))},
        "supervisor_restarts": final.get("restarts"),
        "failed_requests": [r for r in records if r["failure"]][:80],
        "log": str(server.log_path),
    }
    engine = "" if args.engine == "guardian" else f" --engine {args.engine}"
    title = (f"--supervise{engine}, demo model, {args.clients} clients: {args.rounds} rounds of SIGKILL, SIGSEGV, "
             f"SIGSTOP on the child in {elapsed:.0f} s")
    out = args.out / ("soak-supervise" if args.engine == "guardian" else f"soak-supervise-{args.engine}")
    plot(records, faults, t0, title, out.with_suffix(".png"), labels)
    result["records"] = [{k: r[k] for k in ("start", "end", "stream", "max_tokens", "status", "tokens", "failure")}
                         for r in records]
    result["t0"] = t0
    return result


def markdown(result: dict) -> str:
    def rows(outs: dict, prefix: str = "") -> list[str]:
        lines = []
        for label, o in outs.items():
            lt, ln = o["latency_s_through_fault"], o["latency_s_no_fault"]
            fmt = lambda s: f"{s['median']:.2f} / {s['p99']:.2f}" if s.get("n") else "—"
            fmt_ms = lambda s: f"{s['median']:.1f} / {s['p99']:.1f}" if s.get("n") else "—"
            lines.append(f"| {prefix}{label} | {o['requests']} | {o['failed']} "
                         f"{o['failure_reasons'] or ''} | {o['lived_through_fault']} | {o['failed_of_those']} | "
                         f"{fmt(ln)} | {fmt(lt)} | {fmt_ms(o['ms_per_token_no_fault'])} | "
                         f"{fmt_ms(o['ms_per_token_through_fault'])} |")
        return lines

    head = ["| requests | sent | client-visible failures | lived through a fault | of those failed | "
            "latency s, no fault (median / p99) | latency s, through a fault (median / p99) | "
            "ms per token, no fault | ms per token, through a fault |",
            "|---|---|---|---|---|---|---|---|---|"]
    if result["mode"] == "inprocess":
        return "\n".join(head + rows(result["outcomes"]))
    lines = list(head)
    for kind, k in result["per_kind"].items():
        lines += rows(k["outcomes"], f"{kind} ({k['faults']}×): ")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("inprocess", "supervise"))
    parser.add_argument("--failures", type=int, default=1000, help="inprocess: stop after this many planted faults")
    parser.add_argument("--every-n-steps", type=int, default=40)
    parser.add_argument("--probability", type=float, default=0.0, help="instead of --every-n-steps")
    parser.add_argument("--rounds", type=int, default=5, help="supervise: rounds of SIGKILL, SIGSEGV, SIGSTOP")
    parser.add_argument("--settle", type=float, default=4.0, help="supervise: seconds of traffic before each fault")
    parser.add_argument("--engine", choices=("guardian", "stock"), default="guardian",
                        help="supervise: the child, as --engine says (stock: stock's mlx_lm server)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=900.0, help="inprocess: seconds for the whole run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_inprocess(args) if args.mode == "inprocess" else run_supervise(args)
    path = args.out / (f"soak-{args.mode}.json" if args.engine == "guardian" else f"soak-{args.mode}-{args.engine}.json")
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    shown = {k: v for k, v in result.items() if k not in ("records", "fault_times", "failed_requests", "status_at_end")}
    print(json.dumps(shown, indent=1, default=str))
    print(markdown(result))
    print(f"\n{path}" + (f"\n{path.with_suffix('.png')}" if path.with_suffix(".png").exists() else ""))


if __name__ == "__main__":
    main()

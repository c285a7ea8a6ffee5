"""Growth: what a server holds after thousands of requests, stock and the guardian side by side.

A server left running unattended must hold as much after a day as after its first minute: no
resident memory, open descriptor or thread kept per request, per engine restart or per child.
Each run starts a fresh server on the offline demo model, warms it with ``--warmup`` requests,
then has ``--clients`` clients loop over a mix of what real clients do for ``--seconds``,
sampling every process of the server every ``--sample-s``:

- ``stock``: stock ``mlx_lm.server``;
- ``guardian``: ``mlx-guardian`` in one process;
- ``guardian-faults``: the same with the incident's ``RuntimeError`` planted inside stock's
  ``BatchGenerator.next`` every 60 engine steps (the fault-injection plugin; recovery set never
  to give up, as in soak.py): each restart's engine, its caches and threads must go;
- ``supervise``: ``mlx-guardian --supervise``;
- ``supervise-kills``: the same, its child SIGKILLed every ``--kill-every-s``: the supervisor
  must hold no more after its twentieth child than after its first (each child starts anew, so
  the supervisor's own process is the one judged).

The mix, drawn per request (each client seeded): 30 % chat completions, 30 % streams read to
``[DONE]``, 15 % streams whose client leaves at the first token, 10 % bodies that are not JSON
(400), 10 % ``GET /health`` with ``GET /v1/models``, 5 % completions whose client gives up after
1 s. Every prompt is new, as a server's traffic is.

Per run and process: resident memory when the clients start and when they stop, its growth in
MB per 1,000 requests (the least-squares slope over the run's second half, once caches have
filled), open descriptors and threads (first, last, most); the requests and any a client saw
fail (a status other than the one expected, a stream without ``[DONE]``, a connection error;
``/health``'s 503 while an engine restarts or a child is replaced is its designed answer, counted
apart).
A leak of a kilobyte a request reads ~1 MB per 1,000; this run's resolution is ~0.1-0.3.

Usage::

    .venv/bin/python bench/growth.py                               # all five runs, 180 s each
    .venv/bin/python bench/growth.py --runs guardian-faults --seconds 60

Results: bench/results/growth.{json,md,png} (``--out``); the plot needs matplotlib (not declared
by pyproject; ``.venv/bin/pip install matplotlib``).
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
from pathlib import Path

import httpx
import psutil

from servers import Server, free_port, poll_until
from soak import GUARDIAN_CHILD_CONFIG, INPROCESS_CONFIG, SUPERVISE_CONFIG
from stats import environment

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = ("stock", "guardian", "guardian-faults", "supervise", "supervise-kills")
FAULT_EVERY_N_STEPS = 60

# (share of requests, what it is): drawn per request.
MIX = ((0.30, "complete"), (0.30, "stream"), (0.15, "stream_left"), (0.10, "not_json"),
       (0.10, "health_and_models"), (0.05, "complete_given_up"))


def command(run: str, config: Path) -> list[str]:
    if run == "stock":
        return [sys.executable, "-m", "mlx_lm", "server"]
    if run.startswith("supervise"):
        return [sys.executable, "-m", "guardian", "--supervise", "--guardian-config", str(config)]
    return [sys.executable, "-m", "guardian", "--guardian-config", str(config)]


def config_text(run: str) -> str:
    if run == "guardian-faults":
        return INPROCESS_CONFIG.format(trigger=f"every_n_steps = {FAULT_EVERY_N_STEPS}")
    if run.startswith("supervise"):
        return SUPERVISE_CONFIG + GUARDIAN_CHILD_CONFIG
    return ""


# --- the clients -------------------------------------------------------------

def one_request(client: httpx.Client, url: str, kind: str, prompt: str, rng: random.Random) -> str | None:
    """Send one request of ``kind``; what went wrong, as a client sees it, or None."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(4, 48)}
    chat = url + "/v1/chat/completions"
    if kind == "complete":
        response = client.post(chat, json=body)
        return None if response.status_code == 200 else f"complete: {response.status_code}"
    if kind in ("stream", "stream_left"):
        body = {**body, "stream": True, "max_tokens": 200 if kind == "stream_left" else body["max_tokens"]}
        with client.stream("POST", chat, json=body) as response:
            if response.status_code != 200:
                return f"{kind}: {response.status_code}"
            for line in response.iter_lines():
                if kind == "stream_left" and line.startswith("data: {"):
                    return None  # the client leaves: the with block closes its connection
                if line == "data: [DONE]":
                    return None
        return f"{kind}: no [DONE]"
    if kind == "not_json":
        response = client.post(chat, content=b'{"messages": [', headers={"content-type": "application/json"})
        return None if response.status_code == 400 else f"not_json: {response.status_code}"
    if kind == "health_and_models":
        statuses = (client.get(url + "/health").status_code, client.get(url + "/v1/models").status_code)
        if statuses == (503, 200):
            return HEALTH_SAID_RESTARTING
        return None if statuses == (200, 200) else f"health_and_models: {statuses}"
    # complete_given_up: a client whose own timeout is shorter than the request (it leaves).
    try:
        client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 200}, timeout=1.0)
    except httpx.TimeoutException:
        pass
    return None


# /health's 503 while an engine restarts or a child is replaced: its designed answer, counted apart.
HEALTH_SAID_RESTARTING = "health 503"


def draw(rng: random.Random) -> str:
    point, total = rng.random(), 0.0
    for share, kind in MIX:
        total += share
        if point < total:
            return kind
    return MIX[-1][1]


class Clients:
    """Clients looping over the mix; a new connection per request for those that leave."""

    def __init__(self, url: str, count: int):
        self.url = url
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.requests = 0
        self.failures: list[str] = []
        self.health_503 = 0
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(count)]

    def loop(self, index: int) -> None:
        rng = random.Random(index)
        n = 0
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                kind = draw(rng)
                prompt = f"Growth client {index} request {n}: {rng.random()}"
                try:
                    if kind in ("stream_left", "complete_given_up"):
                        with httpx.Client(timeout=60) as own:  # its connection goes with it
                            failure = one_request(own, self.url, kind, prompt, rng)
                    else:
                        failure = one_request(client, self.url, kind, prompt, rng)
                except httpx.HTTPError as e:
                    failure = f"{kind}: {type(e).__name__}: {e}"[:200]
                with self.lock:
                    self.requests += 1
                    if failure == HEALTH_SAID_RESTARTING:
                        self.health_503 += 1
                    elif failure:
                        self.failures.append(failure)
                n += 1

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=70)


# --- sampling ----------------------------------------------------------------

def sample(root_pid: int) -> list[dict]:
    """Each process of the server: its role, pid, resident MB, open descriptors, threads."""
    try:
        root = psutil.Process(root_pid)
        members = [("server", root), *(("child", p) for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []
    rows = []
    for role, process in members:
        try:
            with process.oneshot():
                rows.append({"role": role, "pid": process.pid, "rss_mb": process.memory_info().rss / 2**20,
                             "fds": process.num_fds(), "threads": process.num_threads()})
        except psutil.Error:
            pass
    return rows


def slope_per_1000(points: list[tuple[int, float]]) -> float | None:
    """MB per 1,000 requests: the least-squares slope over the second half of ``points``."""
    half = points[len(points) // 2:]
    if len(half) < 3 or half[0][0] == half[-1][0]:
        return None
    fit = statistics.linear_regression([p[0] for p in half], [p[1] for p in half])
    return fit.slope * 1000


def summarise(samples: list[dict], role: str) -> dict | None:
    """One role's figures over the run (a child's: its latest process's, each child starting anew)."""
    rows = [(s["requests"], p) for s in samples for p in s["processes"] if p["role"] == role]
    if not rows:
        return None
    if role == "child":
        last_pid = rows[-1][1]["pid"]
        rows = [r for r in rows if r[1]["pid"] == last_pid]
        if len(rows) < 3:  # killed soon after it started (supervise-kills): nothing to judge
            return None
    first, last = rows[0][1], rows[-1][1]
    return {"pid": last["pid"], "requests_sampled": rows[-1][0] - rows[0][0],
            "rss_mb_first": round(first["rss_mb"], 1), "rss_mb_last": round(last["rss_mb"], 1),
            "rss_mb_most": round(max(p["rss_mb"] for _, p in rows), 1),
            "mb_per_1000_requests": (None if (s := slope_per_1000([(n, p["rss_mb"]) for n, p in rows])) is None
                                     else round(s, 3)),
            "fds": [first["fds"], last["fds"], max(p["fds"] for _, p in rows)],
            "threads": [first["threads"], last["threads"], max(p["threads"] for _, p in rows)]}


# --- a run -------------------------------------------------------------------

def child_pid(url: str) -> int | None:
    try:
        state = httpx.get(url + "/guardian/supervisor", timeout=3).json()
    except (httpx.HTTPError, ValueError):
        return None
    child = state.get("child") or {}
    return child.get("pid") if state.get("state") == "ready" and child.get("ready") else None


def run_one(run: str, args, model: str) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"growth-{run}-"))
    config = workdir / "guardian.toml"
    config.write_text(config_text(run))
    port = free_port()
    server = Server(run, [*command(run, config), "--model", model, "--host", "127.0.0.1", "--port", str(port)],
                    port, workdir / "server.log", {**os.environ, "HF_HUB_OFFLINE": "1"})
    print(f"{run}: log {server.log_path}", file=sys.stderr)
    kills = 0
    try:
        if not server.wait_ready(120):
            raise SystemExit(f"{run} did not start:\n" + "\n".join(server.log_tail()))
        if run.startswith("supervise") and not poll_until(lambda: child_pid(server.url), 60):
            raise SystemExit(f"{run}: no ready child:\n" + "\n".join(server.log_tail()))
        warm = Clients(server.url, args.clients)
        warm.start()
        poll_until(lambda: warm.requests >= args.warmup, 120, interval=0.2)
        warm.finish()
        clients = Clients(server.url, args.clients)
        samples: list[dict] = []

        def take() -> None:
            samples.append({"t": round(time.monotonic() - started, 2), "requests": clients.requests,
                            "processes": sample(server.proc.pid)})

        started = time.monotonic()
        take()
        clients.start()
        next_kill = started + args.kill_every_s
        while time.monotonic() - started < args.seconds and server.alive():
            clients.stop.wait(args.sample_s)
            take()
            if run == "supervise-kills" and time.monotonic() >= next_kill:
                pid = poll_until(lambda: child_pid(server.url), 60)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                next_kill = time.monotonic() + args.kill_every_s
        clients.finish()
        take()
        alive = server.alive()
        restarts = len(server.log_events("engine_restarted")) if run == "guardian-faults" else None
    finally:
        server.stop()
    roles = {role: summarise(samples, role) for role in ("server", "child")}
    return {"run": run, "seconds": round(samples[-1]["t"], 1), "requests": clients.requests,
            "failures": len(clients.failures), "health_503": clients.health_503, "failures_first": clients.failures[:10],
            "alive_at_end": alive, "engine_restarts": restarts, "child_kills": kills if run == "supervise-kills" else None,
            "roles": {k: v for k, v in roles.items() if v}, "samples": samples, "log": str(server.log_path)}


# --- the report --------------------------------------------------------------

def table(results: list[dict]) -> str:
    lines = ["| run | process | requests | failed | resident MB, first → last (most) | MB per 1,000 requests "
             "| open descriptors, first → last (most) | threads, first → last (most) | restarts, kills (/health 503s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for role, figures in r["roles"].items():
            name = {"server": "supervisor" if r["run"].startswith("supervise") else "server",
                    "child": "child (its last)"}[role]
            fds, threads = figures["fds"], figures["threads"]
            events = "" if r["engine_restarts"] is None else f"{r['engine_restarts']} restarts"
            if r["child_kills"] is not None:
                events = f"{r['child_kills']} SIGKILLs"
            if r["health_503"]:
                events += f" ({r['health_503']})"
            lines.append(f"| {r['run']} | {name} | {figures['requests_sampled']:,} | {r['failures']} "
                         f"| {figures['rss_mb_first']} → {figures['rss_mb_last']} ({figures['rss_mb_most']}) "
                         f"| {figures['mb_per_1000_requests']} | {fds[0]} → {fds[1]} ({fds[2]}) "
                         f"| {threads[0]} → {threads[1]} ({threads[2]}) | {events} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for r in results:
        for role, style in (("server", "-"), ("child", ":")):
            rows = [(s["requests"], p) for s in r["samples"] for p in s["processes"] if p["role"] == role]
            if not rows:
                continue
            label = r["run"] + ("" if role == "server" else " (child)")
            for ax, key in zip(axes, ("rss_mb", "fds", "threads")):
                ax.plot([n for n, _ in rows], [p[key] for _, p in rows], style, label=label, linewidth=1.2)
    for ax, title in zip(axes, ("resident memory (MB)", "open descriptors", "threads")):
        ax.set_title(title)
        ax.set_xlabel("requests")
    axes[0].legend(fontsize=7)
    fig.suptitle("What each process holds as requests go (demo model; children restart at each kill)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--seconds", type=float, default=180.0, help="clients' time in each run")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=200, help="requests before the first sample")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--kill-every-s", type=float, default=8.0, help="supervise-kills: SIGKILL the child this often")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    unknown = set(runs) - set(RUNS)
    if unknown:
        parser.error(f"unknown runs: {', '.join(sorted(unknown))}")
    from guardian.demo_model import ensure_demo_model

    model = str(ensure_demo_model())
    results = [run_one(run, args, model) for run in runs]
    report = table(results)
    line = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "growth.json").write_text(json.dumps({"environment": line, "args": vars(args) | {"out": str(args.out)},
                                                      "results": results}, indent=1) + "\n")
    (args.out / "growth.md").write_text(f"{line}\n\n{report}\n")
    try:
        plot(results, args.out / "growth.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(line)
    print(report)


if __name__ == "__main__":
    main()

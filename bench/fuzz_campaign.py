"""Send the same hostile bodies to stock mlx_lm.server and mlx-guardian; count what breaks.

The bodies come from tests/strategies.py (the strategies tests/test_fuzz.py
uses), drawn with a fixed seed: the same ``--seed`` and hypothesis version
give the same list. Each target gets the whole list, one body at a time,
while a bystander client streams normal chat completions back to back:

- ``stock``: ``python -m mlx_lm server``;
- ``guardian``: ``python -m guardian`` (the engine in-process);
- ``supervise``: ``python -m guardian --supervise`` (the engine in a child).

After every body a 1-token canary completion checks that the server still
generates. A server whose process died (by which signal or exit code), whose
canary failed (stock's dead generation thread: a 404, or a hang) or whose
body got no answer within ``--timeout`` is recorded against that body and
started again. For the guardian, ``/guardian/status`` says whether the
engine restarted (and, with ``--supervise``, ``/guardian/supervisor``
whether the child was replaced).

Usage::

    python bench/fuzz_campaign.py                       # 10,000 bodies, all three targets
    python bench/fuzz_campaign.py --bodies 500 --targets stock,guardian
    python bench/fuzz_campaign.py --offset 5000 --bodies 5000   # the second half

It prints a markdown report and saves every answer as JSON under
bench/results/. It is a campaign, not a test: it never fails on what it sees.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the strategies and the client the fuzz test uses

from fuzz_client import Bystander, send  # noqa: E402
from servers import Server, free_port  # noqa: E402
from strategies import TEXT, FuzzCase, first_cases  # noqa: E402

TARGETS = ("stock", "guardian", "supervise")
CANARY = FuzzCase(TEXT, json.dumps({"prompt": "canary", "max_tokens": 1}).encode(), ("canary",))
CANARY_TIMEOUT_S = 10.0
START_TIMEOUT_S = 90.0


def signal_or_code(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


class GroupServer(Server):
    """A supervisor in its own process group, so stopping it stops its engine child too."""

    def __init__(self, kind: str, command: list[str], port: int, log_path: Path, env: dict):
        self.kind, self.port, self.log_path = kind, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        with open(log_path, "w") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group: the supervisor and its child
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


class Target:
    """One kind of server, started again whenever a body breaks it."""

    def __init__(self, kind: str, model: Path, workdir: Path, env: dict):
        self.kind = kind
        self.model = model
        self.workdir = workdir
        self.env = env
        self.server: Optional[Server] = None
        self.starts = 0
        self.engine_restarts = 0    # the guardian's engine, in-process, summed over servers
        self.children_replaced = 0  # --supervise: children the supervisor replaced
        self._seen = {"restarts": 0, "children": 0, "pid": None}

    def command(self, port: int) -> list[str]:
        common = ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(port)]
        if self.kind == "stock":
            return [sys.executable, "-m", "mlx_lm", "server", *common]
        if self.kind == "supervise":
            return [sys.executable, "-m", "guardian", "--supervise", *common]
        return [sys.executable, "-m", "guardian", *common]

    def start(self) -> None:
        port = free_port()
        self.starts += 1
        log = self.workdir / f"{self.kind}-{self.starts}.log"
        server_class = GroupServer if self.kind == "supervise" else Server
        self.server = server_class(self.kind, self.command(port), port, log, self.env)
        if not self.server.wait_ready(START_TIMEOUT_S):
            raise SystemExit(f"{self.kind} did not start:\n" + "\n".join(self.server.log_tail(40)))
        self._seen = {"restarts": 0, "children": 0, "pid": None}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    @property
    def url(self) -> str:
        return self.server.url

    def get_json(self, path: str) -> Optional[dict]:
        try:
            return httpx.get(self.url + path, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None

    def check(self, client: httpx.Client) -> tuple[Optional[str], list[str]]:
        """After a body: (why the server must be started again, or None; what it did meanwhile)."""
        events = []
        if self.kind != "stock":
            events += self.guardian_events()
        code = self.server.proc.poll()
        if code is not None:
            return f"process died ({signal_or_code(code)})", events
        canary = send(client, self.url, CANARY, timeout=CANARY_TIMEOUT_S)
        if canary.status != 200:
            code = self.server.proc.poll()
            if code is not None:
                return f"process died ({signal_or_code(code)})", events
            # Stock's generation thread died: 404 on 0.32, a hang on 0.31.
            return f"stopped generating (canary: {canary.outcome})", events
        return None, events

    def guardian_events(self) -> list[str]:
        """Engine restarts and replaced children since the last look."""
        events = []
        if self.kind == "supervise":
            supervisor = self.get_json("/guardian/supervisor")
            if supervisor:
                replaced = supervisor.get("restarts", 0) - self._seen["children"]
                if replaced > 0:
                    self.children_replaced += replaced
                    last = supervisor.get("last_exit") or {}
                    events.append(f"child replaced ({last.get('reason', '?')})")
                self._seen["children"] = supervisor.get("restarts", 0)
                child = supervisor.get("child") or {}
                if child.get("pid") != self._seen["pid"]:
                    self._seen["pid"], self._seen["restarts"] = child.get("pid"), 0
        status = self.get_json("/guardian/status")
        if status and "restarts" in status:
            restarted = status["restarts"] - self._seen["restarts"]
            if restarted > 0:
                self.engine_restarts += restarted
                events.append(f"engine restarted ({restarted}x)")
            self._seen["restarts"] = status["restarts"]
        return events


def run_target(target: Target, cases: list[FuzzCase], timeout: float, progress: bool) -> dict:
    """Every case against one target; one record per case."""
    records = []
    breaks = []
    started = time.monotonic()
    target.start()
    bystander = Bystander(target.url)
    bystander.start()
    try:
        with httpx.Client() as client:
            for i, case in enumerate(cases):
                answer = send(client, target.url, case, timeout=timeout)
                broken, events = target.check(client)
                record = {"i": i, "outcome": answer.outcome, "s": answer.seconds}
                if events:
                    record["events"] = events
                if broken:
                    record["broke"] = broken
                    breaks.append({"i": i, "how": broken, "answer": answer.outcome})
                    target.stop()
                    target.start()
                    bystander.base_url = target.url
                records.append(record)
                if progress and (i + 1) % 500 == 0:
                    print(f"  {target.kind}: {i + 1}/{len(cases)} bodies, {len(breaks)} breaks, "
                          f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        bystander.stop()
        target.stop()
    return {
        "kind": target.kind,
        "seconds": round(time.monotonic() - started, 1),
        "records": records,
        "breaks": breaks,
        "server_starts": target.starts,
        "engine_restarts": target.engine_restarts,
        "children_replaced": target.children_replaced,
        "bystander": {"finished": bystander.finished, "hurt": [outcome for _, outcome in bystander.hurt]},
    }


# -- the report -------------------------------------------------------------------------
def status_class(outcome: str) -> str:
    head = outcome.split()[0]
    return f"{head[0]}xx" if head.isdigit() else head


def how_broken(how: str) -> str:
    """``process died (SIGSEGV)`` → ``SIGSEGV``; a canary's words kept short."""
    if how.startswith("process died ("):
        return how[len("process died ("):-1]
    if "timeout" in how:
        return "stopped generating (canary hangs)"
    if "generation thread died" in how:
        return "generation thread died (404s)"
    return how


def target_table(results: dict, cases: list[FuzzCase]) -> str:
    rows = []
    for kind, result in results.items():
        outcomes = Counter(r["outcome"] for r in result["records"])
        classes = Counter(status_class(o) for o in outcomes.elements())
        breaks = Counter(how_broken(b["how"]) for b in result["breaks"])
        top = ", ".join(f"{o} × {n}" for o, n in outcomes.most_common() if not o.startswith("2"))
        rows.append((kind, result, classes, breaks, top))
    lines = ["| | " + " | ".join(kind for kind, *_ in rows) + " |", "|---" * (len(rows) + 1) + "|"]

    def row(name, cell):
        lines.append(f"| {name} | " + " | ".join(cell(*r) for r in rows) + " |")

    row("bodies", lambda k, r, *_: str(len(r["records"])))
    row("took", lambda k, r, *_: f"{r['seconds'] / 60:.1f} min")
    for cls in ("2xx", "4xx", "5xx", "dropped", "timeout"):
        row(f"answers {cls}", lambda k, r, c, *_: str(c.get(cls, 0)))
    row("bodies that broke the server", lambda k, r, c, b, t: str(len(r["breaks"])))
    row("how", lambda k, r, c, b, t: ", ".join(f"{h} × {n}" for h, n in b.most_common()) or "—")
    row("engine restarts (/guardian/status)",
        lambda k, r, *_: "—" if k == "stock" else str(r["engine_restarts"]))
    row("children replaced (/guardian/supervisor)",
        lambda k, r, *_: str(r["children_replaced"]) if k == "supervise" else "—")
    row("bystander streams finished / hurt",
        lambda k, r, *_: f"{r['bystander']['finished']} / {len(r['bystander']['hurt'])}")
    return "\n".join(lines)


def table_outcome(outcome: str) -> str:
    """Stock's 400s carry free text (one per field and value): one row for all of them."""
    if outcome.endswith("(not OpenAI-shaped)") and "generation thread died" not in outcome:
        return outcome.split()[0] + ' `{"error": "text"}` (stock\'s refusal)'
    return outcome


def codes_table(results: dict) -> str:
    """Every non-2xx answer, by status and code, per target."""
    counts = {kind: Counter(table_outcome(r["outcome"]) for r in result["records"])
              for kind, result in results.items()}
    outcomes = sorted({o for c in counts.values() for o in c if not o.startswith("2")},
                      key=lambda o: (-sum(c.get(o, 0) for c in counts.values()), o))
    lines = ["| answer | " + " | ".join(counts) + " |", "|---" * (len(counts) + 1) + "|"]
    for outcome in outcomes:
        lines.append(f"| {outcome} | " + " | ".join(str(c.get(outcome, 0)) for c in counts.values()) + " |")
    return "\n".join(lines)


def stock_harm(result: dict) -> dict[int, str]:
    """Body index → what it did to stock: broke it (died, stopped generating), or got no proper answer."""
    harm = {b["i"]: how_broken(b["how"]) for b in result["breaks"]}
    for record in result["records"]:
        outcome = record["outcome"]
        if record["i"] not in harm and (outcome[0] in "5dt" or " then " in outcome or "error event" in outcome):
            harm[record["i"]] = f"answer: {outcome}"
    return harm


def killers_table(results: dict, cases: list) -> str:
    """Each mutation found in bodies that hurt stock: how often and how, and what the others answered.

    A body carries up to a few mutations; a mutation that hurt stock in
    (nearly) every body that had it is the cause. Listed: those that hurt it
    in at least half the bodies that had them.
    """
    stock = results.get("stock")
    if not stock:
        return ""
    hurt = stock_harm(stock)
    with_mutation = defaultdict(list)
    for i, case in enumerate(cases):
        for mutation in case.mutations or ("valid",):
            with_mutation[mutation].append(i)
    others = [kind for kind in results if kind != "stock"]
    rows = []
    for mutation, indices in with_mutation.items():
        hit = [i for i in indices if i in hurt]
        if not hit or len(hit) < 0.5 * len(indices):
            continue
        hows = Counter(hurt[i] for i in hit)
        cells = []
        for kind in others:
            records = results[kind]["records"]
            its_cases = results[kind].get("cases")
            if its_cases is not None:
                # Its run drew other bodies: its answers to its own bodies with this mutation.
                mine = [i for i, case in enumerate(its_cases) if mutation in (case.mutations or ("valid",))]
            else:
                mine = hit
            answers = Counter(table_outcome(records[i]["outcome"]) for i in mine if i < len(records))
            harm = sum(1 for i in mine if i < len(records) and ("broke" in records[i] or "events" in records[i]))
            cell = (f"({len(mine)} bodies of its own) " if its_cases is not None else "") + \
                ", ".join(f"{o} × {n}" for o, n in answers.most_common(3))
            cells.append(cell + (f"; **{harm} broke it or restarted its engine**" if harm else ""))
        rows.append((len(hit), f"| `{mutation}` | {len(indices)} | {len(hit)} | "
                     + ", ".join(f"{h} × {n}" for h, n in hows.most_common()) + " | " + " | ".join(cells) + " |"))
    if not rows:
        return ""
    lines = ["| mutation | bodies with it | hurt stock | how | " + " | ".join(others) + " |",
             "|---" * (4 + len(others)) + "|"]
    return "\n".join(lines + [line for _, line in sorted(rows, key=lambda r: -r[0])])


def guardian_harm_list(results: dict, cases: list[FuzzCase], limit: int = 40) -> str:
    """The bodies that broke, restarted or 5xx'd a guardian target: what to fix next."""
    lines = []
    for kind, result in results.items():
        if kind == "stock":
            continue
        its_cases = result.get("cases") or cases
        for record in result["records"]:
            bad = record.get("broke") or record.get("events") or record["outcome"][0] in "5dt"
            if bad:
                what = record.get("broke") or "; ".join(record.get("events", [])) or record["outcome"]
                lines.append(f"- {kind} #{record['i']}: {record['outcome']}; {what}\n  `{its_cases[record['i']].describe(200)}`")
    more = f"\n- ... {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bodies", type=int, default=10_000)
    parser.add_argument("--offset", type=int, default=0, help="skip this many bodies of the list first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a body may take")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: bench/results/...)")
    parser.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                        help="print the report of saved runs (the same bodies, one or more targets each)")
    args = parser.parse_args()
    if args.report:
        return report_saved(args.report)
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {TARGETS}")

    from guardian.demo_model import ensure_demo_model

    model = ensure_demo_model()
    mlx_lm_version = importlib.metadata.version("mlx-lm")
    drawn_at = time.monotonic()
    cases = drawn_cases(args.seed, args.offset, args.bodies)
    print(f"{len(cases)} bodies ready in {time.monotonic() - drawn_at:.0f} s", file=sys.stderr)

    # The code the servers start from: taken now, before the run (it can take an hour).
    commit = git_head()
    results = {}
    with tempfile.TemporaryDirectory(prefix="fuzz-campaign-") as workdir:
        hf_cache = Path(workdir) / "hf-cache"
        hf_cache.mkdir()
        # Offline, with an empty hub cache: a body naming a hub id fails at
        # once, and stock's /v1/models answers.
        env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1",
               "MLX_GUARDIAN_CACHE": str(model.parent)}
        for kind in targets:
            print(f"{kind}: {len(cases)} bodies", file=sys.stderr, flush=True)
            results[kind] = run_target(Target(kind, model, Path(workdir), env), cases, args.timeout, True)

    saved = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "mlx_lm": mlx_lm_version,
        "guardian_commit": commit, "seed": args.seed, "offset": args.offset, "timeout": args.timeout,
        "cases": [{"path": c.path, "label": c.label, "mutations": list(c.mutations), "body": c.describe(400)}
                  for c in cases],
        "results": results,
    }
    out = args.out or REPO / "bench" / "results" / (
        f"fuzz-{mlx_lm_version}-seed{args.seed}-{args.offset}-{args.offset + len(cases)}-{'-'.join(targets)}.json.gz")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(json.dumps(saved).encode()) if out.suffix == ".gz" else json.dumps(saved).encode())
    print(f"saved to {out}", file=sys.stderr)
    print_report([saved])


def drawn_cases(seed: int, offset: int, count: int) -> list[FuzzCase]:
    """The campaign's bodies: drawn once per seed and range, then read from bench/results/.

    Hypothesis draws the same bodies for the same seed only while the code it
    runs beside is the same: it mixes string constants from the loaded
    modules' source into its text. The bodies are kept, so runs made on
    other days (or after a commit) send the same ones.
    """
    path = REPO / "bench" / "results" / f"cases-seed{seed}-{offset}-{offset + count}.json.gz"
    if path.exists():
        saved = json.loads(gzip.decompress(path.read_bytes()))
        return [FuzzCase(c["path"], base64.b64decode(c["raw"]), tuple(c["mutations"]),
                         json_or_none(base64.b64decode(c["raw"]))) for c in saved]
    cases = first_cases(offset + count, seed=seed)[offset:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps([
        {"path": c.path, "raw": base64.b64encode(c.raw).decode(), "mutations": list(c.mutations)}
        for c in cases]).encode()))
    return cases


def json_or_none(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return None


class SavedCase:
    """A case as saved in the JSON: enough for the report."""

    def __init__(self, saved: dict):
        self.path, self.label, self.body = saved["path"], saved["label"], saved["body"]
        self.mutations = tuple(saved.get("mutations") or ([] if saved["label"] == "valid"
                                                          else saved["label"].split(" + ")))

    def describe(self, limit: int = 300) -> str:
        return self.body[:limit]


def aligned(result: dict, its_cases: list[dict], cases: list[dict]) -> dict:
    """``result``'s records in the order of ``cases``, matched by body; bodies it did not send are left out.

    Runs drawn before the bodies were kept (see drawn_cases) may hold
    different lists for the same seed.
    """
    by_body = {case["body"]: record for case, record in zip(its_cases, result["records"])}
    records = []
    for i, case in enumerate(cases):
        if case["body"] in by_body:
            records.append({**by_body[case["body"]], "i": i})
    same = len(records) == len(cases)
    if same:
        return {**result, "records": records}
    return {**result, "aligned": False, "cases": [SavedCase(c) for c in its_cases]}


def report_saved(paths: list[Path]) -> None:
    print_report([json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
                  for path in paths])


def print_report(runs: list[dict]) -> None:
    """One report for runs over the same bodies (same seed, offset and count), each with its targets."""
    first = runs[0]
    for run in runs[1:]:
        if (run["seed"], run["offset"], len(run["cases"])) != (first["seed"], first["offset"], len(first["cases"])):
            raise SystemExit("these runs did not send the same bodies (seed, offset or count differ)")
    cases = [SavedCase(c) for c in first["cases"]]
    results = {}
    for run in runs:
        for kind, result in run["results"].items():
            results[kind] = aligned(result, run["cases"], first["cases"]) if run is not first else result
    runs_described = "; ".join(f"{', '.join(run['results'])} at {run['when'][:16].replace('T', ' ')} UTC "
                               f"(guardian {run['guardian_commit']})" for run in runs)
    print(f"Fuzz campaign: mlx-lm {first['mlx_lm']}, {len(cases)} bodies (seed {first['seed']}, "
          f"from #{first['offset']}), timeout {first.get('timeout', 30):g} s; {runs_described}.\n")
    print(target_table(results, cases))
    print("\nAnswers other than 2xx:\n")
    print(codes_table(results))
    killers = killers_table(results, cases)
    if killers:
        print("\nWhat hurt stock (the mutations in at least half of whose bodies stock died, stopped "
              "generating, dropped the connection, hung or sent a 5xx), and how the others answered "
              "those bodies:\n")
        print(killers)
    harm = guardian_harm_list(results, cases)
    if harm:
        print("\nBodies that broke, restarted or got a 5xx / no answer from a guardian target:\n")
        print(harm)


def git_head() -> str:
    """The commit the guardian ran from, ``+dirty`` when its code had uncommitted changes."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=5).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--", "guardian", "plugins")
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")
    except OSError:
        return "?"


if __name__ == "__main__":
    main()

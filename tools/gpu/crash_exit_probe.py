"""How long a process on the GPU takes to die of SIGSEGV, and what it does meanwhile.

On the lent H200, a supervised child sent SIGSEGV did not exit within 30 s,
while a torch process exited at once. This runs, side by side, a bare mlx
process, a torch process, a one-process guardian and a supervised guardian,
SIGSEGVs each once it has used the GPU, and samples /proc/PID/status (State,
Threads, VmSize) until it is reaped. It also prints what decides a core dump
(core_pattern, RLIMIT_CORE), the usual reason a big process dies slowly.

    python3 tools/gpu/crash_exit_probe.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
READY = "ready\n"

MLX_CHILD = """
import os, sys, mlx.core as mx
a = mx.random.normal((1024, 1024)); mx.eval(a @ a)
print("device", mx.default_device(), flush=True); sys.stdout.write({ready!r}); sys.stdout.flush()
import time; time.sleep(600)
"""
TORCH_CHILD = """
import sys, torch
a = torch.randn(1024, 1024, device="cuda"); (a @ a).sum().item()
sys.stdout.write({ready!r}); sys.stdout.flush()
import time; time.sleep(600)
"""


def read_status(pid: int) -> dict:
    status = read_status_path(Path(f"/proc/{pid}/status"))
    return {key: status.get(key, "") for key in ("State", "Threads", "VmSize", "VmRSS", "SigCgt")}


def watch_death(pid: int, reap, limit_s: float = 40.0) -> dict:
    """SIGSEGV ``pid``; sample its status until ``reap()`` says it is gone."""
    samples, seen = [], None
    started = time.monotonic()
    os.kill(pid, signal.SIGSEGV)
    while time.monotonic() - started < limit_s:
        code = reap()
        if code is not None:
            return {"exit_s": round(time.monotonic() - started, 3), "returncode": code, "samples": samples}
        status = read_status(pid)
        key = (status.get("State"), status.get("Threads"))
        if key != seen:
            samples.append({"t": round(time.monotonic() - started, 3), **status})
            seen = key
        time.sleep(0.05)
    return {"exit_s": None, "samples": samples, "threads": thread_states(pid)}


def thread_states(pid: int) -> list[dict]:
    """Each thread's name, state, kernel wait channel and (as root) kernel stack."""
    threads = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        entry = {"tid": task.name}
        for name in ("comm", "wchan", "stack"):
            try:
                entry[name] = (task / name).read_text().strip()
            except OSError:
                pass
        entry["state"] = read_status_path(task / "status").get("State")
        threads.append(entry)
    return threads


def read_status_path(path: Path) -> dict:
    try:
        return dict((k, v.strip()) for k, v in (line.split(":", 1) for line in path.read_text().splitlines() if ":" in line))
    except OSError:
        return {}


def script_case(source: str) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", source.format(ready=READY)], stdout=subprocess.PIPE, text=True)
    line = ""
    while line != READY:
        line = proc.stdout.readline()
        if not line:
            return {"error": f"exited {proc.wait()} before ready"}
    result = watch_death(proc.pid, proc.poll)
    proc.kill()
    proc.wait()
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    return None


def guardian_case(supervise: bool, workdir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "guardian", "--port", str(port)] + (["--supervise"] if supervise else [])
    log_path = workdir / f"guardian-{'supervise' if supervise else 'single'}.log"
    env = {**os.environ, "MLX_GUARDIAN_CACHE": str(workdir / "models")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    try:
        def answered():
            try:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
                return httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
            except httpx.TransportError:
                return False
        if not wait_for(answered, 120):
            return {"error": "never served", "log": log_path.read_text()[-3000:]}
        if supervise:
            pid = httpx.get(url + "/guardian/supervisor", timeout=5).json()["child"]["pid"]
            def child_gone():
                # The supervisor reaps it; /proc/PID disappears (or turns to a zombie briefly).
                state = read_status(pid).get("State", "")
                return 0 if not state or state.startswith("Z") else None
            result = watch_death(pid, child_gone)
            new_pid = wait_for(lambda: (httpx.get(url + "/guardian/supervisor", timeout=5).json().get("child") or {}).get("pid") not in (None, pid), 60)
            result["replaced"] = bool(new_pid)
        else:
            result = watch_death(proc.pid, proc.poll)
        result["log_tail"] = log_path.read_text()[-2000:]
        return result
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/crash-exit-probe"))
    parser.add_argument("--cases", default="mlx,torch,single,supervise")
    options = parser.parse_args()
    options.workdir.mkdir(parents=True, exist_ok=True)
    facts = {
        "core_pattern": Path("/proc/sys/kernel/core_pattern").read_text().strip(),
        "core_pipe_limit": Path("/proc/sys/kernel/core_pipe_limit").read_text().strip(),
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE),
        "kernel": os.uname().release,
    }
    print(json.dumps(facts), flush=True)
    results = {"facts": facts}
    cases = {
        "mlx": lambda: script_case(MLX_CHILD),
        "torch": lambda: script_case(TORCH_CHILD),
        "single": lambda: guardian_case(False, options.workdir),
        "supervise": lambda: guardian_case(True, options.workdir),
    }
    for name in options.cases.split(","):
        started = time.monotonic()
        results[name] = cases[name]()
        summary = {k: v for k, v in results[name].items() if k != "log_tail"}
        print(name, round(time.monotonic() - started, 1), "s:", json.dumps(summary), flush=True)
    if options.out:
        options.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Server child processes for the benchmarks: started, polled, read, stopped.

Shared by the benchmarks, which run as scripts (``python bench/NAME.py``), so this folder is on their import path.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import httpx

START_TIMEOUT_S = 60.0


def cpu_split() -> tuple[set[int], set[int]] | None:
    """(the servers' CPU, the clients' CPUs), or None where pinning is not possible."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[-1]}, set(cpus[:-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_until(condition: Callable[[], object], timeout: float, interval: float = 0.05):
    """``condition()``'s first truthy result, or its last result at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval)


class Server:
    """A server child process on 127.0.0.1 whose output goes to a log file."""

    def __init__(self, kind: str, command: list[str], port: int, log_path: Path, env: dict,
                 cpus: Optional[set[int]] = None):
        """``cpus``: run the server on these CPUs only (Linux), threads it starts included."""
        self.kind = kind
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(log_path, "w") as log_file:
            self.proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=pin)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def health(self) -> int:
        """/health's status; 0 when nothing answers within a second."""
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code
        except httpx.HTTPError:
            return 0

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Whether /health answered 200 before the process died or the deadline."""
        return bool(poll_until(lambda: not self.alive() or self.health() == 200, timeout)
                    and self.alive())

    def log_events(self, name: str) -> list[dict]:
        """JSON log lines with this ``event``; plain-text lines (stock's) are skipped."""
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("event") == name:
                events.append(event)
        return events

    def log_tail(self, lines: int = 15) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[-lines:]

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``: a supervisor stops its child first
        (killed, it would leave the child to notice it was orphaned)."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=10)

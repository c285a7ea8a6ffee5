"""Test servers forked from one Python that has imported what every server imports.

A server a test starts spends about a second of CPU importing mlx_lm (transformers
above all) before it reads its arguments, and `make test` starts some six hundred
on two CPUs: a third of the suite's CPU went to the same imports. Here one process
per pytest session imports them once (``python -m tests.forkserver``, from the
repository, as ``python -m guardian`` runs), and each server is a fork of it that
runs ``guardian``'s ``__main__`` with the test's arguments, environment, working
folder and log file: a process of its own, signalled, paused and killed by its pid,
exiting with its own status, as a server started with ``subprocess`` is.

Linux only: on macOS a fork after the system's frameworks are loaded is unsafe, and
the tests start every server with ``subprocess`` there (``enabled``). So they do
here for a server with an environment of its own (read at import, it would not
apply) or any Popen argument, and everywhere with ``GUARDIAN_TEST_FORKSERVER=0``.

The protocol, one JSON object a line: the test side writes ``{"id", "args", "env",
"cwd", "log"}``; the fork server answers ``{"id", "pid"}`` once it forked, and
``{"exited": pid, "code"}`` once it reaped that child (the code as
``Popen.returncode`` gives it: negative for a signal).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
# How often the fork server looks for children that exited while it has some.
REAP_INTERVAL_S = 0.02


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("GUARDIAN_TEST_FORKSERVER", "1") != "0"


class Exit:
    """A forked child's end, once the fork server reaped it."""

    def __init__(self):
        self.event = threading.Event()
        self.code: Optional[int] = None


class ForkedProcess:
    """A server forked by the fork server: the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int, args: list[str], end: Exit):
        self.pid = pid
        self.args = args
        self._end = end
        self._exited = end.event

    @property
    def returncode(self) -> Optional[int]:
        return self._end.code if self._exited.is_set() else None

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._end.code

    def send_signal(self, signum: int) -> None:
        # Once reaped its pid may be another process's: as Popen, signal only the living.
        if not self._exited.is_set():
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class Forkserver:
    """The test side: one fork server for this pytest session, started at its first use."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._forked: dict[int, list] = {}  # request id -> [event, pid, Exit]
        self._living: dict[int, Exit] = {}  # pid -> its end, until it comes
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def spawn(self, args: list[str], log_path: Path, env: dict, cwd: Path, timeout: float = 30) -> ForkedProcess:
        log_path.write_bytes(b"")  # there at once, as a log a subprocess writes to is
        request_id = next(self._ids)
        forked = [threading.Event(), None, None]
        with self._lock:
            self._forked[request_id] = forked
            line = json.dumps({"id": request_id, "args": args, "env": env, "cwd": str(cwd), "log": str(log_path)})
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        if not forked[0].wait(timeout):
            raise RuntimeError(f"the fork server did not fork within {timeout} s (exit code {self.proc.poll()})")
        return ForkedProcess(forked[1], [sys.executable, "-m", "guardian", *args], forked[2])

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self._lock:
                if "exited" in reply:
                    end = self._living.pop(reply["exited"])
                    end.code = reply["code"]
                    end.event.set()
                else:
                    forked = self._forked.pop(reply["id"])
                    forked[1], forked[2] = reply["pid"], self._living.setdefault(reply["pid"], Exit())
                    forked[0].set()

    def close(self) -> None:
        self.proc.stdin.close()  # the fork server's end of input: it exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_forkserver: Optional[Forkserver] = None
_forkserver_lock = threading.Lock()


def forkserver() -> Forkserver:
    global _forkserver
    with _forkserver_lock:
        if _forkserver is None or _forkserver.proc.poll() is not None:
            _forkserver = Forkserver()
        return _forkserver


def close() -> None:
    with _forkserver_lock:
        if _forkserver is not None:
            _forkserver.close()


# -- the fork server's side -------------------------------------------------

def serve() -> None:
    """Import what every server imports, then fork a server for each request on
    standard input until it closes. No ``try``/``finally`` or ``with`` here: a child
    leaves through this frame with its SystemExit, and must run nothing of it."""
    import guardian.cli  # noqa: F401 (the imports every server makes)
    import guardian.stock  # noqa: F401 (mlx_lm.server, and with it transformers)

    children: set[int] = set()
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], REAP_INTERVAL_S if children else None)
        _reap(children)
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return  # the tests are done
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_server(request)  # never returns
            children.add(pid)
            _reply({"id": request["id"], "pid": pid})


def _reap(children: set[int]) -> None:
    for pid in list(children):
        reaped, status = os.waitpid(pid, os.WNOHANG)
        if reaped:
            children.discard(pid)
            _reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(message: dict) -> None:
    # Straight to the pipe: a child must find nothing of these in sys.stdout's buffer.
    os.write(1, json.dumps(message).encode() + b"\n")


def _run_server(request: dict) -> None:
    """In the child: become ``python -m guardian ARGS`` as a test would start it."""
    import runpy
    import threading

    # Python 3.11 leaves the thread's system id the fork server's after a fork (3.12 sets
    # it again); the watchdog finds the engine's threads by it (guardian.health.step_cpu).
    threading.current_thread()._set_native_id()

    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT, 0o644)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, 1 << 16)  # the fork server's pipes, and these two
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` puts its working folder first
    sys.argv = [sys.argv[0], *request["args"]]
    runpy.run_module("guardian", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


if __name__ == "__main__":
    serve()

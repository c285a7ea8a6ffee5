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
here for a supervisor (it carries no mlx), for a server whose environment is not
the fork server's (what is read at import would not apply) or that has Popen
arguments of its own, and everywhere with ``GUARDIAN_TEST_FORKSERVER=0``, which
tools/gpu/device_setup.sh sets: where mlx runs on CUDA a forked server's CUDA calls
fail ("initialization error").

The protocol, one JSON object a line: the test side writes ``{"id", "args", "env",
"cwd", "log"}`` (and ``"err"``, a file of its own for standard error, where a test reads
the two apart); the fork server answers ``{"id", "pid"}`` once it forked, and
``{"exited": pid, "code"}`` once that child ended (the code as ``Popen.returncode``
gives it: negative for a signal). The child stays a zombie, its pid its own, until
the test side has taken that in and writes ``{"reap": pid}``: a signal the tests send
a child not known to have ended never reaches another process that took its pid.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
# How often the fork server looks for children that exited while it has some.
REAP_INTERVAL_S = 0.02
# How long a spawn waits for the fork server's imports, at most once a session.
IMPORT_TIMEOUT_S = 60.0
# How long ``poll`` waits for the word of a child seen ended (a zombie).
ZOMBIE_WORD_S = 2.0
# Environment variables that may differ between the fork server and a server it forks,
# each read at run time, none at import: the session's model cache, which the tests set
# for each server; pytest's name of the test running; the terminal's size, which the
# session sets once running; and the MPI library mlx is told not to load, which guardian
# sets in its own process before mlx's distributed init (a test that runs that code set it
# in the session's, and every server after it started whole: a CI run).
PER_SERVER_ENV = ("MLX_GUARDIAN_CACHE", "PYTEST_CURRENT_TEST", "LINES", "COLUMNS", "MLX_MPI_LIBNAME")


def enabled() -> bool:
    return sys.platform == "linux" and os.environ.get("GUARDIAN_TEST_FORKSERVER", "1") != "0"


class Exit:
    """A forked child's end, once the fork server saw it."""

    def __init__(self):
        self.event = threading.Event()
        self.code: Optional[int] = None
        self.lost = False  # the fork server ended first: this end is unknown

    def result(self) -> int:
        if self.lost:
            raise RuntimeError("the fork server ended before this server: its exit status is unknown")
        return self.code


class ForkedProcess:
    """A server forked by the fork server: the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, pid: int, args: list[str], end: Exit):
        self.pid = pid
        self.args = args
        self._end = end
        self._exited = end.event

    @property
    def returncode(self) -> Optional[int]:
        return self._end.result() if self._exited.is_set() else None

    def poll(self) -> Optional[int]:
        """As Popen's: the exit status once the process has ended. A zombie (ended, its end
        not yet told) waits for the word, so that ``poll() is None`` means alive, as it
        does when the test's own process reaps."""
        if not self._exited.is_set() and self._is_zombie():
            self._exited.wait(ZOMBIE_WORD_S)
        return self.returncode

    def _is_zombie(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            return False

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._end.result()

    def send_signal(self, signum: int) -> None:
        # Not reaped before the tests know of its end: its pid is still its own.
        if not self._exited.is_set():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # as Popen: a process that has ended takes no signal
                pass

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class Forkserver:
    """The test side: one fork server for this pytest session."""

    def __init__(self, log_path: Path):
        self.log_path = log_path  # what it says itself (its imports' warnings, a crash)
        # Its environment once it imported (what guardian sets as it imports included):
        # every server it forks was imported under it. Told in its first line.
        self.env: Optional[dict] = None
        self._ready = threading.Event()
        self.told: set[str] = set()  # the names whose difference was told
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=REPO,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # apart: the reader must never wait on a full pipe
        self._ids = itertools.count(1)
        self._forked: dict[int, list] = {}  # request id -> [event, pid, Exit]
        self._living: dict[int, Exit] = {}  # pid -> its end, until it comes
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def serves(self, env: dict) -> bool:
        """Whether a server with environment ``env`` can be forked here: the fork server
        lives, and imported under the same environment."""
        if not self._ready.wait(IMPORT_TIMEOUT_S) or self.env is None or self.proc.poll() is not None:
            return False  # still importing, or it ended before it said it had
        differ = {k for k in env.keys() | self.env.keys()
                  if k not in PER_SERVER_ENV and env.get(k) != self.env.get(k)}
        if differ - self.told:
            self.told |= differ  # once a name: which servers start whole, and why
            sys.stderr.write(f"forkserver: a server started whole, its environment differs in {sorted(differ)}\n")
        return not differ

    def spawn(self, args: list[str], log_path: Path, env: dict, cwd: Path, timeout: float = 30,
              err_path: Optional[Path] = None) -> ForkedProcess:
        """Fork ``guardian ARGS``, its output in ``log_path`` (its standard error in
        ``err_path`` where given, else there too)."""
        request = {"args": args, "env": env, "cwd": str(cwd), "log": str(log_path)}
        for path in (log_path, err_path):
            if path is not None:
                path.write_bytes(b"")  # there at once, as a log a subprocess writes to is
        if err_path is not None:
            request["err"] = str(err_path)
        request_id = next(self._ids)
        forked = [threading.Event(), None, None]
        with self._lock:
            self._forked[request_id] = forked
        self._send({"id": request_id, **request})
        deadline = time.monotonic() + timeout
        while not forked[0].wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not fork (its exit code {self.proc.poll()}); "
                                   f"it said: {self.log_path.read_text()[-2000:]}")
        return ForkedProcess(forked[1], [sys.executable, "-m", "guardian", *args], forked[2])

    def _send(self, message: dict) -> None:
        with self._write_lock:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                reply = json.loads(line)
                if "imported_under" in reply:
                    self.env = reply["imported_under"]
                    self._ready.set()
                elif "exited" in reply:
                    with self._lock:
                        end = self._living.pop(reply["exited"])
                    end.code = reply["code"]
                    end.event.set()
                    self._send({"reap": reply["exited"]})  # known now: its pid may go
                else:
                    with self._lock:
                        forked = self._forked.pop(reply["id"])
                        forked[1], forked[2] = reply["pid"], self._living.setdefault(reply["pid"], Exit())
                    forked[0].set()
        except (OSError, ValueError):
            pass  # its pipes closed under us: the session is ending, or it died
        finally:
            self._ready.set()  # never ready, if it never said so: nothing waits for it
            # Whatever lives on is no longer watched: waiting on it must not hang.
            with self._lock:
                lost, self._living = list(self._living.values()), {}
            for end in lost:
                end.lost = True
                end.event.set()

    def close(self) -> None:
        self.proc.stdin.close()  # the fork server's end of input: it exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        # Said nothing: gone with the session (one a worker, every run, piled up in /tmp).
        # One that said something is kept for whoever reads why a server would not fork.
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size == 0:
                self.log_path.unlink()


_forkserver: Optional[Forkserver] = None


def start(log_path: Path) -> None:
    """The session's fork server, started before any test changes the environment."""
    global _forkserver
    if enabled():
        _forkserver = Forkserver(log_path)


def serving(env: dict) -> Optional[Forkserver]:
    """The fork server, if it can fork a server with environment ``env``."""
    return _forkserver if _forkserver is not None and _forkserver.serves(env) else None


def close() -> None:
    if _forkserver is not None:
        _forkserver.close()


# -- the fork server's side -------------------------------------------------

def serve() -> None:
    """Import what every server imports, then fork a server for each request on
    standard input until it closes. No ``try``/``finally`` or ``with`` here: a child
    leaves through this frame with its SystemExit, and must run nothing of it."""
    import guardian.cli  # noqa: F401 (the imports every server makes)
    import guardian.stock  # noqa: F401 (mlx_lm.server, and with it transformers)

    _reply({"imported_under": dict(os.environ)})

    running: set[int] = set()  # forked, not yet seen to end
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], REAP_INTERVAL_S if running else None)
        _tell_ends(running)
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return  # the tests are done
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "reap" in request:
                os.waitpid(request["reap"], 0)  # a zombie: at once
                continue
            pid = os.fork()
            if pid == 0:
                _run_server(request)  # never returns
            running.add(pid)
            _reply({"id": request["id"], "pid": pid})


def _tell_ends(running: set[int]) -> None:
    """Tell of each child that ended, leaving it a zombie until the tests know (WNOWAIT)."""
    for pid in list(running):
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if ended is not None:
            running.discard(pid)
            code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status
            _reply({"exited": pid, "code": code})


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
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT, 0o644) if "err" in request else log
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(err, 2)
    os.closerange(3, 1 << 16)  # the fork server's pipes, and these
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` puts its working folder first
    sys.argv = [sys.argv[0], *request["args"]]
    runpy.run_module("guardian", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


if __name__ == "__main__":
    serve()

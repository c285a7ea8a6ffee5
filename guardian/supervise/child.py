"""One child of the supervisor: the command that starts it, what the supervisor knows of
it while it runs, and how it went (the signal or exit code, and what that suggests).

Also the supervisor's private folder, where each child keeps the version of the
configuration it runs for the next one (guardian.config.in_force). Imports neither mlx
nor mlx_lm.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import psutil
import structlog

from guardian import exit_codes
from guardian.config.registry import ConfigError
from guardian.distributed.launch import LauncherProcess
from guardian.handoff import Channel
from guardian.supervise.fast_handoff import CHILD_HOST

log = structlog.get_logger("guardian.supervisor")


# Until a child is first ready, checks are cheap (refused, or an instant
# 503) and each one saved shortens the outage of a restart.
STARTUP_CHECK_INTERVAL_S = 0.1
# What a stock child runs (by name: importing it here would change nothing the child does).
STOCK_CHILD = "guardian.supervise.stock_child"


# Why a child died, gunicorn-style: the signal or exit code, and what it suggests.
SIGNAL_HINTS = {
    signal.SIGKILL: "perhaps out of memory?",
    signal.SIGSEGV: "native crash",
    signal.SIGBUS: "native crash",
    signal.SIGILL: "native crash",
    signal.SIGFPE: "native crash",
    signal.SIGABRT: "aborted, perhaps a failed native assertion",
    signal.SIGTERM: "terminated",
    signal.SIGINT: "interrupted",
}


@dataclass
class Child:
    """One engine process and the pooled HTTP client that talks to it."""

    proc: subprocess.Popen
    port: int
    generation: int
    # Stock mlx_lm.server unchanged (--engine stock): no /readyz, no relay key, no
    # tags, and it logs each request line as it came (http.server's log_message).
    stock: bool
    client: httpx.Client
    started_at: float = field(default_factory=time.monotonic)
    ready_at: Optional[float] = None
    last_ok: Optional[float] = None
    last_check_at: Optional[float] = None
    last_check: str = "not checked yet"
    last_status: Optional[int] = None  # its last check's HTTP status; None: no answer
    # Why it could not be ready (its model did not load), where the supervisor saw it and
    # stopped it: a stock child, whose exit says nothing (``Supervisor.check_health``).
    boot_failure: Optional[str] = None
    # Its engine died under the requests in flight, though its process lived on and the
    # supervisor stopped it: a stock child whose generation thread is gone. A crash, for
    # those requests (``crashed``).
    engine_died: bool = False
    says_stopping: bool = False  # its last check said it is stopping (a signal sent to it)
    says_busy: bool = False  # its last check said a step computes or pages past the stall limit, as allowed
    # Its checks get an HTTP answer (any status). One whose checks get none (frozen: SIGSTOP,
    # a process starved of its GIL or its CPU) takes no new requests (``Supervisor.holds``).
    answered: bool = True
    idle_stop: bool = False  # stopped for want of requests ([supervisor] idle_stop_s): none follows at once
    last_check_answered: bool = True  # the last check's, before a pause of the supervisor's is ruled out
    missed_checks: int = 0  # its checks in a row that got no answer
    unanswered_since: Optional[float] = None  # the first of them (monotonic)
    # Users' requests it completed, as its last /readyz said (a stock child's /health does not).
    requests_completed: int = 0
    # Stopping by its own doing (a signal sent to it, its engine given up), not the
    # supervisor's, which takes it as one being replaced (Supervisor.child_stops_on_its_own).
    stopped_on_its_own: bool = False
    # Its hand-off socket (guardian.handoff); None: every request is relayed.
    handoff: Optional[Channel] = None
    # Until then (monotonic) its requests are relayed: it could not open a hand-off.
    handoffs_paused_until: float = 0.0
    kill_reason: Optional[str] = None
    soft_killed_at: Optional[float] = None  # when it was sent SIGTERM, or seen stopping on its own (monotonic)
    hard_kill_at: Optional[float] = None
    hard_killed: bool = False
    # Why the supervisor sent SIGKILL: its grace passed, or a stop was asked for again.
    hard_kill_why: str = "after the grace"
    sighup_held: bool = False  # a SIGHUP came while it started: sent once it is ready
    paused_s: float = 0.0  # how long the supervisor was paused since it started this child
    # Its memory group's count of processes the kernel's OOM killer ended, and the file
    # that keeps it, at its start and then at each health check (guardian.supervise.oom_kills),
    # and whether that killer ended it (settled as it is reaped; None until then, and for a
    # SIGKILL no count tells).
    oom_counter: Optional[str] = None
    oom_kills_seen: Optional[int] = None
    oom_change_seen: Optional[tuple] = None  # a change of the two at the last check, not yet taken
    out_of_memory: Optional[bool] = None

    def hands_off(self) -> bool:
        """Whether a request may be handed to it now (``handoff``), not relayed."""
        return self.handoff is not None and time.monotonic() >= self.handoffs_paused_until

    @property
    def has_readyz(self) -> bool:
        return not self.stock

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def next_check_at(self, interval: float) -> float:
        """When the next health check is due; often while starting, to serve sooner; at once
        after a first check that got no answer, whose timeout was the wait (a frozen child
        takes new requests until a second one gets none too)."""
        if self.ready_at is None:
            interval = min(interval, STARTUP_CHECK_INTERVAL_S)
        elif self.missed_checks == 1:
            interval = 0.0
        return (self.last_check_at or self.started_at) + interval

    @property
    def stopped_by_supervisor(self) -> bool:
        """Whether the supervisor stopped this child (SIGTERM of its own), not the child itself."""
        return self.kill_reason is not None and not self.stopped_on_its_own


# How a child ends that stopped as it was asked by a signal sent to it, not by the
# supervisor (an operator's kill, a script's): 0 after its drain; a stock child, or one
# still starting, ends by the signal itself.
STOPPED_AS_ASKED = frozenset({exit_codes.EXIT_OK, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP})


def crashed(child: Child) -> bool:
    """Whether a child's end may be its requests' doing, so that those in flight are crash
    suspects: not when the supervisor stopped it, nor when it stopped as it was asked (a
    request in flight at two such stops was quarantined as a poison)."""
    if child.engine_died:
        return True  # stopped by the supervisor after its engine died under them
    if child.hard_killed or child.stopped_by_supervisor:
        return False  # the supervisor stopped it (one stopping on its own, SIGKILLed past its grace, too)
    if isinstance(child.proc, LauncherProcess) and child.proc.ranks_code is None:
        return True  # mlx.launch's own code, 0 whatever its ranks did: no rank left its code
    return child.proc.returncode not in STOPPED_AS_ASKED


def exit_reason(child: Child) -> str:
    """Why a child is gone, in words an operator can act on."""
    code = child.proc.returncode
    if code < 0:
        if child.hard_killed and -code == signal.SIGKILL:
            return f"hard-killed (SIGKILL) by the supervisor {child.hard_kill_why} ({child.kill_reason})"
        if child.out_of_memory:
            described = "killed by SIGKILL: the kernel's OOM killer (out of memory)"
        elif child.out_of_memory is False and -code == signal.SIGKILL:
            described = ("killed by SIGKILL from another process (not the kernel's OOM killer: "
                         "its memory group counted no OOM kill)")
        else:
            described = f"killed by {signal_name(-code)}: {SIGNAL_HINTS.get(-code, 'a signal')}"
    elif isinstance(child.proc, LauncherProcess) and child.proc.ranks_code is not None:
        rank = child.proc.ranks_code[0]
        described = f"the group ended: rank {rank}'s exit code {code}: {exit_codes.reason(code)}"
    elif isinstance(child.proc, LauncherProcess) and child.proc.codes_missing:
        described = (f"the group ended unasked and no rank left its exit code (one crashed or was "
                     f"killed first: mlx.launch's own lines say which): counted as exit code {code}")
    elif isinstance(child.proc, LauncherProcess) and child.stock:
        # mlx.launch exits 0 whatever its ranks did, and stock's ranks say nothing of theirs.
        described = f"the group ended (mlx.launch exit code {code}, whatever its stock ranks did)"
    elif isinstance(child.proc, LauncherProcess):
        # mlx.launch exits 0 whatever its ranks did; each rank logs its own code.
        described = (f"the group ended (mlx.launch exit code {code}; each rank logs its own "
                     "code: rank_stopped, server_stopped)")
    else:
        described = f"exit code {code}: {exit_codes.reason(code)}"
    if child.stopped_on_its_own:
        return f"{described}; {child.kill_reason}"
    if child.kill_reason:
        return f"{described}; the supervisor had sent SIGTERM: {child.kill_reason}"
    return described


def signal_name(signum: int) -> str:
    """SIGSEGV for 11; real-time signals have no name in the enum."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def child_command(options: argparse.Namespace, engine: str, child_args: list[str], port: int) -> list[str]:
    """The child's command line: the other flags, then the private address."""
    address = ["--host", CHILD_HOST, "--port", str(port)]
    if options.log_level is not None:
        child_args = [*child_args, "--log-level", options.log_level]
    if engine == "stock":
        # Stock's `python -m mlx_lm server` (on 0.31 and 0.32 without `python -m
        # mlx_lm.server`'s deprecation warning), ended when a thread of it dies (stock_child).
        return [sys.executable, "-m", STOCK_CHILD, "server", *child_args, *address]
    if options.log_format is not None:
        child_args = [*child_args, "--log-format", options.log_format]
    if options.guardian_config is not None:
        child_args = [*child_args, "--guardian-config", options.guardian_config]
    return [sys.executable, "-m", "guardian", *child_args, *address]


def names_a_model(child_args: list[str]) -> bool:
    """Whether the flags for the child name its model: ``--model``, as stock's argparse reads
    it (``--model=X`` too, and any prefix from ``--mo``: no other flag of stock's begins so)."""
    return any(len(name) >= 4 and "--model".startswith(name)
               for name in (arg.partition("=")[0] for arg in child_args))


class DemoModelUnavailable(Exception):
    """The demo model could not be built (its cache folder cannot be written): what
    ``python -m guardian.demo_model`` said, the fix named."""


def demo_model() -> str:
    """The demo model's folder (guardian.demo_model), for a stock child given no ``--model``
    (the guardian's own children find it themselves). Built, if not yet, in a process of its
    own: building imports mlx_lm, which the supervisor does not."""
    done = subprocess.run([sys.executable, "-m", "guardian.demo_model"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        raise DemoModelUnavailable(said[-1] if said else f"exit code {done.returncode}")
    return done.stdout.strip().splitlines()[-1]  # its last line: the path (a build may say more)


# mlx.launch's ``--env NAME=VALUE`` (in --launch-args) may carry a token (HF_TOKEN=...).
_ENV_VALUE = re.compile(r"((?:^|\s)--env(?:=|\s+)[^=\s]+=)\S+")


def loggable_command(command: list[str]) -> list[str]:
    """A child's command as logged: the values of mlx.launch's ``--env`` hidden."""
    hidden, after_env = [], False
    for arg in command:
        if after_env and "=" in arg:
            arg = arg.partition("=")[0] + "=***"
        else:
            arg = _ENV_VALUE.sub(r"\1***", arg)
        hidden.append(arg)
        after_env = arg == "--env"
    return hidden


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a child that binds its own after its model loads
    (stock, a group's rank 0). One that loses the race for it exits: stock with 1, and is
    replaced; a group's rank 0 with 2, which ends the supervisor too."""
    with socket.socket() as s:
        s.bind((CHILD_HOST, 0))
        return s.getsockname()[1]


def signal_quietly(proc: subprocess.Popen, signum: int) -> None:
    """Send a signal; a child that already exited is no error (reap tells why)."""
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


# What a request to the child through its client may raise when the child is gone: httpx's
# own errors, and RuntimeError from a client the supervisor closed as it reaped the child
# while a handler thread was asking it (a /readyz or a scrape answered nothing at all).
CHILD_GONE_ERRORS = (httpx.HTTPError, RuntimeError)


def close_quietly(client: httpx.Client) -> None:
    """Release the pool of a child that is gone; its sockets are already closed."""
    try:
        client.close()
    except Exception:  # noqa: BLE001 - nothing to save in a dead child's pool
        log.debug("child_client_close_failed", exc_info=True)


# The supervisor's private folder: the prefix, then its pid (guardian.config.in_force).
PRIVATE_FOLDER_PREFIX = "mlx-guardian-supervisor-"


def private_folder() -> tempfile.TemporaryDirectory:
    """A folder only this user reads, named with this process' pid; removed at exit. Those
    left by supervisors that were killed (SIGKILL, the OOM killer) go first: each held a
    copy of the configuration."""
    for path in Path(tempfile.gettempdir()).glob(PRIVATE_FOLDER_PREFIX + "*"):
        pid = path.name.removeprefix(PRIVATE_FOLDER_PREFIX).partition("-")[0]
        try:
            ours = path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if ours and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{PRIVATE_FOLDER_PREFIX}{os.getpid()}-")


# What a child reads for --guardian-config given as a pipe (``copy_of_a_pipe``).
CONFIG_FROM_PIPE = "config-from-pipe.toml"


def copy_of_a_pipe(path: str) -> tuple[tempfile.TemporaryDirectory, str]:
    """--guardian-config given as a pipe (a shell's ``<(...)``: settings kept off disk):
    its bytes, read once, in a private file that the supervisor and each child read
    instead. Each read of a pipe after the first is empty, and the supervisor reads the
    file three times at start: [access] and [http] went back to their defaults, and the
    child, whose /dev/fd the pipe is not, exited 2."""
    try:
        with open(path, "rb") as source:
            data = source.read()
    except OSError as e:  # a folder, a device, no permission: said as any unreadable file is
        raise ConfigError(f"{path}: cannot be read: {e}") from None
    try:
        folder = private_folder()
        copy = os.path.join(folder.name, CONFIG_FROM_PIPE)
        with open(copy, "wb") as kept:  # in a folder only this user reads
            kept.write(data)
    except OSError as e:  # no room, or no writable temporary folder
        raise ConfigError(f"{path} is a pipe, and its copy for the children cannot be written: {e}") from None
    return folder, copy

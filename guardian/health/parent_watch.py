"""A server never outlives the process that started it for a purpose.

``mlx.launch`` does not stop its ranks when it is itself killed (measured:
stock's ranks outlive a terminated ``mlx.launch``), and a supervisor that
is SIGKILLed (the OOM killer's favourite: the biggest process is its child,
but a cgroup kill takes both) would leave its child holding the model's
memory and a private port nobody relays to. On Linux the kernel sends the
process SIGTERM when its parent dies (``PR_SET_PDEATHSIG``); everywhere, a
thread also notices the parent's pid change (macOS has no prctl) and calls
``on_orphaned``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

import structlog

log = structlog.get_logger("guardian.parent_watch")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.5
# The pid of the supervisor that started this process or its group: for its direct child
# the parent to watch (its own reading comes seconds later, once mlx_lm is imported, and
# a parent that died meanwhile would leave it watching its new one); for a group's rank on
# its machine, a process to watch beside its launcher, which on macOS (no prctl) outlives
# a supervisor that was killed.
PARENT_PID_ENV = "MLX_GUARDIAN_SUPERVISOR_PID"
# What mlx.launch's start script exports to every rank it starts: this process is a rank,
# and its parent (on a remote machine, the ssh that runs it) is its launcher.
RANK_ENV = "MLX_RANK"
# A rank's launcher, read first thing (``leave_with_launcher_before_serving``): a rank that
# read it once joined (after mlx's import and the group's start, seconds) read the process
# that adopted it if the launcher had died meanwhile, and outlived its group for good.
_launcher: Optional[int] = None


def ask_for_sigterm_when_parent_dies() -> None:
    """Linux: the kernel sends SIGTERM when the parent dies (kept across exec); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("parent_death_signal_unavailable", errno=ctypes.get_errno())


# What each watched parent's death does now, by its pid: one watch thread per parent, whose
# action a later ``die_with_parent`` replaces (before serving: exit at once; serving: drain).
_on_orphaned: dict[int, Callable[[], None]] = {}
_watched = threading.Lock()


def die_with_parent(on_orphaned: Callable[[], None], parent: Optional[int] = None) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux), and watch its pid:
    ``parent``, the one expected, or the one this process has now. Called again for
    the same parent, it changes what the parent's death does."""
    parent = parent or os.getppid()
    with _watched:
        watching = parent in _on_orphaned
        _on_orphaned[parent] = on_orphaned
    if not watching:
        ask_for_sigterm_when_parent_dies()
        threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    # Checked at once as well: the parent may have died before prctl was set.
    while os.getppid() == parent:
        time.sleep(POLL_S)
    try:
        log.error("parent_gone", parent_pid=parent)
    except Exception:  # noqa: BLE001 - the log's pipe may have gone with the parent: leave all the same
        pass
    _on_orphaned[parent]()


def leave_with_supervisor_before_serving() -> None:
    """A supervisor's child, from its first moment: a supervisor gone before the child
    serves (killed as it imported, or loaded a model: minutes) leaves it nothing to
    serve for, and a service manager is starting another, model and all. It exits at
    once; ``die_with_parent`` once serving makes the death a drain."""
    supervisor = supervisor_pid()
    if supervisor is None:
        return
    if os.getppid() == supervisor:  # its child (a group's rank has its launcher between them)
        die_with_parent(_exit_before_serving, parent=supervisor)
    elif not _alive(supervisor):  # gone already
        _exit_before_serving()


def leave_with_launcher_before_serving() -> None:
    """A rank of an ``mlx.launch`` group, from its first moment: a launcher gone before
    the group serves leaves the rank no group (and its model's memory held by an orphan
    beside the next group). It exits at once; ``GroupMember.join`` makes a later death
    the group's failure, for this same parent (``launcher_pid``)."""
    global _launcher
    if RANK_ENV not in os.environ:
        return
    _launcher = os.getppid()
    die_with_parent(functools.partial(_exit_before_serving, "the mlx.launch that started this rank"),
                    parent=_launcher)


def launcher_pid() -> Optional[int]:
    """The pid of this rank's launcher as it was at start; None outside a group."""
    return _launcher


def _exit_before_serving(who: str = "the supervisor that started this process") -> None:
    # Logging may not be set up yet: a plain line, then out (nothing to drain).
    try:
        print(f"mlx-guardian: {who} is gone; exiting before serving", file=sys.stderr, flush=True)
    finally:
        os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def supervisor_pid() -> Optional[int]:
    """The pid of the supervisor that started this process, where one did (PARENT_PID_ENV)."""
    value = os.environ.get(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


def die_with_process(pid: int, on_gone: Callable[[], None]) -> None:
    """Watch a process that is not this one's parent: ``on_gone`` once it has ended."""
    threading.Thread(target=_watch_process, args=(pid, on_gone), name="supervisor-watch", daemon=True).start()


def _watch_process(pid: int, on_gone: Callable[[], None]) -> None:
    import psutil  # here, as in is_ancestor

    while psutil.pid_exists(pid):
        time.sleep(POLL_S)
    log.error("supervisor_gone", supervisor_pid=pid)
    on_gone()


def is_ancestor(pid: int) -> bool:
    """Whether ``pid`` is this process's parent, or its parent's, and so on: a process
    of this machine that started it (a pid in the environment of a rank on another
    host names some other process there)."""
    import psutil  # here: the supervisor reads this module's names, and needs no psutil

    try:
        return any(parent.pid == pid for parent in psutil.Process().parents())
    except psutil.Error:
        return False

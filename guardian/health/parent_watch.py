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


def ask_for_sigterm_when_parent_dies() -> None:
    """Linux: the kernel sends SIGTERM when the parent dies (kept across exec); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("parent_death_signal_unavailable", errno=ctypes.get_errno())


def die_with_parent(on_orphaned: Callable[[], None], parent: Optional[int] = None) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux), and watch its pid:
    ``parent``, the one expected, or the one this process has now."""
    parent = parent or os.getppid()
    ask_for_sigterm_when_parent_dies()
    threading.Thread(target=_watch, args=(parent, on_orphaned), name="parent-watch", daemon=True).start()


def _watch(parent: int, on_orphaned: Callable[[], None]) -> None:
    # Checked at once as well: the parent may have died before prctl was set.
    while os.getppid() == parent:
        time.sleep(POLL_S)
    log.error("parent_gone", parent_pid=parent)
    on_orphaned()


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

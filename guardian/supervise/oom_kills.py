"""Whether the kernel's OOM killer ended a child: its memory ran out, no request's fault.

The OOM killer ends a process with SIGKILL, which says nothing more: a user's
``kill -9`` looks the same. Linux counts the processes its OOM killer ended in
each memory group (cgroup v1's ``memory.oom_control``, v2's
``memory.events.local``, or ``memory.events``: ``oom_kill N``). The child's
group and its count are taken at its start and again at each health check: a
child that died of SIGKILL while its group's count rose since was ended for
memory. The group's, not the machine's (``/proc/vmstat``): there another
process's OOM kill, anywhere and at any time since, turned a ``kill -9`` of the
child into "out of memory" (a review; and a test's kill beside another test's
OOM kills, in one CI run). A group holds the service's own processes
(systemd's unit, a container). The kernel counts a kill just before it sends
its SIGKILL, and the child is reaped only once its exit is done (a large process
on a loaded machine: a while): a check in between that took the count afresh
took the child's own kill for another's (a CI run's "perhaps out of memory?"),
so a change is taken only from a child that outlived it. A child moved to
another group and killed before the next check is not told apart, nor is one
whose group has no such count, nor macOS's memory killer (jetsam): then the
SIGKILL is a crash, as before.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from guardian.admission.cgroup_memory import V1_MEMORY_ROOT, V2_ROOT, group_paths


def oom_counter_of(pid: int) -> Optional[str]:
    """The file that counts OOM kills in the memory group of process ``pid``, or None."""
    v2, v1 = group_paths(f"/proc/{pid}/cgroup")
    candidates = []
    if v1 is not None:
        candidates.append(os.path.join(V1_MEMORY_ROOT, v1.lstrip("/"), "memory.oom_control"))
    if v2 is not None:
        folder = os.path.join(V2_ROOT, v2.lstrip("/"))
        candidates += [os.path.join(folder, "memory.events.local"), os.path.join(folder, "memory.events")]
    return next((path for path in candidates if os.path.exists(path)), None)


def oom_kills_in(counter: Optional[str]) -> Optional[int]:
    """The ``oom_kill`` count in ``counter`` (an ``oom_counter_of`` file), or None."""
    if counter is None:
        return None
    try:
        with open(counter) as lines:
            for line in lines:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


# Linux's /proc: the bit of SIGKILL in a pending mask (SigPnd, ShdPnd), and the flag
# (PF_EXITING, /proc/PID/stat's ninth field) of a task past its last signal.
SIGKILL_PENDING = 1 << (signal.SIGKILL - 1)
PF_EXITING = 0x4


def dying(pid: int) -> bool:
    """Whether process ``pid`` (a child not yet reaped) is on its way out: SIGKILL pending,
    its main thread exiting, a zombie, or gone. A sent SIGKILL is pending until the thread
    takes it, and the thread is exiting from then on."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in ("SigPnd", "ShdPnd") and int(value, 16) & SIGKILL_PENDING:
                    return True
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()  # past the name, which may hold spaces
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)
    except (OSError, ValueError, IndexError):
        return True


def note_memory_group(child) -> None:
    """Take ``child``'s memory group and its count of OOM kills now: at its start, and at
    each health check that finds them changed (another process's kill, a move) while the
    child lives on, found so at the check before too. A change may be the child's own
    kill: the kernel counts it just before it sends SIGKILL, and the child is reaped only
    once its exit is done; then it is dying, and its count as it was tells the kill as it
    is reaped (``killed_for_memory``)."""
    counter = oom_counter_of(child.pid)
    now = (counter, oom_kills_in(counter))
    if child.oom_kills_seen is not None and now != (child.oom_counter, child.oom_kills_seen):
        if now != child.oom_change_seen or dying(child.pid):
            child.oom_change_seen = now
            return
    child.oom_counter, child.oom_kills_seen = now
    child.oom_change_seen = None


def killed_for_memory(child) -> Optional[bool]:
    """Whether the kernel's OOM killer ended ``child`` (a ``Child`` just reaped): SIGKILL, not
    the supervisor's, while its group's count rose since it was last taken. None where that
    cannot be told: a SIGKILL with no count to read (macOS, a group that keeps none). The count
    is of every OOM kill of the group's processes, the machine's own OOM killer's too, so a
    SIGKILL it did not rise for came from another process (``kill -9``)."""
    if child.proc.returncode != -signal.SIGKILL or child.hard_killed:
        return False
    if child.oom_kills_seen is None:
        return None
    now = oom_kills_in(child.oom_counter)
    return None if now is None else now > child.oom_kills_seen

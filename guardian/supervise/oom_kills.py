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
(systemd's unit, a container). A child moved to another group and killed
before the next check is not told apart (its group read from a zombie is the
root's), nor is one whose group has no such count, nor macOS's memory killer
(jetsam): then the SIGKILL is a crash, as before.
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


def note_memory_group(child) -> None:
    """Take a living ``child``'s memory group and its count of OOM kills now."""
    child.oom_counter = oom_counter_of(child.pid)
    child.oom_kills_seen = oom_kills_in(child.oom_counter)


def killed_for_memory(child) -> bool:
    """Whether the kernel's OOM killer ended ``child`` (a ``Child`` just reaped): SIGKILL, not
    the supervisor's, while its group's count rose since it was last taken."""
    if child.proc.returncode != -signal.SIGKILL or child.hard_killed or child.oom_kills_seen is None:
        return False
    now = oom_kills_in(child.oom_counter)
    return now is not None and now > child.oom_kills_seen

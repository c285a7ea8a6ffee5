"""Whether the kernel's OOM killer ended a child: its memory ran out, no request's fault.

The OOM killer ends a process with SIGKILL, which says nothing more: a user's
``kill -9`` looks the same. Linux counts the processes its OOM killer ended
(``/proc/vmstat``'s ``oom_kill``, 4.13 on; a memory group's limit counts too).
The count is the machine's, not the child's (and not a container's own), so it
is taken again at each health check: a child that died of SIGKILL while the
count rose since the last one (within about ``--supervisor-interval``) was ended
for memory. Another process's OOM kill in that moment, beside a ``kill -9`` of
the child, would be taken for it. A count taken just after the kill and before
the reap misses it: then the child is a crash, as before. macOS's memory killer
(jetsam) is not told apart.
"""

from __future__ import annotations

import signal
from typing import Optional


def oom_kills() -> Optional[int]:
    """How many processes the kernel's OOM killer has ended since boot, or None where not told."""
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def killed_for_memory(child) -> bool:
    """Whether the kernel's OOM killer ended ``child`` (a ``Child`` just reaped): SIGKILL, not
    the supervisor's, while the count rose since its last health check."""
    if child.proc.returncode != -signal.SIGKILL or child.hard_killed or child.oom_kills_seen is None:
        return False
    now = oom_kills()
    return now is not None and now > child.oom_kills_seen

"""The memory a Linux control group lets this process use, where one limits it.

A service manager's limit (systemd's ``MemoryMax=``, a container's memory
limit) ends the process by the kernel's OOM killer once its group's memory
reaches it: no exception, no trim, no 429 first. mlx's CPU backend knows only
the machine's memory, so the memory guard compared what mlx holds with memory
the process could never have (a hunt: a supervised child under an 88 MB limit
was killed five times, and requests in flight at two kills were quarantined
though each fitted alone, while the guard measured against 20 GB).

The limit is the lowest of the group's and its ancestors' (a parent's limit
holds its children too): ``memory.max`` under cgroup v2, ``memory.limit_in_bytes``
under v1's memory controller, at their usual mounts (``/sys/fs/cgroup`` and
``/sys/fs/cgroup/memory``). None where nothing limits it or nothing can be read
(macOS, or a group whose files are not mounted here).
"""

from __future__ import annotations

import os
from typing import Optional

V2_ROOT = "/sys/fs/cgroup"
V1_MEMORY_ROOT = "/sys/fs/cgroup/memory"
# v1 writes "no limit" as the largest multiple of the page size below 2**63.
V1_NO_LIMIT = 1 << 62


def group_paths(proc_cgroup: str = "/proc/self/cgroup") -> tuple[Optional[str], Optional[str]]:
    """This process's group under v2 and under v1's memory controller ("/a/b"), each or None."""
    v2 = v1 = None
    try:
        with open(proc_cgroup) as lines:
            for line in lines:
                hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and controllers == "":
                    v2 = path
                elif "memory" in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def _limit_in(folder: str, name: str) -> Optional[int]:
    try:
        with open(os.path.join(folder, name)) as file:
            text = file.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit here
    value = int(text)
    return value if value < V1_NO_LIMIT else None


def lowest_limit(root: str, path: str, name: str) -> Optional[tuple[int, str]]:
    """The lowest ``name`` of the group at ``path`` under ``root`` and its ancestors: (bytes, file)."""
    lowest = None
    parts = [part for part in path.split("/") if part]
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(root, *parts[:depth])
        limit = _limit_in(folder, name)
        if limit is not None and (lowest is None or limit < lowest[0]):
            lowest = (limit, os.path.join(folder, name))
    return lowest


def cgroup_memory_limit() -> Optional[tuple[int, str]]:
    """(bytes, the file that says so): the memory this process's control group may use, or
    None where no limit is set or none can be read."""
    v2, v1 = group_paths()
    found = []
    if v2 is not None and os.path.exists(os.path.join(V2_ROOT, "cgroup.controllers")):
        found.append(lowest_limit(V2_ROOT, v2, "memory.max"))
    if v1 is not None:
        found.append(lowest_limit(V1_MEMORY_ROOT, v1, "memory.limit_in_bytes"))
    found = [limit for limit in found if limit is not None]
    return min(found) if found else None

"""Arming files for the test plugins' faults: a file that exists arms one use, N for one
holding the number N; each use takes one off, and the last removes the file."""

from __future__ import annotations

import os


def disarm(path: str) -> bool:
    """Whether the arming file was there: one use of it."""
    try:
        with open(path) as armed:
            left = int(armed.read().strip() or 1) - 1
        if left > 0:
            with open(path, "w") as armed:
                armed.write(str(left))
        else:
            os.remove(path)
    except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError):
        return False
    return True

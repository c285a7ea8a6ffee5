"""Where a thread is now, as a log line can hold it: the innermost frames of its Python stack.

A stall says how long the engine made no progress; where its loop thread was waiting says
why (in mlx's evaluation, in stock's step, in a plugin's hook, on a lock), and which
failures are the same one. ``sys._current_frames`` is the only way to read another
thread's stack; it is CPython's, documented, and works on macOS and Linux alike.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import PurePath
from typing import Optional

# Enough frames to reach from a blocking call out to the guardian's and stock's code.
FRAMES = 12


def stack_of(thread_ident: Optional[int], frames: int = FRAMES) -> list[str]:
    """The thread's innermost ``frames`` frames, outermost first, each
    ``folder/file.py:line in function``; empty if the thread is gone (or none was named)."""
    if thread_ident is None:
        return []
    frame = sys._current_frames().get(thread_ident)  # noqa: SLF001 - documented, CPython's
    if frame is None:
        return []
    # The file's folder and name (``mlx_lm/generate.py``) say whose code it is; the rest of
    # the path is the machine's.
    return [f"{'/'.join(PurePath(summary.filename).parts[-2:])}:{summary.lineno} in {summary.name}"
            for summary in traceback.extract_stack(frame, limit=frames)]

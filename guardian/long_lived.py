"""What lives as long as the process, kept out of the cyclic collector's way.

Python's collector walks every tracked object on a full collection. After a
model is loaded that is ~90,000 objects (modules, mlx_lm's classes, the
model's modules and weights), ~50 ms on a 2-core machine, with the GIL
held: every thread waits, the reader that answers /health and accepts
connections included. A flood of connections churns enough objects to bring
a full collection every few seconds (measured with bench/door_load.py: the
reader stalled 75-85 ms inside one accept). ``gc.freeze()`` moves what exists
at start to a generation no collection walks, as gunicorn's preloading
workers and Instagram's servers do; what is allocated later (requests,
connections, a restarted loop's batch and cache) is collected as before.

A frozen object is still freed when its last reference goes; only a cycle
of frozen objects would stay. So a reload of the model (which drops the
old weights) thaws everything first, and from then on collections walk
everything again, as before this module, until the process restarts. The
engine's loop, its batch and its caches are made after the freeze (a
restarted loop's are collected as ever).
"""

from __future__ import annotations

import gc


def freeze() -> int:
    """Leave everything allocated so far out of every later collection; how many objects that is.

    Collects first, so no garbage is frozen with the rest.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Let collections walk what ``freeze`` left out again (before a reload frees the old model)."""
    gc.unfreeze()

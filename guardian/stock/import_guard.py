"""Importing mlx_lm without its side effect on the open-files limit (guardian.serving.open_files says
why it matters).
"""

from __future__ import annotations

import contextlib
import resource


@contextlib.contextmanager
def never_lowered():
    """Within: a library's ``setrlimit(RLIMIT_NOFILE, ...)`` may raise the limit, never lower it."""
    real = resource.setrlimit

    def setrlimit(kind, limits):
        if kind == resource.RLIMIT_NOFILE:
            soft, hard = resource.getrlimit(kind)
            wanted_soft, wanted_hard = limits
            # Quietly: this runs at import, before logging is set up.
            limits = (max(soft, wanted_soft), hard if hard == resource.RLIM_INFINITY else max(hard, wanted_hard))
        real(kind, limits)

    resource.setrlimit = setrlimit
    try:
        yield
    finally:
        resource.setrlimit = real

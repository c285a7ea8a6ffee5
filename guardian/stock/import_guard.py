"""Importing mlx_lm without its side effect on the open-files limit (guardian.serving.open_files says
why it matters).
"""

from __future__ import annotations

import contextlib
import resource


@contextlib.contextmanager
def never_lowered():
    """Within: a library's ``setrlimit(RLIMIT_NOFILE, ...)`` may raise the soft limit
    up to the hard one, and lowers neither (mlx_lm's (2048, 4096) would also raise
    a hard limit under 4096, which an unprivileged process may not: stock fails to import there)."""
    real = resource.setrlimit

    def setrlimit(kind, limits):
        if kind == resource.RLIMIT_NOFILE:
            soft, hard = resource.getrlimit(kind)
            wanted_soft, _ = limits
            # Quietly: this runs at import, before logging is set up.
            raised = max(soft, wanted_soft)
            limits = (raised if hard == resource.RLIM_INFINITY else min(raised, hard), hard)
        real(kind, limits)

    resource.setrlimit = setrlimit
    try:
        yield
    finally:
        resource.setrlimit = real

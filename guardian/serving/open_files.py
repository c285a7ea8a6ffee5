"""How many connections the process may hold: its open-files limit.

Each connection held is a file descriptor. A server that holds thousands of
idle or slow clients (the connection layer's job) needs a soft limit well
above the usual 1024, and mlx_lm lowers it further: importing
``mlx_lm.utils`` sets it to (2048, 4096), hard limit included, which no
unprivileged process can raise again. At 2,048 the door stops accepting, and
a client queued behind the flood waits until some connection times out.
"""

from __future__ import annotations

import resource


# macOS reports an unlimited hard limit but refuses a soft one above
# kern.maxfilesperproc: try these, highest first.
CANDIDATE_LIMITS = (1 << 20, 1 << 16, 10240)


def raise_open_files_limit() -> int:
    """Raise the soft limit to the hard one (as Go's runtime does); the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, *CANDIDATE_LIMITS):
        if target == resource.RLIM_INFINITY or target <= soft or (hard != resource.RLIM_INFINITY and target > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        return target
    return soft

"""How long the calling thread waited for a core: on a loaded machine, no pause.

A thread that is ready to run waits in the kernel's run queue while other
work holds every core (other processes on a busy machine, CI's test workers).
Linux counts that wait per thread (``/proc/thread-self/schedstat``, its second
field, nanoseconds), and adds each wait as the thread gets its core: read on
the thread itself, the count holds the wait that just ended. A stopped
process (SIGSTOP, a debugger, a frozen cgroup) is in no run queue, nor is one
whose threads wait on the disk (a swap storm): their time is not counted, so
it tells a process starved of CPU from a paused one (``StallDetector``'s
lateness; measured: a watchdog thread at nice 19 beside two busy processes on
its core was late 2.27 s over 60 looks, 2.26 s of it in the run queue).
Elsewhere (macOS, a kernel without schedstats) the count reads 0.0: every
late look is then taken as before.
"""

from __future__ import annotations

SCHEDSTAT = "/proc/thread-self/schedstat"


def run_queue_wait_s() -> float:
    """The calling thread's time waiting in the run queue so far, in seconds; 0.0 unknown."""
    try:
        with open(SCHEDSTAT) as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0

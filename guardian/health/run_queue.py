"""How long a thread of the process waited for a core: on a loaded machine, no pause.

A thread that is ready to run waits in the kernel's run queue while other
work holds every core (other processes on a busy machine, CI's test workers).
Linux counts that wait per thread (``/proc/self/task/TID/schedstat``, its
second field, nanoseconds), adding each wait as the thread gets its core. A
stopped process (SIGSTOP, a debugger, a frozen cgroup) is in no run queue, nor
is one whose threads wait on the disk (a swap storm): their time is not
counted, so it tells a process starved of CPU from a paused one
(``StallDetector``'s lateness). Any thread's, not only the watchdog's own: a
watchdog late behind the GIL waits on a lock, not in the run queue, while the
thread that holds the GIL may wait there (with the watchdog's own wait alone
taken off, a look 1.0 s late was still a pause, the whole server at nice 19
beside busy processes on its core, under more load besides). The longest one
thread waited, not their sum: as a paused process resumes, every one of its
threads is woken at once and each waits a little for a core, and their sum
took most of a 2 s SIGSTOP away (a CI-like run: 1.5 s or less was left of
it). Measured: a watchdog thread at nice 19 beside two busy processes on its
core was late 2.27 s over 60 looks, 2.26 s of it in the run queue. Elsewhere (macOS, a kernel without schedstats) nothing is read: 0.0,
and every late look is taken as before.
"""

from __future__ import annotations

import os

from guardian.health.step_cpu import TASKS  # every thread of this process, as the step's readings read them


class RunQueueWait:
    """The process's threads' time in the run queue, a reading at a time."""

    def __init__(self):
        self._seen: dict[str, int] = self._read()

    @staticmethod
    def _read() -> dict[str, int]:
        waits = {}
        try:
            tids = os.listdir(TASKS)
        except OSError:
            return waits
        for tid in tids:  # os.open and os.read: a third of open()'s cost, at every look
            try:
                fd = os.open(f"{TASKS}/{tid}/schedstat", os.O_RDONLY)
                try:
                    waits[tid] = int(os.read(fd, 128).split()[1])
                finally:
                    os.close(fd)
            except (OSError, ValueError, IndexError):  # a thread gone meanwhile
                continue
        return waits

    def since_last(self) -> float:
        """The longest any one of the process's threads waited for a core since the last
        reading (since it started, for a thread new since), in seconds."""
        now = self._read()
        waited = max((ns - self._seen.get(tid, 0) for tid, ns in now.items()), default=0)
        self._seen = now
        return max(0, waited) / 1e9

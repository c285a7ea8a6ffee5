"""Whether a step that outlasts the stall limit computes, pages or waits.

A step that never returns waits (a deadlock, a collective whose peer is
gone) and uses no CPU; a long step that computes (kernels compiling, a long
prefill on the CPU) does, and one slowed by a passing shortage of memory
pages: its memory, swapped out, is read back from disk a page at a time,
and its threads wait on the disk, not on a lock. The watchdog gives the
second and third more time (``[watchdog] stall_busy_extra_s``).

Computing is judged by the CPU time of the engine's
threads while its heartbeat stands still: its loop thread, and the threads
of the process that Python did not start. mlx's CPU backend runs its
kernels on mlx's own stream threads, not on the thread that called
``mx.eval`` (measured: 0.005 s of a 36 s matmul loop on the calling
thread, the rest on mlx's); Python's other threads (HTTP handlers, the
watchdog, loops a stall abandoned) are left out.

psutil lists every thread of the process with its CPU times. Its thread ids
are the system's (Python's ``Thread.native_id``) on Linux; on macOS psutil
numbers the threads instead, so Python's cannot be told from mlx's there:
no reading of CPU (None), and only paging is seen.

Paging is judged by the process's major page faults (``getrusage``: each a
page read from disk), at least ``PAGING_FAULTS_PER_S`` while the heartbeat
stands still. The whole process's: whichever thread faults, its memory is
short, and a step that needs memory waits for the same disk. (Measured on
Linux. macOS reports its page-ins there; a page its memory compressor gives
back without reading the disk is no major fault, so paging from the
compressor alone is not seen.)

Readings are taken on the watchdog's thread only while the heartbeat stands
still with work waiting, at most one per ``READ_EVERY_S``: nothing on the
loop's hot path, nothing while steps come quickly.
"""

from __future__ import annotations

import resource
import threading
from collections import deque
from typing import Callable, Optional

try:
    import psutil
except ImportError:  # pragma: no cover - a declared dependency; without it, no reading
    psutil = None

# The share of one core the engine's threads use for a step to count as
# computing. A step stuck in a wait measured 0%; one computing 69%, and 13%
# on a 2-core machine with a load average of 5.5 (its Python loop also
# contended for the GIL).
BUSY_CPU_SHARE = 0.05
# Major page faults a second for a step to count as paging: a process that is not
# paging takes none in a step (its model was read at load); one whose memory is
# swapped out takes hundreds to thousands (a 4 KB page, or macOS's 16 KB, a fault).
PAGING_FAULTS_PER_S = 20.0
# Both are measured over about the last WINDOW_S of the still heartbeat,
# once it spans MIN_SPAN_S (Linux counts CPU time in 10 ms ticks: 2% of it).
WINDOW_S = 1.0
MIN_SPAN_S = 0.5
READ_EVERY_S = 0.2


def engine_cpu_reader() -> Optional[Callable[[int], Optional[float]]]:
    """A function of the loop thread's ident: CPU seconds the engine's threads
    have used, or None when unknown now. None: unavailable on this platform."""
    if psutil is None:
        return None
    process = psutil.Process()

    def read(loop_ident: int) -> Optional[float]:
        python_threads = {t.ident: t.native_id for t in threading.enumerate()}
        loop_native = python_threads.get(loop_ident)
        if loop_native is None:
            return None
        others = set(python_threads.values()) - {loop_native}
        try:
            threads = process.threads()
        except psutil.Error:
            return None
        if not any(t.id == loop_native for t in threads):
            return None  # psutil's thread ids are not the system's (macOS)
        return sum(t.user_time + t.system_time for t in threads if t.id not in others)

    return read if read(threading.get_ident()) is not None else None


def major_faults() -> int:
    """The process's major page faults so far: pages read from disk."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class StepCpu:
    """The CPU share of the engine's threads, and the process's paging, while one
    heartbeat stands still."""

    def __init__(self, reader: Optional[Callable[[int], Optional[float]]] = None,
                 faults: Callable[[], int] = major_faults):
        self.reader = reader if reader is not None else engine_cpu_reader()
        self.faults = faults
        self._beat: Optional[float] = None
        # (when, CPU seconds or None where unknown, major faults) while this beat stood
        self._readings: deque[tuple[float, Optional[float], int]] = deque()
        self.share: Optional[float] = None  # over about the last WINDOW_S, once known
        self.faults_per_s: Optional[float] = None  # likewise

    @property
    def reads_cpu(self) -> bool:
        """Whether the engine's threads' CPU time is readable here (not on macOS)."""
        return self.reader is not None

    def observe(self, *, beat: float, now: float, loop_ident: Optional[int]) -> None:
        """One look while work waits: ``beat`` the engine's last heartbeat."""
        if beat != self._beat:
            self.forget()
            self._beat = beat
            return  # a moving heartbeat: nothing to read
        readings = self._readings
        if loop_ident is None or (readings and now - readings[-1][0] < READ_EVERY_S):
            return
        cpu = self.reader(loop_ident) if self.reader is not None else None
        faults = self.faults()
        readings.append((now, cpu, faults))
        # About the last WINDOW_S: the oldest goes once the next one is that old.
        while len(readings) > 2 and now - readings[1][0] >= WINDOW_S:
            readings.popleft()
        began, cpu_then, faults_then = readings[0]
        span = now - began
        if span >= MIN_SPAN_S:
            # A CPU reading missing at either end (the loop's thread not found): unknown.
            known = cpu is not None and cpu_then is not None
            self.share = max(0.0, cpu - cpu_then) / span if known else None
            self.faults_per_s = max(0, faults - faults_then) / span

    def forget(self) -> None:
        """Start over (a new beat; after a pause of the process a window spanning it measures nothing)."""
        self._beat, self.share, self.faults_per_s = None, None, None
        self._readings.clear()

    def computing(self) -> bool:
        """The engine's threads compute while this heartbeat stands still (over about the last WINDOW_S)."""
        return self.share is not None and self.share >= BUSY_CPU_SHARE

    def paging(self) -> bool:
        """The process reads pages from disk while this heartbeat stands still."""
        return self.faults_per_s is not None and self.faults_per_s >= PAGING_FAULTS_PER_S

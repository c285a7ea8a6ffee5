"""Whether a step that outlasts the stall limit computes, pages or waits.

A step that never returns waits (a deadlock, a collective whose peer is
gone) and uses no CPU; a long step that computes (kernels compiling, a long
prefill on the CPU) does, and one slowed by a passing shortage of memory
pages: its memory, swapped out, is read back from disk a page at a time,
and its threads wait on the disk, not on a lock. The watchdog gives the
second and third more time (``[watchdog] stall_busy_extra_s``).

Both are judged by the engine's threads while its heartbeat stands still:
its loop thread, and the threads of the process that Python did not start.
mlx's CPU backend runs its kernels on mlx's own stream threads, not on the
thread that called ``mx.eval`` (measured: 0.005 s of a 36 s matmul loop on
the calling thread, the rest on mlx's); Python's other threads (HTTP
handlers, the watchdog, loops a stall abandoned) are left out. A loop a stall
abandoned that still pages (its step went on) made a stuck step beside it
look as if it paged: a hunt, 10 s late, "paging" at no fault of its own.

Linux lists every thread of the process with its CPU time and major page
faults (``/proc/self/task/TID/stat``; TID is Python's ``Thread.native_id``),
and its state: running or ready to run (``R``), or asleep. A step computes
at ``BUSY_CPU_SHARE`` of a core or more, or when one of those threads is
running or ready to run at ``RUNNABLE_SHARE`` of the looks or more: on a
loaded machine a step that computes gets little of a core and waits in the
run queue for the rest (CI, load ~11 on 2 cores: a computing step at just
under 5% of a core was judged stuck), while one that waits on a lock or a
peer sleeps. (The kernel's own count of time in the run queue, ``schedstat``,
is added only once a thread gets a core: a thread starved for the whole
window read 0% there too.) A wait that polls is ready at each poll, and on a
loaded machine may wait for a core each time: taken for computing there, it
is a stall at the allowance's end. It pages at
``PAGING_FAULTS_PER_S`` major faults a second or more (each a page read from
disk). Elsewhere (macOS) no thread's own figures are read: no CPU reading
(None), and paging is the whole process's (``getrusage``). Either way paging
is not believed while a loop a stall abandoned is still in its step
(``StallDetector``): mlx's threads, shared with the live loop, would carry its
faults too. (macOS reports its page-ins
there; a page its memory compressor gives back without reading the disk is
no major fault, so paging from the compressor alone is not seen.)

Readings are taken on the watchdog's thread only while the heartbeat stands
still with work waiting, at most one per ``READ_EVERY_S``: nothing on the
loop's hot path, nothing while steps come quickly.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import deque
from typing import Callable, NamedTuple, Optional

# The share of one core the engine's threads use for a step to count as
# computing. A step stuck in a wait measured 0%; one computing 69%, and 13%
# on a 2-core machine with a load average of 5.5 (its Python loop also
# contended for the GIL).
BUSY_CPU_SHARE = 0.05
# Or the share of looks that found one of them running or ready to run: a
# step starved of a core computes too (a test's, at the lowest priority on a
# busy core: 1.2% of the core, runnable at every look); a wait is asleep.
RUNNABLE_SHARE = 0.5
# Major page faults a second for a step to count as paging: a process that is not
# paging takes none in a step (its model was read at load); one whose memory is
# swapped out takes hundreds to thousands (a 4 KB page, or macOS's 16 KB, a fault).
PAGING_FAULTS_PER_S = 20.0
# Both are measured over about the last WINDOW_S of the still heartbeat,
# once it spans MIN_SPAN_S (Linux counts CPU time in 10 ms ticks: 2% of it).
WINDOW_S = 1.0
MIN_SPAN_S = 0.5
READ_EVERY_S = 0.2


TASKS = "/proc/self/task"


class ThreadsReading(NamedTuple):
    """The engine's threads' totals so far (the whole process's faults where no thread is read)."""

    cpu_s: Optional[float]  # None: no thread's own figures here (macOS)
    runnable: Optional[bool]  # one of them running or ready to run now; None: unknown here
    major_faults: int


def engine_threads_reader() -> Optional[Callable[[int], Optional[ThreadsReading]]]:
    """A function of the loop thread's ident: the engine's threads' reading so far, or
    None when unknown now. None: unavailable here (no /proc, or its thread ids are not
    Python's)."""
    if not os.path.isdir(TASKS):
        return None
    ticks_per_s = os.sysconf("SC_CLK_TCK")

    def read(loop_ident: int) -> Optional[ThreadsReading]:
        python_threads = {t.ident: t.native_id for t in threading.enumerate()}
        loop_native = python_threads.get(loop_ident)
        if loop_native is None:
            return None
        others = set(python_threads.values()) - {loop_native}
        try:
            tids = [int(tid) for tid in os.listdir(TASKS)]
        except OSError:
            return None
        if loop_native not in tids:
            return None
        ticks = faults = 0
        runnable = False
        for tid in tids:
            if tid in others:
                continue
            try:
                with open(f"{TASKS}/{tid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended meanwhile
            # After the name: state (field 3), ..., majflt (12), ..., utime (14), stime (15).
            runnable = runnable or fields[0] == "R"
            faults += int(fields[12 - 3])
            ticks += int(fields[14 - 3]) + int(fields[15 - 3])
        return ThreadsReading(ticks / ticks_per_s, runnable, faults)

    return read if read(threading.get_ident()) is not None else None


def process_major_faults() -> int:
    """The whole process's major page faults so far: pages read from disk."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class StepCpu:
    """The CPU share and the paging of the engine's threads while one heartbeat stands still."""

    def __init__(self, reader: Optional[Callable[[int], Optional[ThreadsReading]]] = None,
                 process_faults: Callable[[], int] = process_major_faults):
        self.reader = reader if reader is not None else engine_threads_reader()
        self.process_faults = process_faults
        self._beat: Optional[float] = None
        # (when, the reading) while this beat stood
        self._readings: deque[tuple[float, ThreadsReading]] = deque()
        self.share: Optional[float] = None  # of a core, over about the last WINDOW_S, once known
        self.runnable_share: Optional[float] = None  # of the looks then, likewise
        self.faults_per_s: Optional[float] = None  # likewise

    @property
    def reads_threads(self) -> bool:
        """Whether the engine's own threads are read here (Linux), not the whole process."""
        return self.reader is not None

    def observe(self, *, beat: float, now: float, loop_ident: Optional[int]) -> None:
        """One look while work waits: ``beat`` the engine's last heartbeat."""
        if beat != self._beat:
            self.forget()
            self._beat = beat
            # A heartbeat that moves between looks (steps of milliseconds) costs no read.
            # One already still for READ_EVERY_S is read at this first look: on a loaded
            # machine the looks come late, and a window begun a look later was not
            # measured by a 1 s limit (a starved step called a stall at 1.04 s).
            if now - beat < READ_EVERY_S:
                return
        readings = self._readings
        if loop_ident is None or (readings and now - readings[-1][0] < READ_EVERY_S):
            return
        if self.reader is not None:
            reading = self.reader(loop_ident)
            if reading is None:  # the loop's thread not found now: this window measures nothing
                self.forget()
                return
        else:
            reading = ThreadsReading(None, None, self.process_faults())
        readings.append((now, reading))
        # About the last WINDOW_S: the oldest goes once the next one is that old.
        while len(readings) > 2 and now - readings[1][0] >= WINDOW_S:
            readings.popleft()
        began, then = readings[0]
        span = now - began
        if span >= MIN_SPAN_S:
            def per_s(total, total_then):
                return None if total is None else max(0.0, total - total_then) / span
            self.share = per_s(reading.cpu_s, then.cpu_s)
            self.faults_per_s = per_s(reading.major_faults, then.major_faults)
            looks = [look.runnable for _, look in readings]
            self.runnable_share = None if None in looks else sum(looks) / len(looks)

    def forget(self) -> None:
        """Start over (a new beat; after a pause of the process a window spanning it measures nothing)."""
        self._beat, self.share, self.runnable_share, self.faults_per_s = None, None, None, None
        self._readings.clear()

    # Read once each (HTTP threads ask too, while the watchdog's ``forget`` may clear them).
    def computing(self) -> bool:
        """The engine's threads compute while this heartbeat stands still (over about the last
        WINDOW_S): on a core, or ready to and waiting for one."""
        share, runnable_share = self.share, self.runnable_share
        return ((share is not None and share >= BUSY_CPU_SHARE)
                or (runnable_share is not None and runnable_share >= RUNNABLE_SHARE))

    def paging(self) -> bool:
        """The engine's threads read pages from disk while this heartbeat stands still."""
        faults_per_s = self.faults_per_s
        return faults_per_s is not None and faults_per_s >= PAGING_FAULTS_PER_S

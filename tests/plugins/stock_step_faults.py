"""Faults planted in stock's own ``BatchGenerator.next``, from outside the guardian.

A test plugin (``[guardian] plugins = ["tests.plugins.stock_step_faults:StockStepFaults"]``).
It wraps the method of mlx_lm's own class (``mlx_lm.generate.BatchGenerator``),
which the guardian's observed subclass calls through ``super().next()``: the
guardian's step hook has already run, exactly as when stock's step itself
blocks or is slow (a native deadlock, a kernel compile).

- ``hang_at_call``: the Nth call of ``next()`` in the process (the first is 1)
  blocks, for ``hang_s`` seconds or, with 0, until the server shuts down.
  ``stock_step_hang`` is logged as it blocks, ``stock_step_hang_ended`` when
  it returns to stock's code.
- ``busy_at_call``: the Nth call of ``next()`` computes (burns CPU in its
  own thread, as a kernel compile does) for ``busy_s`` seconds before stock's
  step runs. ``stock_step_busy`` is logged as it begins, ``stock_step_busy_ended``
  when it ends. With ``busy_starved`` (Linux), it computes on a loaded core: its
  thread, at the lowest priority, shares one core with a process that burns it
  at the normal priority, so it gets ~1-2% of the core and waits for the rest.
- ``page_at_call``: the Nth call of ``next()`` pages for ``page_s`` seconds
  before stock's step runs: it reads a file's pages through a memory map, one
  every few milliseconds, each evicted from memory first, so each is a major
  page fault and the thread waits on the disk (as a step whose memory was
  swapped out does). Linux (``posix_fadvise``), on a folder that is no tmpfs.
  ``stock_step_paging`` is logged as it begins, ``stock_step_paging_ended``
  with its ``major_faults`` when it ends.
- ``first_call_delay_s``: the first ``next()`` of every BatchGenerator (the
  first step of a loop at start and after each restart, when mlx compiles
  kernels) takes this much longer.
- ``delay_s``: every ``next()`` takes this much longer (a slow model).
- ``prefill_delay_s``: a ``next()`` that processes prompt tokens takes this
  much longer, from the ``prefill_delay_from_call``-th call on (a big model's
  prefill chunks, each far longer than its decode steps).
- ``raise_message`` with ``armed_by``: once the file ``armed_by`` exists, the
  next ``next()`` that processes prompt tokens raises ``RuntimeError(raise_message)``
  from inside stock's step (as an allocator failure in prefill does) and
  removes the file: one failure per arming (a file holding a number N: N
  failures, one per such step).
- ``token_delay_s`` with ``token_delay_armed_by``: once that file exists, the
  next ``next()`` that returns a generated token takes this much longer (as
  when mlx compiles a sampler's kernels at its first token) and removes the
  file; with ``token_delay_released_by``, it returns as soon as that file
  exists. ``stock_step_slow_token`` is logged, and ``stock_step_slow_token_batch_freed``
  once that step's BatchGenerator is freed (a loop abandoned in that step frees
  its batch as it unwinds).
- ``unwind_delay_s``: that slow step's responses take this long to free, as a
  stuck step's arrays might: whichever thread lets go of them waits.
- ``token_delay_raises``: that slow step then raises ``RuntimeError`` with this
  message instead of returning (a stuck step that fails late).

The delays, the raise and their arming files are live (a save of the file
changes them in a running server, so a module's tests can share one); the
call counts (``hang_at_call``, ``busy_at_call``, ``prefill_delay_from_call``)
are the process's, read at start.
"""

from __future__ import annotations

import hashlib
import importlib
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

import structlog

import guardian
from tests.plugins.arming import disarm

log = structlog.get_logger("tests.stock_step_faults")
# The module (the package's ``mlx_lm.generate`` attribute is the function).
generate = importlib.import_module("mlx_lm.generate")


def live(default):
    """A setting a save changes while the server runs."""
    return field(default=default, metadata={"live": True})


@dataclass
class StockStepFaultsSettings:
    hang_at_call: int = 0
    hang_s: float = 0.0
    busy_at_call: int = 0
    busy_s: float = 0.0
    busy_starved: bool = False
    page_at_call: int = 0
    page_s: float = 0.0
    first_call_delay_s: float = live(0.0)
    delay_s: float = live(0.0)
    prefill_delay_s: float = live(0.0)
    prefill_delay_from_call: int = 1
    raise_message: str = live("")
    armed_by: str = live("")
    token_delay_s: float = live(0.0)
    token_delay_armed_by: str = live("")
    token_delay_released_by: str = live("")
    unwind_delay_s: float = live(0.0)
    token_delay_raises: str = live("")


class StockStepFaults:
    name = "stock_step_faults"
    Settings = StockStepFaultsSettings

    def __init__(self, settings: StockStepFaultsSettings):
        self.settings = settings
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._calls = 0
        # Started now, burning only when told: a process's start inside the step, on a
        # loaded machine, was a second of waiting there (CI: judged a stall at its limit).
        self.competitor = Competitor() if settings.busy_starved else None
        self._plant()

    @guardian.hookimpl
    def guardian_startup(self):
        log.warning("stock_step_faults_planted", **vars(self.settings))

    @guardian.hookimpl
    def guardian_shutdown(self):
        self.released.set()
        if self.competitor is not None:
            self.competitor.stop()

    def _plant(self) -> None:
        stock_next = generate.BatchGenerator.next
        plugin = self
        settings = self.settings

        def next(generator):
            with plugin._lock:
                plugin._calls += 1
                call = plugin._calls
            first = not getattr(generator, "_stock_step_faults_seen", False)
            generator._stock_step_faults_seen = True
            if first and settings.first_call_delay_s:
                log.warning("stock_step_slow_first_call", call=call, delay_s=settings.first_call_delay_s)
                plugin.released.wait(settings.first_call_delay_s)
            if settings.delay_s:
                plugin.released.wait(settings.delay_s)
            if settings.prefill_delay_s and call >= settings.prefill_delay_from_call and _prefills(generator):
                plugin.released.wait(settings.prefill_delay_s)
            if settings.raise_message and _prefills(generator) and disarm(settings.armed_by):
                log.warning("stock_step_raise", call=call, message=settings.raise_message)
                raise RuntimeError(settings.raise_message)
            if call == settings.hang_at_call:
                log.warning("stock_step_hang", call=call, thread=threading.current_thread().name)
                plugin.released.wait(settings.hang_s or None)
                log.warning("stock_step_hang_ended", call=call)
            if call == settings.busy_at_call:
                log.warning("stock_step_busy", call=call, busy_s=settings.busy_s, starved=settings.busy_starved)
                if plugin.competitor is not None:
                    _burn_cpu_starved(settings.busy_s, plugin.competitor)
                else:
                    _burn_cpu(settings.busy_s)
                log.warning("stock_step_busy_ended", call=call)
            if call == settings.page_at_call:
                log.warning("stock_step_paging", call=call, page_s=settings.page_s)
                faults = _page(settings.page_s, plugin.released)
                log.warning("stock_step_paging_ended", call=call, major_faults=faults)
            responses = stock_next(generator)
            # (prompt responses, generation responses), in 0.31 and 0.32
            if settings.token_delay_s and responses[1] and disarm(settings.token_delay_armed_by):
                log.warning("stock_step_slow_token", call=call, delay_s=settings.token_delay_s)
                weakref.finalize(generator, log.warning, "stock_step_slow_token_batch_freed", call=call)
                _wait_for_file(settings.token_delay_released_by, settings.token_delay_s, plugin.released)
                if settings.unwind_delay_s:
                    responses = SlowToFree(responses, settings.unwind_delay_s, plugin.released)
                if settings.token_delay_raises:  # the responses stay in this frame, on the traceback
                    log.warning("stock_step_raise_late", call=call, message=settings.token_delay_raises)
                    raise RuntimeError(settings.token_delay_raises)
            return responses

        generate.BatchGenerator.next = next


class SlowToFree(tuple):
    """A step's responses whose freeing waits ``delay_s`` on the thread that frees them."""

    def __new__(cls, responses, delay_s: float, released: threading.Event):
        self = super().__new__(cls, responses)
        self.delay_s, self.released = delay_s, released
        return self

    def __del__(self):
        log.warning("stock_step_responses_freeing", delay_s=self.delay_s, thread=threading.current_thread().name)
        self.released.wait(self.delay_s)


def _wait_for_file(path: str, timeout_s: float, released: threading.Event) -> None:
    """Until the file ``path`` exists (none: the whole ``timeout_s``), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (path and os.path.exists(path)):
        left = deadline - time.monotonic()
        if left <= 0 or released.wait(min(left, 0.05)):
            return


def _burn_cpu(seconds: float) -> None:
    """Compute for ``seconds`` on the calling thread."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(i * i for i in range(10_000))


class Competitor:
    """A process that burns one core once told to, for as long as told at most (a server
    killed meanwhile stops nothing), or until stopped: the starved step's thread shares
    that core with it. One whose server ends before that reads an end and exits."""

    SOURCE = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
told = sys.stdin.readline()
deadline = time.monotonic() + float(told or 0)
while time.monotonic() < deadline:
    pass
"""

    def __init__(self):
        self.core = min(os.sched_getaffinity(0))
        self.proc = subprocess.Popen([sys.executable, "-c", self.SOURCE, str(self.core)], stdin=subprocess.PIPE)

    def start(self, seconds: float) -> None:
        self.proc.stdin.write(f"{seconds}\n".encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()


def _burn_cpu_starved(seconds: float, competitor: Competitor) -> None:
    """Compute for ``seconds`` on the calling thread, pinned at nice 19 to the core that
    ``competitor`` burns at nice 0: ready to run nearly all the time, on a core nearly
    never. It computes without the GIL (hashing a megabyte lets go of it), as mlx's
    kernels do: a starved thread that held the GIL would hold up the whole process, the
    watchdog too."""
    tid = threading.get_native_id()
    held_cores, held_nice = os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, tid)
    competitor.start(seconds + 5)
    try:
        os.sched_setaffinity(0, {competitor.core})  # 0: the calling thread alone, on Linux
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        block, deadline = bytes(1 << 20), time.monotonic() + seconds
        while time.monotonic() < deadline:
            hashlib.sha256(block).digest()
    finally:
        competitor.stop()
        os.sched_setaffinity(0, held_cores)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, held_nice)
        except PermissionError:  # only root may raise a priority again; the rest of the steps run low
            log.warning("stock_step_priority_kept", nice=19)


# The file paged in: 2,048 pages of 4 KB, read one every PAGE_EVERY_S (~150 faults a
# second here), all of them again, evicted first, once each was read. A wake-up that comes
# late reads the pages it owes, MAX_PAGES_OWED at most: on a loaded CI the wake-ups came ~13
# times late, one page each made 15 faults a second, under the watchdog's 20, and the step
# was taken for a stuck one. (Four at every wake-up cost 7 % of a core here: no "little CPU".)
PAGED_FILE_BYTES = 8 << 20
PAGE_EVERY_S = 0.005
MAX_PAGES_OWED = 4


def _page(seconds: float, released: threading.Event) -> int:
    """Read pages of a file not in memory for ``seconds``, on the calling thread, with
    little CPU: the major page faults taken."""
    def evict():
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    with tempfile.TemporaryFile() as file:
        file.write(b"\1" * PAGED_FILE_BYTES)
        file.flush()
        os.fsync(file.fileno())  # clean pages: the page cache may drop them
        with mmap.mmap(file.fileno(), PAGED_FILE_BYTES, prot=mmap.PROT_READ) as pages:
            pages.madvise(mmap.MADV_RANDOM)  # no read-ahead: a fault for each page
            evict()
            deadline, offset, last = time.monotonic() + seconds, 0, time.monotonic()
            while time.monotonic() < deadline and not released.wait(PAGE_EVERY_S):
                now = time.monotonic()
                owed = min(MAX_PAGES_OWED, max(1, int((now - last) / PAGE_EVERY_S)))
                last = now
                for _ in range(owed):
                    pages[offset]  # a major fault: the page is read from the disk
                    offset += mmap.PAGESIZE
                    if offset >= PAGED_FILE_BYTES:
                        offset = 0
                        pages.madvise(mmap.MADV_DONTNEED)  # unmapped here, still cached
                        evict()
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before


def _prefills(generator) -> bool:
    """Whether this step processes prompt tokens (stock's own bookkeeping, 0.31 and 0.32)."""
    return bool(len(generator._unprocessed_sequences) or len(generator._prompt_batch))

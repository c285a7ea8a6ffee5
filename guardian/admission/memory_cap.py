"""The KV budget after the device ran out of memory: what it can actually give.

prompt_guard's KV budget is an estimate from the device's size, made at
start. An engine failure classified ``out_of_memory`` proves it wrong for
now (another process holds the memory, activations are larger than the
margin): admitting by it again would only fail the engine again, each
failure a restart and a re-run for every request in flight. So from the
failure on, the budget is capped by what the device can give:

- measured, where mlx reports the device's free memory (CUDA's
  ``device_info()["free_memory"]``): free memory plus what this process
  holds beyond its weights (mlx's active and cached bytes: KV caches,
  prompt cache, buffers it can reuse), less the budget's margin. Measured
  when the restarted loop first asks for work (the dead loop's memory is
  released by then), and again at every resource sample.
- learned, everywhere: the KV the admitted requests held when the device
  ran out did not fit, so the cap is that less the margin. It stays while
  memory is short: a request can fail alone where the free memory seemed
  to hold its KV (the cache grows by copies; activations need room too).

The lower of the two wins. The cap is lifted once the device has the
configured budget free again (measured), or, where nothing measures it
(Metal, the CPU), once ``hold_s`` pass without another memory failure. The
cap is temporary, so a request over it that fits the configured budget is
no request's fault: where the cap is measured, the device has not the memory
now, and the request gets 503 ``memory_shortage`` with Retry-After; where it
is only learned, it runs alone, in its turn (one request in flight at the
failure capped the budget below its own size, and refusing every request as
large kept a server whose shortage had passed from serving for ``hold_s``;
if memory is still short, it fails alone and gets 503 ``memory_shortage``,
guardian.engine.blame, and teaches the cap nothing: it reserved all of it, less than
its KV). Only a request over the configured budget (the
device's total) gets 400 ``kv_cache_budget_exceeded``. Requests that would fill the cap wait, then
get 429 ``kv_cache_budget_busy`` (prompt_guard's queue).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from guardian.admission.facts import device_info, memory_in_use


def device_free_memory() -> Optional[int]:
    """The device's free memory as its driver reports it, or None where mlx
    reports none (Metal and the CPU report sizes, not what is free)."""
    free = device_info().get("free_memory")
    return int(free) if free is not None else None


def memory_this_process_could_use(weights_bytes: int) -> Optional[int]:
    """Free device memory plus what mlx holds here beyond the weights, or None."""
    free = device_free_memory()
    if free is None:
        return None
    held = memory_in_use() - weights_bytes
    return free + max(0, held)


class MemoryCap:
    """The cap on the KV budget since the last out-of-memory failure (None: no cap).

    Called from the loop thread (a failure, a restart) and the watchdog's (resource
    samples): one lock around each call."""

    def __init__(self, *, margin: float, hold_s: float = 60.0,
                 measure: Callable[[int], Optional[int]] = memory_this_process_could_use,
                 clock: Callable[[], float] = time.monotonic):
        self.margin = margin
        self.hold_s = hold_s
        self._measure = measure
        self._clock = clock
        self.cap_bytes: Optional[int] = None
        self.learned_bytes: Optional[int] = None  # from the KV admitted at the last failure
        self.measured_bytes: Optional[int] = None  # from the device, at the last look
        self.failed_at: Optional[float] = None
        self.failures = 0
        self._lock = threading.Lock()

    def _usable(self, nbytes: int) -> int:
        return int(max(0, nbytes) * max(0.0, 1 - self.margin))

    def engine_failed(self, kv_admitted_bytes: int) -> None:
        """The engine failed for memory while requests holding ``kv_admitted_bytes``
        of KV budget were admitted (as noted at the failure)."""
        with self._lock:
            self.failures += 1
            self.failed_at = self._clock()
            if kv_admitted_bytes > 0:
                learned = self._usable(kv_admitted_bytes)
                self.learned_bytes = learned if self.learned_bytes is None else min(self.learned_bytes, learned)

    def restarted(self, weights_bytes: int, configured_bytes: int) -> Optional[int]:
        """The loop restarted after a memory failure: set the cap; return it."""
        with self._lock:
            if self.failed_at is None:
                return self.cap_bytes
            return self._set(weights_bytes, configured_bytes)

    def resample(self, weights_bytes: int, configured_bytes: int) -> tuple[Optional[int], bool]:
        """Look again while capped: (the cap, whether it was lifted now)."""
        with self._lock:
            if self.cap_bytes is None:
                return None, False
            measured = self._measure(weights_bytes)
            if measured is None:
                quiet = self.failed_at is None or self._clock() - self.failed_at >= self.hold_s
                return (self._lift(), True) if quiet else (self.cap_bytes, False)
            if measured >= configured_bytes:
                return self._lift(), True
            return self._set(weights_bytes, configured_bytes, measured), False

    def _set(self, weights_bytes: int, configured_bytes: int, measured: Optional[int] = None) -> Optional[int]:
        if measured is None:
            measured = self._measure(weights_bytes)
        if measured is not None and measured >= configured_bytes:
            # The device has the configured budget free: the memory came back
            # (or the failure was not for want of device memory).
            return self._lift()
        self.measured_bytes = None if measured is None else self._usable(measured)
        caps = [c for c in (self.learned_bytes, self.measured_bytes, configured_bytes) if c is not None]
        self.cap_bytes = min(caps)
        return self.cap_bytes

    def _lift(self) -> None:
        self.cap_bytes = self.learned_bytes = self.measured_bytes = None
        self.failed_at = None
        return None

    def status(self) -> dict:
        return {
            "kv_budget_cap_bytes": self.cap_bytes,
            "kv_budget_learned_bytes": self.learned_bytes,
            "kv_budget_measured_bytes": self.measured_bytes,
            "memory_failures": self.failures,
        }

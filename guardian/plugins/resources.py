"""Resource gauges, and acting on memory before the limit.

Each sample (the watchdog's thread, every ``resource_interval_s``) has
mlx's memory counters (active, cache, peak), the device's memory (Metal's
recommended working set; on the CPU, mlx's memory limit), and what the
guardian can count that holds buffers. mlx exposes no live Metal buffer
count (``MetalAllocator::num_resources_`` is internal; PRs to expose it were
closed), only byte counters and the static ``resource_limit``: the buffer
proxy is the prompt cache's entries and bytes, the requests in flight and
the bytes of their KV caches in stock's batch (each request holds one KV
cache: two arrays per layer). The sample is logged
(``resource_sample``, DEBUG) and shown in ``/guardian/status``.

Memory in use is mlx's active plus cache memory. Above ``trim_above``
(a fraction of the device's memory; ``*_bytes`` settings win), the engine
clears mlx's buffer cache and drops least recently used prompt-cache
entries (``memory_trimmed``). Above ``refuse_above``, new requests get 429
``memory_pressure`` with Retry-After until memory falls below
``resume_below`` (``memory_admission_paused`` / ``_resumed``), except where
nothing is in flight and memory is over ``resume_below`` even without what a
trim frees: what is in use then (the weights) frees no further by waiting,
and a request is let in (``memory_admission_at_floor``). Memory left
after each engine restart (less the prompt cache, which survives restarts)
that grows restart after restart is logged as ``memory_leak_suspected``.
"""

from __future__ import annotations

import threading
from typing import Optional

import mlx.core as mx
import structlog

import guardian
from guardian.admission.facts import describe_bytes, device_info, device_memory, memory_in_use
from guardian.errors import GuardianError
from guardian.config.registry import Float, Int, Setting, Table

log = structlog.get_logger("guardian.resources")

MiB = 1024 * 1024


class ResourcesSettings(Table, name="resources"):
    """Memory is mlx's active + cache memory, against the device's memory (Metal's
    recommended working set; on the CPU, mlx's memory limit). Each *_bytes
    setting, when not 0, wins over its fraction."""

    trim_above = Setting(Float(min=0), 0.85, """
        Above this fraction, clear mlx's buffer cache (mx.clear_cache()) and drop
        the least recently used prompt-cache entries until memory is below it
        again (memory_trimmed). Checked at every resource sample
        ([watchdog] resource_interval_s). 0: never.""", live=True)
    trim_above_bytes = Setting(Int(min=0), 0, """
        trim_above as bytes; not 0: wins over the fraction.""", live=True)
    refuse_above = Setting(Float(min=0), 0.95, """
        Above this fraction, new requests get 429 memory_pressure with
        Retry-After (retry_after_s) until memory falls below resume_below;
        requests in flight go on. With none queued or in flight, and memory over
        resume_below even without what a trim frees (mlx's buffer cache, the prompt
        cache), what is left is the weights: one request at a time is let in
        (memory_admission_at_floor), as is a supervisor's continuation of a stream
        let in before. Checked at each request. 0: never.""", live=True)
    refuse_above_bytes = Setting(Int(min=0), 0, """
        refuse_above as bytes; not 0: wins over the fraction.""", live=True)
    resume_below = Setting(Float(min=0), 0.9, """
        Admission resumes below this fraction (at most refuse_above: a margin,
        so that admission does not flap at the limit).""", live=True)
    resume_below_bytes = Setting(Int(min=0), 0, """
        resume_below as bytes; not 0: wins over the fraction.""", live=True)
    retry_after_s = Setting(Float(min=0), 2.0, """
        The Retry-After of the 429 memory_pressure refusals.""", live=True)
    leak_restarts = Setting(Int(min=2), 3, """
        Memory after an engine restart (active, less the prompt cache) higher
        after each of this many restarts in a row than after the one before,
        and by leak_min_growth_bytes in all: memory_leak_suspected (a warning;
        a restart of the process frees what a leak holds).""", live=True)
    leak_min_growth_bytes = Setting(Int(min=0), 64 * MiB, """
        The least growth, in all, over leak_restarts restarts that is reported as a
        suspected leak (smaller steps are noise).""", live=True)


class Resources:
    name = "resources"
    Settings = ResourcesSettings

    def __init__(self, settings: ResourcesSettings):
        self.settings = settings
        self.device_bytes, self.device_source = device_memory()
        self.refusing = False
        self.floor_said = False  # memory_admission_at_floor logged in this pause
        self.floor_taken = False  # a request let in at the floor runs (under _lock)
        self._lock = threading.Lock()  # the refusing state: HTTP threads and the watchdog
        self.engine = None  # the EngineView, for restarts (their hook has none)
        self.after_restarts: list[int] = []

    # -- thresholds ------------------------------------------------------------
    def threshold(self, fraction: float, nbytes: int) -> Optional[int]:
        """Bytes for a fraction-or-bytes pair; None: off."""
        if nbytes:
            return nbytes
        return int(fraction * self.device_bytes) if fraction else None

    def thresholds(self) -> tuple[Optional[int], Optional[int], Optional[int]]:
        """(trim, refuse, resume) in bytes, each None when off."""
        s = self.settings
        trim = self.threshold(s.trim_above, s.trim_above_bytes)
        refuse = self.threshold(s.refuse_above, s.refuse_above_bytes)
        resume = self.threshold(s.resume_below, s.resume_below_bytes)
        if refuse is not None:
            resume = refuse if resume is None else min(resume, refuse)
        return trim, refuse, resume

    def refuse_now(self, used: int) -> bool:
        """Whether admission is paused at ``used`` bytes, with hysteresis; logs each change."""
        _, refuse, resume = self.thresholds()
        with self._lock:
            was = self.refusing
            if refuse is None:
                self.refusing = False
            elif not was and used > refuse:
                self.refusing = True
            elif was and used < resume:
                self.refusing = False
            now = self.refusing
            if was and not now:
                self.floor_said = False  # the next pause says it again
        if now and not was:
            log.warning("memory_admission_paused", memory_used_bytes=used, refuse_above_bytes=refuse,
                        resume_below_bytes=resume, device_memory_bytes=self.device_bytes)
        elif was and not now:
            log.info("memory_admission_resumed", memory_used_bytes=used, resume_below_bytes=resume)
        return now

    def let_in_at_the_floor(self, admission, engine, used: int) -> bool:
        """Whether memory is as low as waiting can make it: no request queued, waiting to run
        again or in flight, none let in at the floor and still running, and what a trim could
        free (mlx's buffer cache, the prompt cache) would not bring it below resume_below:
        the rest is the weights (a model near the device's size), and refusing would never
        end. Then this request is let in, the only one until it ends (others arriving at once
        find the place taken). (Waiting for the trim's caches to empty, every other request
        of a client sending one at a time was refused.)"""
        _, refuse, resume = self.thresholds()
        with self._lock:
            if self.floor_taken or engine.has_work():
                return False
            freeable = mx.get_cache_memory() + engine.prompt_cache_usage()[1]
            if used - freeable < resume:
                return False  # a trim brings it under the line: admission resumes then
            self.floor_taken = True
            say, self.floor_said = not self.floor_said, True
        admission.on_finish(self._floor_left)
        if say:
            log.warning("memory_admission_at_floor", memory_used_bytes=used, resume_below_bytes=resume,
                        refuse_above_bytes=refuse, device_memory_bytes=self.device_bytes,
                        hint="nothing in flight and the caches empty, memory is still over resume_below "
                             "(the model's weights): requests are let in while none is in flight; raise "
                             "[resources] refuse_above and resume_below, or serve a smaller model")
        return True

    def _floor_left(self) -> None:
        with self._lock:
            self.floor_taken = False

    def maybe_trim(self, engine, used: int) -> None:
        trim, _, _ = self.thresholds()
        if trim is not None and used > trim:
            engine.relieve_memory(trim, reason=f"memory {describe_bytes(used)} over {describe_bytes(trim)}")

    # -- hooks -------------------------------------------------------------------
    @guardian.hookimpl
    def guardian_startup(self, engine):
        self.engine = engine
        trim, refuse, resume = self.thresholds()
        log.info("memory_thresholds", device_memory_bytes=self.device_bytes,
                 device_memory_source=self.device_source, trim_above_bytes=trim,
                 refuse_above_bytes=refuse, resume_below_bytes=resume)

    @guardian.hookimpl(tryfirst=True)
    def admit_request(self, admission, engine):
        """Before any other hook reserves anything for the request (the KV budget)."""
        used = memory_in_use()
        if not self.refuse_now(used):
            return None
        if admission.carried_tokens:
            # A supervisor's continuation: a stream let in before, whose child died under it.
            # Refused here (the new child's probe had just filled mlx's cache), it was cut.
            return None
        self.maybe_trim(engine, used)
        if self.let_in_at_the_floor(admission, engine, used):
            return None
        _, refuse, _ = self.thresholds()
        return GuardianError(
            f"The server is low on memory: {describe_bytes(used)} in use, over its limit of "
            f"{describe_bytes(refuse)}; new requests wait until it falls. Retry later.",
            status=429, type="rate_limit_error", code="memory_pressure",
            retry_after_s=self.settings.retry_after_s,
            extra={"memory_used_bytes": used, "refuse_above_bytes": refuse},
        )

    @guardian.hookimpl
    def sample_resources(self, engine):
        sequences, cache_bytes = engine.prompt_cache_usage()
        started = engine.started_count()
        active, cache = mx.get_active_memory(), mx.get_cache_memory()
        trim, refuse, resume = self.thresholds()
        # A KV cache is a keys and a values array per layer (an estimate: a
        # quantized cache has more, stock may grow a cache in several steps).
        # Unknown while no model is loaded (a reload): the rest is sampled then too.
        limits = engine.served_limits()
        arrays_per_cache = 2 * len(limits.kv_layers) if limits is not None else None
        return {
            "active_memory_bytes": active,
            "cache_memory_bytes": cache,
            "peak_memory_bytes": mx.get_peak_memory(),
            "memory_used_bytes": active + cache,
            "device_memory_bytes": self.device_bytes,
            "resource_limit": device_info().get("resource_limit"),
            "trim_above_bytes": trim,
            "refuse_above_bytes": refuse,
            "resume_below_bytes": resume,
            # The buffer proxy: mlx has no live buffer count (see the module's doc).
            "prompt_cache_sequences": sequences,
            "prompt_cache_bytes": cache_bytes,
            "requests_in_flight": engine.requests_in_flight(),
            "requests_started": started,
            "requests_kv_cache_bytes": engine.requests_kv_bytes(),
            "kv_cache_arrays_estimate": (None if arrays_per_cache is None
                                         else (sequences + started) * arrays_per_cache),
        }

    @guardian.hookimpl
    def on_resource_sample(self, sample, engine):
        used = sample.get("memory_used_bytes")
        if used is None:
            return
        sample["admission_paused"] = self.refuse_now(used)
        log.debug("resource_sample", **{k: v for k, v in sample.items() if k != "at"})
        self.maybe_trim(engine, used)

    @guardian.hookimpl
    def on_engine_restarted(self, restarts):
        """Memory after each restart, less the prompt cache: a steady climb is a leak."""
        if self.engine is None:
            return
        _, prompt_cache_bytes = self.engine.prompt_cache_usage()
        self.after_restarts.append(mx.get_active_memory() - prompt_cache_bytes)
        s = self.settings
        series = self.after_restarts[-s.leak_restarts - 1:]
        del self.after_restarts[:-s.leak_restarts - 1]
        if len(series) <= s.leak_restarts:
            return
        growing = all(later > earlier for earlier, later in zip(series, series[1:]))
        growth = series[-1] - series[0]
        if growing and growth >= s.leak_min_growth_bytes:
            log.warning("memory_leak_suspected", restarts=restarts, after_restarts_bytes=series,
                        growth_bytes=growth,
                        hint="memory left after each engine restart keeps growing; "
                             "a restart of the process frees it")
            self.after_restarts = [series[-1]]

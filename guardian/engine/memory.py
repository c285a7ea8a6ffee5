"""The engine's memory: its prompt cache, the KV a failed batch held, trims under pressure.

``EngineMemory`` is the engine's collaborator for what its loop holds. The
prompt cache and the batch's KV are the loop thread's alone: what another
thread asks (a trim, a measurement) is done there, at the loop's next look at
the queue (``GuardianEngine.on_loop_thread``).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import mlx.core as mx
import structlog

from guardian import stock
from guardian.engine.kept_kv import KeptKV

log = structlog.get_logger("guardian.engine")


class GuardianPromptCache(stock.contract.LRUPromptCache):
    """Stock's prompt cache, closed to probes and to abandoned loop threads,
    which hands a re-run the KV its failed batch held first (``kept``)."""

    def __init__(self, *args, engine_thread_check: Callable[[], None], **kwargs):
        super().__init__(*args, **kwargs)
        self._check_thread = engine_thread_check
        self.skip_prefixes: list[list[int]] = []
        self.kept = KeptKV()

    def fetch_nearest_cache(self, model, tokens):
        self._check_thread()
        if stock.continuation.prefill_from_nothing():
            return None, tokens  # a suspect's proof: no state of the engine's in its run
        # Outside the LRU entries, so a batch's worth of rows never evicts users' caches.
        kept = self.kept.take(model, tokens) if len(self.kept) else None
        if kept is not None:
            return kept
        return stock.continuation.with_a_token_to_prefill(super().fetch_nearest_cache(model, tokens), tokens)

    def insert_cache(self, model, tokens, prompt_cache, **kwargs):
        self._check_thread()
        for prefix in self.skip_prefixes:
            # Stock keys a finished request's cache by the tokens it holds,
            # which may stop short of the prompt's last token.
            known = prefix[:-1]
            if list(tokens[: len(known)]) == known:
                return  # a synthetic probe must not evict users' caches
        return super().insert_cache(model, tokens, prompt_cache, **kwargs)


class EngineMemory:
    """Memory one engine's loop holds: the prompt cache, its batch's KV caches, mlx's buffers."""

    def __init__(self, engine, prompt_cache: GuardianPromptCache):
        self.engine = engine
        # Stock deletes its prompt cache when its loop stops: status reads this.
        self.kept_kv = prompt_cache.kept
        # Caches kept from a failed batch wait for re-runs the loop has not taken yet.
        self._kept_kv_waiting = False
        self._trim_pending = False
        # The loop's BatchGenerator (weakly: it goes with the loop), and the
        # bytes of its requests' KV caches when the loop last measured them.
        self._batch = None
        self._requests_kv_bytes: Optional[int] = None
        self._kv_measure_pending = False

    def batch_made(self, batch_generator) -> None:
        """The loop made its BatchGenerator (stock.loop.step_observed)."""
        self._batch = weakref.ref(batch_generator)

    def loop_polled(self) -> None:
        """At the loop's look at the queue."""
        if self._kept_kv_waiting:
            self._drop_kept_kv_once_reruns_taken()

    def keep_batch_kv(self) -> None:
        """Keep the KV caches of the failed loop's batch for the requests it re-runs
        (guardian.engine.kept_kv), when its last step completed; else keep nothing:
        the re-runs prefill as before."""
        engine = self.engine
        batch = self._batch() if self._batch is not None else None
        if batch is None or stock.loop.is_distributed(engine) or not engine.ledger.counts()["rerun_queued"]:
            return
        try:
            rows = stock.continuation.rows_of_completed_steps(batch)
        except Exception as e:  # copying the caches evaluated a step that had failed after all
            log.warning("continuation_kv_discarded", reason="copying the batch's KV failed",
                        error_type=type(e).__name__, error_message=str(e))
            return
        if rows is None:
            log.info("continuation_kv_discarded", reason="the failure came in the middle of a step")
            return
        self.kept_kv.keep(engine.model_provider.model_key, rows)
        self._kept_kv_waiting = bool(rows)
        log.info("continuation_kv_kept", requests=len(rows), tokens=sum(len(tokens) for tokens, _ in rows),
                 bytes=sum(stock.continuation.cache_nbytes(cache) for _, cache in rows))

    def _drop_kept_kv_once_reruns_taken(self) -> None:
        """At a look at the queue: once the loop has taken every re-run, drop the
        kept caches none of them used (their clients left, or they were answered)."""
        if self.engine.ledger.counts()["rerun_queued"]:
            return
        self._kept_kv_waiting = False
        dropped = self.kept_kv.drop()
        if dropped:
            log.info("continuation_kv_dropped", requests=dropped, reason="no re-run took them")

    def relieve(self, target_bytes: int, reason: str) -> bool:
        """Soon, on the loop thread: clear mlx's buffer cache and, while mlx's memory
        (active + cache) is still over ``target_bytes``, drop the least recently
        used prompt-cache entries by as many bytes; log ``memory_trimmed``.
        False when a trim is already pending."""
        if self._trim_pending:
            return False
        self._trim_pending = True

        def trim():
            try:
                self.trim_prompt_cache(target_bytes, reason)
            finally:
                self._trim_pending = False

        self.engine.on_loop_thread(trim)
        return True

    def requests_kv_bytes(self) -> Optional[int]:
        """Bytes of the KV caches of the requests in stock's batch, as the loop
        measured them at its last look at the queue after the previous call
        (measured on the loop thread, which alone changes them); a new
        measurement is asked for. None: no batch (yet, or a non-batched model)."""
        if not self._kv_measure_pending:
            self._kv_measure_pending = True
            self.engine.on_loop_thread(self._measure_requests_kv)
        return self._requests_kv_bytes

    def _measure_requests_kv(self) -> None:
        self._kv_measure_pending = False
        batch = self._batch() if self._batch is not None else None
        self._requests_kv_bytes = None if batch is None else batch.prompt_cache_nbytes

    def trim_prompt_cache(self, target_bytes: int, reason: str) -> None:
        """On the loop thread: mlx's buffer cache, then least recently used prompt-cache entries."""
        cache = self.engine.prompt_cache
        before = {"prompt_cache_sequences": len(cache), "prompt_cache_bytes": cache.nbytes,
                  "active_memory_bytes": mx.get_active_memory(), "cache_memory_bytes": mx.get_cache_memory()}
        mx.clear_cache()
        excess = mx.get_active_memory() - target_bytes
        if excess > 0 and len(cache):
            cache.trim_to(n_bytes=max(0, cache.nbytes - excess))
            mx.clear_cache()  # the entries' buffers went back to mlx's cache
        after = {"prompt_cache_sequences": len(cache), "prompt_cache_bytes": cache.nbytes,
                 "active_memory_bytes": mx.get_active_memory(), "cache_memory_bytes": mx.get_cache_memory()}
        log.warning("memory_trimmed", reason=reason, target_bytes=target_bytes,
                    before=before, after=after,
                    freed_bytes=(before["active_memory_bytes"] + before["cache_memory_bytes"]
                                 - after["active_memory_bytes"] - after["cache_memory_bytes"]))

    def drop_prompt_cache(self) -> None:
        """Forget what the stuck loop cached: its arrays may still be unevaluated
        on its own stream, which a new loop thread cannot evaluate ("There is
        no Stream(cpu, 1) in current thread"), failing the request re-run."""
        self.kept_kv.drop()
        self._kept_kv_waiting = False
        sequences = len(self.engine.prompt_cache)
        if sequences:
            self.engine.prompt_cache.trim_to(n_sequences=0)
            log.info("prompt_cache_dropped", sequences=sequences, reason="stall")

    def status(self) -> dict:
        """The memory's part of ``GET /guardian/status``'s engine."""
        return {"continuation_kv": self.kept_kv.status()}

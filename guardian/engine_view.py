"""What a plugin sees of the server: a narrow, documented facade.

Every hook that takes ``engine`` receives an ``EngineView``, never the
GuardianEngine itself, so the engine's internals (its ledger, lifecycle,
prompt cache, the admission gate) can change without breaking plugins, and
a plugin cannot write the engine's state behind the lifecycle's back.
What a plugin may do is listed here, in five groups: status, limits,
probes, memory set aside while a request waits, and the recovery policy.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional


class EngineView:
    """The engine as plugins see it. Built by the server, one per engine."""

    def __init__(self, engine, admission=None):
        self._engine = engine
        # The admission gate, for the limits it enforces; None in an engine
        # that runs without one (a test's bare engine).
        self._admission = admission

    # -- status ----------------------------------------------------------------
    def status(self) -> dict:
        """What ``GET /guardian/status`` reports under ``engine``: state, restarts, counts."""
        return self._engine.status()

    @property
    def failure_hit_a_probe(self) -> bool:
        """Whether the engine failure being handled (``on_engine_error``) had one of the
        engine's own probes in flight: one token of a short prompt, which needs almost no
        memory. Short of memory, that is a shortage everyone meets, not one request's."""
        return self._engine.failures.hit_a_probe

    @property
    def completed_requests(self) -> int:
        """Requests the engine completed since the process started, its probes' included."""
        return self._engine.ledger.completed

    @property
    def progress(self) -> tuple[int, int]:
        """The engine's progress: requests completed (probes' too) and tokens generated; it
        moves whenever the engine works (guardian.engine.blame)."""
        return self._engine.failures.progress()

    def requests_in_flight(self) -> int:
        """Requests the engine's loop has taken, probes included."""
        return len(self._engine.ledger.in_flight())

    def has_work(self) -> bool:
        """Whether any request is queued, waiting to run again, or taken by the loop."""
        return self._engine.ledger.has_work()

    def started_count(self) -> int:
        """Requests now prefilling or decoding."""
        return self._engine.started_count()

    def started_prompt_contains(self, text: str) -> bool:
        """Whether a request now prefilling or decoding has ``text`` in its prompt."""
        return self._engine.started_prompt_contains(text)

    def prompt_cache_usage(self) -> tuple[int, int]:
        """(sequences, bytes) held by stock's prompt cache."""
        cache = self._engine.prompt_cache
        return len(cache), cache.nbytes

    def requests_kv_bytes(self) -> Optional[int]:
        """Bytes of the KV caches the requests in stock's batch hold (measured by the
        loop at its last look at the queue); None: no batch."""
        return self._engine.memory.requests_kv_bytes()

    def relieve_memory(self, target_bytes: int, reason: str) -> bool:
        """Soon, on the loop thread: ``mx.clear_cache()``, then drop least recently
        used prompt-cache entries until mlx's memory is at most ``target_bytes``
        (or the cache is empty); logged as ``memory_trimmed``. False: one is pending."""
        return self._engine.memory.relieve(target_bytes, reason)

    # -- limits ----------------------------------------------------------------
    def served_limits(self):
        """The served model's ``ModelLimits`` (context length, KV bytes per token, weights);
        None while no model is loaded (a reload or a switch reads the weights)."""
        return self._admission.served_limits()

    def decode_batch_size(self) -> Optional[int]:
        """How many requests stock decodes at once, in one batch (--decode-concurrency);
        None where it is not known."""
        return getattr(self._admission.cli_args, "decode_concurrency", None)

    def set_context_length(self, n_tokens: Optional[int]) -> None:
        """The context length the server advertises (``GET /v1/models``); None: the model's."""
        self._admission.served_context_length = n_tokens

    def set_max_body_bytes(self, n_bytes: Optional[int]) -> None:
        """Request bodies longer than this get a 413 unread; None: no limit."""
        self._admission.max_body_bytes = n_bytes

    def warm_tokenizer(self) -> None:
        """Make the admission side's private tokenizer copy now, not at the first request."""
        self._admission.warm_tokenizer()

    # -- probes ------------------------------------------------------------------
    def probe(self, prompt: str, timeout_s: float) -> dict:
        """Generate one token through users' queue and loop: ``{"ok", "duration_ms", "error", "token"}``."""
        return self._engine.probes.probe(prompt, timeout_s)

    def keep_out_of_prompt_cache(self, prompt: str) -> None:
        """Never store (or evict users' entries for) prompts starting like ``prompt``."""
        self._engine.probes.keep_out_of_prompt_cache(prompt)

    # -- memory set aside ----------------------------------------------------------
    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """While inside, the loop does not wait for this request to be enqueued:
        it may be waiting for memory the loop must first free."""
        with self._engine.ledger.set_aside():
            yield

    # -- the recovery policy ----------------------------------------------------------
    def configure_recovery(self, *, window_s: float, max_failures: int, max_reruns: int, quarantine_s: float,
                           max_continuations: int, backoff_after_failures: int,
                           backoff_base_s: float, backoff_max_s: float,
                           proof_max_steps: Optional[int] = None) -> None:
        """The crash-loop window (and the failures in it past which an engine
        that still serves is degraded), re-runs and continuations per request,
        quarantine time and a crash loop's backoff the core applies. Every
        value is required: defaults here would shadow the [recovery] table's.
        ``proof_max_steps``, the longest proof of the engine before a blame, came
        later: None leaves it as it is (64 at start), so a plugin written before
        it still works."""
        self._engine.configure_recovery(window_s=window_s, max_failures=max_failures, max_reruns=max_reruns,
                                        quarantine_s=quarantine_s, max_continuations=max_continuations,
                                        backoff_after_failures=backoff_after_failures,
                                        backoff_base_s=backoff_base_s, backoff_max_s=backoff_max_s,
                                        proof_max_steps=proof_max_steps)

    def quarantine_refusal(self, fingerprint: str):
        """The GuardianError for a quarantined fingerprint, or None; None always when quarantine is off."""
        quarantine = self._engine.failures.quarantine
        return quarantine.refusal(fingerprint) if quarantine.enabled else None

    @property
    def quarantine_enabled(self) -> bool:
        return self._engine.failures.quarantine.enabled

"""Turn away what cannot fit before it reaches the engine.

The incident began with a ~145K-token history sent to a server whose client
believed the context was 128K; stock checks no length anywhere, and a 13K
prompt to a 2K model is prefilled for half a minute while small requests
wait behind it. On by default, this plugin counts a request's tokens
exactly (stock's own tokenization, done once on the HTTP thread and reused
by the engine) and, before anything is enqueued:

- answers 400 ``context_length_exceeded`` to a prompt over the context or
  over ``max_prompt_tokens``;
- clamps ``max_tokens`` to what fits in the context (or answers 400, with
  ``on_overflow = "reject"``);
- optionally drops the oldest messages until the prompt fits;
- keeps the KV cache of admitted requests within a memory budget: 400
  ``kv_cache_budget_exceeded`` for one request over it, a bounded wait
  then 429 with Retry-After when the requests in flight fill it; after the
  device ran out of memory the budget is capped for a while
  (guardian.admission.memory_cap), and a request over that temporary cap
  gets 503 ``memory_shortage`` with Retry-After where the device's free
  memory is measured (CUDA), and runs alone where it is not (Metal, the CPU);
- has the HTTP handler answer 413 to bodies over ``max_body_bytes``.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from typing import Callable, Optional

import structlog

import guardian
from guardian.admission.memory_cap import MemoryCap
from guardian.admission.facts import (
    CONTEXT_LENGTH_KEYS,
    GAVE_UP_CHECK_S,
    Admission,
    ModelLimits,
    describe_bytes,
    device_memory,
)
from guardian.errors import GuardianError
from guardian.observability.counting import ActiveCount
from guardian.request_context import request_ended
from guardian.admission.guard_settings import PromptGuardSettings

log = structlog.get_logger("guardian.prompt_guard")

# Messages truncation never drops.
SYSTEM_ROLES = ("system", "developer")


class KVBudget:
    """The KV cache bytes admitted requests hold, and a fair wait for the rest.

    Requests are let in first come, first served: a small request does not
    overtake a large one that waits for room.

    Stock decodes its requests in one batch whose cache holds every sequence at
    the longest one's length (``BatchKVCache.extend`` pads the others to it): a
    10-token chat beside a 2,000-token one holds 2,000 tokens of KV too. So
    what admitted requests hold is counted as that batch would hold it: as many
    as decode at once (``batch_size``, stock's --decode-concurrency), each at the
    largest reservation. Summed alone, one long request and 31 short ones were
    let in for about one long request's KV, and held 32 of them (found by a
    review; ``tests/test_prompt_guard.py`` holds stock to the padding).
    """

    def __init__(self, total_bytes: int, *, max_queued: int, max_wait_s: float, retry_after_s: float,
                 batch_size: Optional[int] = None):
        self.configured_bytes = total_bytes
        # Lower than configured after the device ran out of memory
        # (guardian.admission.memory_cap); None: no cap.
        self.cap_bytes: Optional[int] = None
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self.batch_size = batch_size  # None: no bound known, every admitted request counts
        self._held: list[int] = []  # each admitted request's reservation
        self._waiting: deque[object] = deque()
        self._cond = threading.Condition()

    @property
    def in_use(self) -> int:
        """The KV cache admitted requests hold, as stock's batch holds it."""
        return self._batch_bytes(self._held)

    def _batch_bytes(self, held: list[int]) -> int:
        if not held:
            return 0
        at_once = len(held) if self.batch_size is None else min(len(held), self.batch_size)
        return at_once * max(held)

    def _fits(self, nbytes: int) -> bool:
        return self._batch_bytes([*self._held, nbytes]) <= self.total_bytes

    @property
    def total_bytes(self) -> int:
        """The bytes admitted requests may hold together now."""
        cap = self.cap_bytes
        return self.configured_bytes if cap is None else min(cap, self.configured_bytes)

    def set_cap(self, cap_bytes: Optional[int]) -> None:
        """Cap the budget at what the device can give (None: lift the cap); waiting requests look again."""
        with self._cond:
            self.cap_bytes = cap_bytes
            self._cond.notify_all()

    def reserve(self, nbytes: int,
                gave_up: Callable[[], Optional[GuardianError]] = lambda: None) -> Optional[GuardianError]:
        """Take ``nbytes``, waiting in line if need be; a 429 when the line is full or too slow.
        ``gave_up``, looked at every ``GAVE_UP_CHECK_S`` while waiting: the request's own end
        (an error to answer, or an exception it raises), which gives its place up."""
        with self._cond:
            if not self._waiting and self._fits(nbytes):
                self._held.append(nbytes)
                return None
            if len(self._waiting) >= self.max_queued:
                return self._busy("the queue for KV cache memory is full", nbytes)
            ticket = object()
            self._waiting.append(ticket)
            log.info("request_queued", kv_cache_bytes=nbytes, queued=len(self._waiting),
                     kv_in_use_bytes=self.in_use, kv_budget_bytes=self.total_bytes)
            started = time.monotonic()
            deadline = started + self.max_wait_s
            try:
                while not (self._waiting[0] is ticket and self._fits(nbytes)):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return self._busy(
                            f"no KV cache memory came free within {self.max_wait_s:g} s", nbytes
                        )
                    ended = gave_up()
                    if ended is not None:
                        return ended
                    self._cond.wait(min(remaining, GAVE_UP_CHECK_S))
                self._held.append(nbytes)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()
        log.info("request_dequeued", waited_ms=round((time.monotonic() - started) * 1000, 1))
        return None

    def update(self, total_bytes: int, *, max_queued: int, max_wait_s: float, retry_after_s: float,
               batch_size: Optional[int] = None) -> None:
        """New limits (a live configuration change); waiting requests look again."""
        with self._cond:
            self.configured_bytes, self.max_queued = total_bytes, max_queued
            self.max_wait_s, self.retry_after_s = max_wait_s, retry_after_s
            self.batch_size = batch_size
            self._cond.notify_all()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._held.remove(nbytes)
            self._cond.notify_all()

    def _busy(self, why: str, nbytes: int) -> GuardianError:
        return GuardianError(
            f"The server is busy: {why}. This request needs {describe_bytes(nbytes)} of KV cache; "
            f"{describe_bytes(self.in_use)} of {describe_bytes(self.total_bytes)} are in use. "
            "Retry later.",
            status=429,
            type="rate_limit_error",
            code="kv_cache_budget_busy",
            retry_after_s=self.retry_after_s,
            extra={"kv_cache_bytes": nbytes, "kv_budget_bytes": self.total_bytes},
        )


class PromptGuard:
    name = "prompt_guard"
    Settings = PromptGuardSettings

    def __init__(self, settings: PromptGuardSettings):
        self.settings = settings
        self.budget: Optional[KVBudget] = None
        self.served_limits: Optional[ModelLimits] = None
        self.memory_cap = MemoryCap(margin=settings.kv_budget_margin, hold_s=settings.memory_cap_hold_s)
        self._kv_at_failure = 0  # KV admitted when the engine last failed
        # Requests let in over a learned cap, alone, each reserving all of it (reserve_kv_cache).
        self._over_the_cap = ActiveCount()

    # -- start-up -------------------------------------------------------------
    @guardian.hookimpl
    def guardian_startup(self, engine):
        self.apply(engine)

    @guardian.hookimpl
    def on_config_reloaded(self, engine, changed):
        if any(key.startswith(f"{self.name}.") for key in changed):
            self.apply(engine, reloaded=True)

    def apply(self, engine, reloaded: bool = False):
        """Set the limits the settings give: on the engine, and the KV budget."""
        s = self.settings
        if not s.enabled:
            engine.set_max_body_bytes(None)
            engine.set_context_length(None)
            log.info("prompt_guard_disabled")
            return
        engine.set_max_body_bytes(s.max_body_bytes or None)
        # The first private tokenizer copy is made now, not on the first request.
        engine.warm_tokenizer()
        # During a reload no model is loaded: the limits of the one it reads again.
        limits = engine.served_limits()
        limits = limits if limits is not None else self.served_limits
        if limits is None:
            log.warning("prompt_guard_not_applied", reason="no model is loaded")
            return
        self.served_limits = limits
        n_ctx = self.context_limit(limits)
        engine.set_context_length(n_ctx)
        if limits.context_length is None:
            log.warning(
                "context_length_unknown",
                looked_for=list(CONTEXT_LENGTH_KEYS),
                max_context_tokens=s.max_context_tokens or None,
                hint="no context length in the model's config.json; "
                "set max_context_tokens in [prompt_guard] to check prompt lengths",
            )
        budget_bytes, budget_source = self.budget_bytes(limits)
        budget = dict(max_queued=s.max_queued, max_wait_s=s.max_queue_wait_s, retry_after_s=s.retry_after_s,
                      batch_size=engine.decode_batch_size())
        if self.budget is None:
            self.budget = KVBudget(budget_bytes, **budget)
        else:  # requests in flight keep their share of the one budget
            self.budget.update(budget_bytes, **budget)
        log.info(
            "prompt_guard_reconfigured" if reloaded else "prompt_guard_ready",
            max_context_tokens=n_ctx,
            model_context_length=limits.context_length,
            context_length_key=limits.context_length_key,
            max_prompt_tokens=s.max_prompt_tokens or None,
            on_overflow=s.on_overflow,
            truncate_messages=s.truncate_messages,
            kv_bytes_per_token=limits.kv_bytes_per_token,
            kv_dtype=limits.kv_dtype,
            sliding_window_layers=sum(layer.window is not None for layer in limits.kv_layers),
            kv_budget_bytes=budget_bytes,
            kv_budget_source=budget_source,
            weights_bytes=limits.weights_bytes,
            max_body_bytes=s.max_body_bytes or None,
        )

    def context_limit(self, limits: ModelLimits) -> Optional[int]:
        return self.settings.max_context_tokens or limits.context_length

    def budget_bytes(self, limits: ModelLimits) -> tuple[int, str]:
        s = self.settings
        if s.kv_budget_bytes:
            return s.kv_budget_bytes, "configured"
        memory, source = device_memory()
        free = max(0, memory - limits.weights_bytes)
        return int(free * max(0.0, 1 - s.kv_budget_margin)), source

    # -- admission --------------------------------------------------------------
    @guardian.hookimpl
    def admit_request(self, admission: Admission, engine):
        if not self.settings.enabled:
            return None
        n_ctx = self.context_limit(admission.limits)
        if self.settings.truncate_messages and admission.is_chat:
            self.truncate(admission, n_ctx)
        n_prompt = admission.n_prompt_tokens
        max_tokens = admission.args.max_tokens
        admission.log_fields.update(n_prompt_tokens=n_prompt, n_ctx=n_ctx, max_tokens=max_tokens)
        error = self.check_length(admission, n_prompt, n_ctx)
        # A continuation's context holds the tokens it goes on after, as the first run's did:
        # left out, a clamped stream continued on the next child got its clamp again after
        # them, past the model's context (78 tokens where 58 fitted).
        if error is None and n_ctx is not None and n_prompt + admission.carried_tokens + max_tokens > n_ctx:
            error = self.overflow(admission, n_prompt, n_ctx)
        if error is None:
            # The engine's loop waits a moment for requests being admitted,
            # but not for one that waits for the loop to free KV memory.
            with engine.set_aside():
                error = self.reserve_kv_cache(admission, n_ctx)
        return error

    def prompt_limit(self, n_ctx: Optional[int]) -> Optional[int]:
        """The most prompt tokens a request may have: one token must fit after them."""
        # A context of 1 leaves no prompt token: 0, every prompt refused (it was dropped as
        # "no limit", and the clamp left max_tokens below 1, which failed in the engine).
        limits = [n for n in (self.settings.max_prompt_tokens or None, n_ctx - 1 if n_ctx else None)
                  if n is not None]
        return min(limits) if limits else None

    def check_length(self, admission: Admission, n_prompt: int, n_ctx: Optional[int]):
        cap = self.prompt_limit(n_ctx)
        if cap is None or n_prompt <= cap:
            return None
        if n_ctx is None:
            why = (f"This server accepts at most {cap} prompt tokens; "
                   f"your request has {n_prompt} prompt tokens.")
        elif cap < n_ctx - 1:
            why = (f"This model's maximum context length is {n_ctx} tokens; your request has "
                   f"{n_prompt} prompt tokens, over this server's limit of {cap} prompt tokens.")
        else:
            why = (f"This model's maximum context length is {n_ctx} tokens; your request has "
                   f"{n_prompt} prompt tokens, which leaves no room for the completion.")
        return context_error(admission, why + f" {shorten(admission)}", n_prompt, n_ctx)

    def overflow(self, admission: Admission, n_prompt: int, n_ctx: int):
        requested = admission.args.max_tokens
        fits = n_ctx - n_prompt - admission.carried_tokens
        if self.settings.on_overflow == "reject" or fits < 1:  # < 1: a continuation past the context
            return context_error(
                admission,
                f"This model's maximum context length is {n_ctx} tokens; your request has "
                f"{n_prompt} prompt tokens and asks for {requested} completion tokens "
                f"({n_prompt + requested} in total). Lower max_tokens to {fits} or less, "
                f"or {shorten(admission).lower()}",
                n_prompt,
                n_ctx,
            )
        admission.args.max_tokens = fits
        admission.response_headers["X-Guardian-Clamped-Max-Tokens"] = str(fits)
        admission.log_fields["max_tokens"] = fits
        log.info("max_tokens_clamped", requested=requested, clamped=fits,
                 n_prompt_tokens=n_prompt, n_ctx=n_ctx)
        return None

    def reserve_kv_cache(self, admission: Admission, n_ctx: Optional[int]):
        if self.budget is None:
            return None
        tokens = admission.n_prompt_tokens + admission.carried_tokens + admission.args.max_tokens
        if n_ctx is not None:
            tokens = min(tokens, n_ctx)
        nbytes = admission.limits.kv_bytes(tokens)
        admission.log_fields["kv_cache_bytes"] = nbytes
        budget, switch = self.budget.total_bytes, ""
        if admission.limits != self.served_limits:
            # Another model, switched in when this request gets to the
            # engine: its own weights take the place of the served model's.
            budget = self.budget_bytes(admission.limits)[0]
            switch = (f" (the model this request names has {describe_bytes(admission.limits.weights_bytes)} "
                      "of weights)")
        over_the_cap_alone = nbytes > budget and not switch and nbytes <= self.budget.configured_bytes
        if over_the_cap_alone and self.memory_cap.measured_bytes is not None:
            return self.shortage(admission, nbytes, budget)  # the device says it has not the memory now
        if nbytes > budget and not over_the_cap_alone:
            if not switch:
                budget = self.budget.configured_bytes  # the device's total: it never fits
            return GuardianError(
                f"This request needs {describe_bytes(nbytes)} of KV cache "
                f"({admission.n_prompt_tokens} prompt + {admission.args.max_tokens} completion "
                f"tokens); this server's KV cache budget is {describe_bytes(budget)}{switch}. "
                f"Lower max_tokens, or {shorten(admission).lower()}",
                status=400,
                type="invalid_request_error",
                param=prompt_param(admission),
                code="kv_cache_budget_exceeded",
                extra={
                    "n_prompt_tokens": admission.n_prompt_tokens,
                    "max_tokens": admission.args.max_tokens,
                    "kv_cache_bytes": nbytes,
                    "kv_budget_bytes": budget,
                },
            )
        # One budget counts the KV cache in flight, whichever model holds it;
        # a switched-in model's request that fits its own budget takes at
        # most all of it (the batch drains before stock switches models). So
        # does one over a cap learned from a failure alone, with nothing to
        # measure the device by (guardian.admission.memory_cap): it runs alone,
        # in its turn. It was refused 503 until the cap lifted, and one failure
        # with one request in flight capped the budget below that request's
        # size: every request as large, for a minute, the passing shortage long
        # past. A lasting one fails it alone, and that failure's 503
        # memory_shortage says come back (guardian.engine.blame).
        reserved = min(nbytes, self.budget.total_bytes)
        error = self.budget.reserve(reserved, gave_up=request_ended)
        if error is None:
            alone = over_the_cap_alone and reserved < nbytes
            if alone:
                self._over_the_cap.__enter__()
            admission.on_finish(lambda: self._release(reserved, alone))
        return error

    def _release(self, reserved: int, over_the_cap: bool) -> None:
        try:
            self.budget.release(reserved)
        finally:
            if over_the_cap:  # counted out whatever happens: a count left over would stop all learning
                self._over_the_cap.__exit__(None, None, None)

    def shortage(self, admission: Admission, nbytes: int, cap: int) -> GuardianError:
        """A request over the measured cap, within the budget: 503, come back when memory is."""
        return GuardianError(
            f"This request needs {describe_bytes(nbytes)} of KV cache "
            f"({admission.n_prompt_tokens} prompt + {admission.args.max_tokens} completion tokens); "
            f"the device is short of memory now: the KV cache budget was lowered from "
            f"{describe_bytes(self.budget.configured_bytes)} to {describe_bytes(cap)}, what the device "
            "can give since the engine ran out of device memory. Retry later.",
            status=503,
            code="memory_shortage",
            retry_after_s=self.settings.retry_after_s,
            extra={"kv_cache_bytes": nbytes, "kv_budget_bytes": cap,
                   "kv_budget_configured_bytes": self.budget.configured_bytes},
        )

    # -- memory the device could not give (guardian.admission.memory_cap) ---------
    @guardian.hookimpl(tryfirst=True)  # firstresult: a classifier run before it would skip the note
    def classify_engine_error(self):
        """The first moment of an engine failure: note the KV admitted then.
        Classifying is the recovery plugin's (None: no opinion)."""
        if self.budget is not None:
            # A request let in over the cap reserved the cap, less than its KV: its failure
            # says it does not fit now (its 503 memory_shortage), not that the cap is too
            # high. Learned from, each of a client's retries cut the cap by the margin, until
            # every request ran alone and the rest got 429 kv_cache_budget_busy.
            self._kv_at_failure = 0 if self._over_the_cap.active else self.budget.in_use
        return None

    @guardian.hookimpl
    def on_engine_restarted(self, classification):
        """The dead loop's memory is released: cap the budget at what the device gives now."""
        if classification != "out_of_memory" or self.budget is None or self.served_limits is None:
            return
        self.memory_cap.margin = self.settings.kv_budget_margin
        self.memory_cap.hold_s = self.settings.memory_cap_hold_s
        self.memory_cap.engine_failed(self._kv_at_failure)
        self._set_cap(self.memory_cap.restarted(self.served_limits.weights_bytes, self.budget.configured_bytes),
                      lifted=False)

    @guardian.hookimpl
    def on_resource_sample(self, sample):
        """While capped, look again: memory that came back is admitted again."""
        if self.budget is None or self.served_limits is None or self.budget.cap_bytes is None:
            return
        self.memory_cap.hold_s = self.settings.memory_cap_hold_s  # live
        cap, lifted = self.memory_cap.resample(self.served_limits.weights_bytes, self.budget.configured_bytes)
        if lifted or cap != self.budget.cap_bytes:
            self._set_cap(cap, lifted=lifted)

    def _set_cap(self, cap: Optional[int], *, lifted: bool) -> None:
        previous = self.budget.cap_bytes
        self.budget.set_cap(cap)
        fields = dict(kv_budget_bytes=self.budget.total_bytes, kv_budget_configured_bytes=self.budget.configured_bytes,
                      kv_in_use_bytes=self.budget.in_use, **self.memory_cap.status())
        if cap is not None:
            log.warning("kv_budget_lowered", previous_cap_bytes=previous, **fields)
        elif previous is not None or lifted:
            log.info("kv_budget_restored", **fields)

    # -- truncation ---------------------------------------------------------------
    def truncate(self, admission: Admission, n_ctx: Optional[int]) -> None:
        """Drop the oldest turns until the prompt fits; keep system messages and the last user turn.

        Cuts fall only before a user message, so what remains starts with a
        user turn (templates that insist on alternating roles still render)
        and no tool result loses the call it answers. A binary search over
        the cuts tokenizes O(log n) variants.
        """
        cap = self.prompt_limit(n_ctx)
        if cap is None:
            return
        # Stock's tokenization rewrites messages in place: keep them as they came.
        messages = copy.deepcopy(admission.request.messages)
        n_prompt = admission.n_prompt_tokens
        # A continuation's, with the tokens it goes on after: the same sum as its first run's,
        # so the same messages are dropped.
        max_tokens = admission.carried_tokens + admission.args.max_tokens

        def fits_with_completion(n: int) -> bool:
            return n <= cap and (n_ctx is None or n + max_tokens <= n_ctx)

        if fits_with_completion(n_prompt):
            return
        cuts = cut_points(messages)
        variants: dict[int, object] = {}

        def variant(cut: int):
            if cut not in variants:
                variants[cut] = admission.variant(without_turns_before(messages, cut))
            return variants[cut]

        chosen = (first_fitting(cuts, lambda c: fits_with_completion(variant(c).n_prompt_tokens))
                  or first_fitting(cuts, lambda c: variant(c).n_prompt_tokens <= cap))
        if chosen is None:
            if n_prompt > cap and cuts:
                log.info("truncation_insufficient", n_prompt_tokens=n_prompt,
                         n_prompt_tokens_min=variant(cuts[-1]).n_prompt_tokens, limit=cap)
            return
        dropped = sum(1 for m in messages[:chosen] if m.get("role") not in SYSTEM_ROLES)
        admission.adopt(variants[chosen])
        admission.response_headers["X-Guardian-Truncated-Messages"] = str(dropped)
        admission.log_fields["truncated_messages"] = dropped
        log.info("messages_truncated", dropped=dropped, n_prompt_tokens_before=n_prompt,
                 n_prompt_tokens=admission.n_prompt_tokens, n_ctx=n_ctx)


def cut_points(messages: list) -> list[int]:
    """Indices of user messages a conversation may start at after truncation, oldest first."""
    first_turn = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), None)
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if first_turn is None or not users:
        return []
    return [i for i in users if i > first_turn]


def without_turns_before(messages: list, cut: int) -> list:
    return [m for m in messages[:cut] if m.get("role") in SYSTEM_ROLES] + messages[cut:]


def first_fitting(cuts: list[int], fits) -> Optional[int]:
    """The earliest cut that fits (fewest messages dropped), or None."""
    low, high, found = 0, len(cuts) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if fits(cuts[middle]):
            found, high = cuts[middle], middle - 1
        else:
            low = middle + 1
    return found


# -- errors ------------------------------------------------------------------------
def prompt_param(admission: Admission) -> str:
    return "messages" if admission.is_chat else "prompt"


def shorten(admission: Admission) -> str:
    return "Shorten the message history." if admission.is_chat else "Shorten the prompt."


def context_error(admission: Admission, message: str, n_prompt: int, n_ctx: Optional[int]) -> GuardianError:
    return GuardianError(
        message,
        status=400,
        type="invalid_request_error",
        param=prompt_param(admission),
        code="context_length_exceeded",
        extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx},
    )

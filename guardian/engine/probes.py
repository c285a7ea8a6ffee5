"""Probes: a synthetic request that proves the engine generates.

``Probes`` is the engine's collaborator for them: one token generated
through the same queue and loop as users' requests (the generation_probe
plugin's ``probe`` hook calls it through the EngineView), its prompt kept out
of the prompt cache so a probe never evicts users' entries.
"""

from __future__ import annotations

import copy
import itertools
import time
from queue import Empty, Queue
from typing import Optional

import structlog

from guardian import stock
from guardian.request_context import request_scope

log = structlog.get_logger("guardian.engine")


# How many probe prompts are kept out of the prompt cache: the latest of each plugin's.
SKIPPED_PROMPTS = 8
# Added to an end-of-sequence token's logit in a proof of several steps: never the greedy pick.
END_OF_SEQUENCE_BIAS = -1e9


def no_end_of_sequence(tokenizer) -> Optional[dict]:
    """A logit bias that keeps a greedy completion from ending its sequence early; None
    where no end-of-sequence token is known (no tokenizer: weights being read)."""
    ends = getattr(tokenizer, "eos_token_ids", None) if tokenizer is not None else None
    return {int(token): END_OF_SEQUENCE_BIAS for token in ends} if ends else None


# How a probe that timed out says so (guardian.health.stall_detection reads it).
NO_TOKEN_WITHIN = "no token within"


class Probes:
    """One engine's probes."""

    def __init__(self, engine):
        self.engine = engine
        self._ids = itertools.count(1)
        # The probe plugin's prompt (kept out of the prompt cache): a proof's too.
        self.proof_prompt: Optional[str] = None

    def probe(self, prompt: str, timeout_s: float) -> dict:
        """Generate one token through the same queue and loop as users' requests.

        Returns ``{"ok", "duration_ms", "error", "token"}``; never waits
        longer than ``timeout_s``.
        """
        started = time.monotonic()
        request, args = stock.requests.make_request(prompt, max_tokens=1, cli_args=self.engine.cli_args)
        responses: Queue = Queue()
        with request_scope(f"probe-{next(self._ids)}", stream=True):
            record = self.engine.ledger.put((responses, request, args), synthetic=True)
        result = {"ok": False, "error": None, "token": None}
        deadline = started + timeout_s
        try:
            while True:
                item = responses.get(timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(item, BaseException):
                    result["error"] = f"{type(item).__name__}: {item}"
                    break
                if isinstance(item, stock.contract.Response):
                    result.update(ok=True, token=item.token)
                if item is None:
                    break
        except Empty:
            result["error"] = f"{NO_TOKEN_WITHIN} {timeout_s:g} s"
            record.cancel()
        result["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
        return result

    def queue_proof(self, why: str, steps: int = 1) -> bool:
        """Queue a probe to run alone ahead of every waiting request, waited for by nobody
        (the loop thread, after a failure): its completion proves the engine generates,
        before a suspect is blamed or between two blames (guardian.engine.blame,
        guardian.engine.failures). ``steps``: it generates that many tokens, one a step
        after its prefill, its end of sequence barred so that it runs them all. False: no
        probe plugin gave a prompt."""
        if self.proof_prompt is None:
            return False
        bias = no_end_of_sequence(self.engine.model_provider.tokenizer) if steps > 1 else None
        if steps > 1 and bias is None:
            log.warning("proof_probe_may_end_early", tokens=steps,
                        reason="no tokenizer, or no end-of-sequence token known: it cannot be barred")
        request, args = stock.requests.make_request(self.proof_prompt, max_tokens=steps, cli_args=self.engine.cli_args,
                                                    logit_bias=bias)
        # Not a stream: a proof that failed after tokens is run again from nothing, not
        # continued (a continuation's steps alone would be what it proved).
        with request_scope(f"proof-{next(self._ids)}", stream=False):
            self.engine.ledger.put((Queue(), request, args), synthetic=True, first=True)
        log.info("proof_probe_queued", why=why, tokens=steps)
        return True

    def keep_out_of_prompt_cache(self, prompt: str, *, deferred: bool = False) -> None:
        """Keep probe prompts out of the prompt cache."""
        self.proof_prompt = prompt
        tokenizer = self.engine.model_provider.tokenizer
        if tokenizer is None:
            # A reload is reading the weights: the loop asks for work again only
            # once it has them, and then tokenizes the prompt (once).
            if not deferred:
                self.engine.on_loop_thread(lambda: self.keep_out_of_prompt_cache(prompt, deferred=True))
            else:
                log.warning("probe_prompt_not_tokenized", reason="no model is loaded")
            return
        # On a copy: the loop thread may be using the tokenizer, and fast
        # tokenizers shared between threads can fail ("Already borrowed").
        tokens = list(copy.deepcopy(tokenizer).encode(prompt))
        cache = self.engine.prompt_cache
        # The latest few, each once: a save that changes the probe's prompt keeps the old one
        # out a while longer, not for good (each save added one to every cache insert's check).
        # Replaced whole: the loop thread reads the list as it inserts.
        cache.skip_prefixes = [*(kept for kept in cache.skip_prefixes if kept != tokens), tokens][-SKIPPED_PROMPTS:]

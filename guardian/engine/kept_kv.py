"""The KV caches a failed loop's batch held, kept for the requests it re-runs.

After an engine failure the restarted loop is given the requests the dead
one had taken: a continuation's prompt is its prompt followed by the tokens
already generated, a re-run's its prompt. Stock's prompt cache knows at most
the prompt (cached at the end of its segment), so each of them was prefilled
again, generated tokens and all, and under frequent failures that prefill
was most of the work (bench/soak.py). When the failure left the batch's KV
caches as its last completed step wrote them, the engine copies each
request's cache out before the dead loop is released
(``stock.continuation.rows_of_completed_steps``) and keeps it here; the prompt cache
(``GuardianPromptCache.fetch_nearest_cache``) hands a re-run the kept cache
that holds the longest prefix of its prompt, cut back so that at least the
prompt's last token is prefilled. Each kept cache serves one request; what
no re-run took is dropped once the loop has taken every re-run.

Loop thread only, apart from ``drop`` (a stall, from the watchdog, when the
loop that would read them is stuck) and ``status``.
"""

from __future__ import annotations

from typing import Optional

from guardian import stock


class KeptKV:
    """Kept KV caches by the model they were computed with, and what became of them."""

    def __init__(self):
        self._rows: list[tuple[object, list[int], list]] = []  # (model key, tokens held, cache)
        self.kept = self.reused = self.dropped = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._rows)

    def keep(self, model_key, rows: list[tuple[list[int], list]]) -> None:
        """Keep ``rows`` (tokens held, cache), computed with the model ``model_key``,
        beside any still kept from an earlier failure."""
        self._rows = self._rows + [(model_key, tokens, cache) for tokens, cache in rows]
        self.kept += len(rows)

    def take(self, model_key, prompt: list[int]) -> Optional[tuple[list, list[int]]]:
        """The kept cache that spares ``prompt`` the most prefill, cut to the prefix
        it holds, and the tokens left to prefill; None when none holds a prefix."""
        rows = self._rows
        best, best_length = None, 0
        for index, (model, tokens, cache) in enumerate(rows):
            if model != model_key:
                continue
            length = stock.continuation.reusable_length(prompt, tokens, cache)
            if length > best_length:
                best, best_length = index, length
        if best is None:
            return None
        _, tokens, cache = rows[best]
        self._rows = rows[:best] + rows[best + 1:]
        self.reused += 1
        self.reused_tokens += best_length
        return stock.continuation.cut_cache(cache, len(tokens), best_length), prompt[best_length:]

    def drop(self) -> int:
        """Forget every kept cache; return how many there were."""
        dropped, self._rows = len(self._rows), []
        self.dropped += dropped
        return dropped

    @property
    def nbytes(self) -> int:
        return sum(stock.continuation.cache_nbytes(cache) for _, _, cache in self._rows)

    def status(self) -> dict:
        """For /guardian/status: kept caches, and how many re-runs used one."""
        return {"kept": self.kept, "reused": self.reused, "dropped": self.dropped,
                "reused_tokens": self.reused_tokens, "held": len(self._rows)}

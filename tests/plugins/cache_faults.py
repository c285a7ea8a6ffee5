"""A fault that lives in the engine's state, not in the request: a bad prompt cache entry.

A test plugin (``[guardian] plugins = ["tests.plugins.cache_faults:CacheFaults"]``).
It wraps mlx_lm's own ``BatchGenerator`` (``mlx_lm.generate``), as
``position_faults`` does, so the failure comes from inside stock's step.

- ``marker``: requests whose prompt text contains this are noted when admitted
  (their prompt tokens).
- ``insert_segments``: a row of a noted request that starts from KV made before
  it (``all_tokens``: a prompt cache entry, or a failed batch's KV kept for its
  re-run) is a row on a bad entry.
- ``next``: a step that produces a token for a row on a bad entry raises. The
  same request run with nothing from before it (its whole prompt prefilled) is
  served: the fault is the entry's, as a stale or corrupt cache entry's would be.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

import structlog

import guardian
from tests.plugins.stock_rows import prompt_text, whole_prompts

log = structlog.get_logger("tests.cache_faults")
generate = importlib.import_module("mlx_lm.generate")


class BadCacheEntry(RuntimeError):
    pass


@dataclass
class CacheFaultsSettings:
    marker: str = ""


class CacheFaults:
    name = "cache_faults"
    Settings = CacheFaultsSettings

    def __init__(self, settings: CacheFaultsSettings):
        self.settings = settings
        self._lock = threading.Lock()
        self._noted: list[list[int]] = []
        self._bad_rows: set[int] = set()
        self._plant()

    @guardian.hookimpl
    def admit_request(self, admission):
        text = prompt_text(admission.request)
        if self.settings.marker and self.settings.marker in text:
            with self._lock:
                self._noted.append(list(admission.prompt_tokens))
        return None

    def _noted_prompt(self, full: list[int]) -> bool:
        with self._lock:
            return any(full[: len(noted)] == noted for noted in self._noted)

    def _plant(self) -> None:
        stock_insert = generate.BatchGenerator.insert_segments
        stock_next = generate.BatchGenerator.next
        plugin = self

        def insert_segments(generator, segments, max_tokens=None, caches=None, all_tokens=None, *args, **kwargs):
            fulls = whole_prompts(segments, all_tokens)
            uids = stock_insert(generator, segments, max_tokens, caches, all_tokens, *args, **kwargs)
            for uid, full, before in zip(uids, fulls, all_tokens or [[] for _ in segments]):
                if len(before) and plugin._noted_prompt(full):
                    plugin._bad_rows.add(uid)
            return uids

        def next(generator):
            responses = stock_next(generator)
            for response in responses[1]:  # (prompt responses, generation responses): 0.31 and 0.32
                if response.uid in plugin._bad_rows:
                    plugin._bad_rows.discard(response.uid)
                    log.warning("cache_fault", uid=response.uid)
                    raise BadCacheEntry("planted: a row on a bad prompt cache entry")
            return responses

        generate.BatchGenerator.insert_segments = insert_segments
        generate.BatchGenerator.next = next

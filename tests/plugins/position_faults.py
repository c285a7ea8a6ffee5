"""A true poison request: it fails the engine at the same token every time it runs.

A test plugin (``[guardian] plugins = ["tests.plugins.position_faults:PositionFaults"]``).
It wraps mlx_lm's own ``BatchGenerator`` (``mlx_lm.generate``), which the
guardian's observed subclass calls through ``super()``, so the failure comes
from inside stock's step, as a kernel that faults on one sequence would.

- ``marker``: a request whose prompt text contains this is the poison; its
  prompt tokens are noted when it is admitted.
- ``insert_segments``: a row whose whole prompt (the cached tokens, then the
  segments) starts with the poison's prompt is the poison's row, standing
  at ``len(prompt) - len(poison prompt)`` tokens generated (a continuation
  carries the tokens generated before in its prompt).
- ``next``: when stock's step produces the poison's token number
  ``fail_at`` (0-based, counted across its runs), the step raises instead
  of returning: that token never reaches the request, which stands at
  ``fail_at`` tokens generated at every failure.
- ``times``: how many faults in all (0: no limit).
- ``message``: what the step raises (a RuntimeError); "": the planted poison's own. The
  incident's Metal message makes it a memory failure, as the engine classifies it.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Optional

import structlog

import guardian
from tests.plugins.stock_rows import prompt_text, whole_prompts

log = structlog.get_logger("tests.position_faults")
# The module (the package's ``mlx_lm.generate`` attribute is the function).
generate = importlib.import_module("mlx_lm.generate")


class PlantedPoison(RuntimeError):
    pass


@dataclass
class PositionFaultsSettings:
    marker: str = ""
    fail_at: int = 0
    times: int = 0
    message: str = ""


class PositionFaults:
    name = "position_faults"
    Settings = PositionFaultsSettings

    def __init__(self, settings: PositionFaultsSettings):
        self.settings = settings
        self._lock = threading.Lock()
        self._poison: Optional[list[int]] = None  # its prompt tokens, once admitted
        self._rows: dict[int, list[int]] = {}  # uid -> [tokens it stood at when inserted, tokens since]
        self.faults = 0
        self._plant()

    @guardian.hookimpl
    def guardian_startup(self):
        log.warning("position_faults_planted", **vars(self.settings))

    @guardian.hookimpl
    def admit_request(self, admission):
        text = prompt_text(admission.request)
        if self.settings.marker in text:
            with self._lock:
                self._poison = list(admission.prompt_tokens)
        return None

    def _standing(self, full_prompt: list[int]) -> Optional[int]:
        """Tokens the poison had generated, if ``full_prompt`` is the poison's (or a continuation's)."""
        with self._lock:
            poison = self._poison
        if poison is None or full_prompt[: len(poison)] != poison:
            return None
        return len(full_prompt) - len(poison)

    def _plant(self) -> None:
        stock_insert = generate.BatchGenerator.insert_segments
        stock_next = generate.BatchGenerator.next
        plugin = self

        def insert_segments(generator, segments, max_tokens=None, caches=None, all_tokens=None, *args, **kwargs):
            fulls = whole_prompts(segments, all_tokens)
            uids = stock_insert(generator, segments, max_tokens, caches, all_tokens, *args, **kwargs)
            for uid, full in zip(uids, fulls):
                standing = plugin._standing(full)
                if standing is not None:
                    plugin._rows[uid] = [standing, 0]
            return uids

        def next(generator):
            responses = stock_next(generator)
            # (prompt responses, generation responses), in 0.31 and 0.32
            for response in responses[1]:
                row = plugin._rows.get(response.uid)
                if row is None:
                    continue
                position = row[0] + row[1]
                row[1] += 1
                settings = plugin.settings
                if position == settings.fail_at and (not settings.times or plugin.faults < settings.times):
                    plugin.faults += 1
                    log.warning("position_fault", position=position, faults=plugin.faults)
                    if settings.message:
                        raise RuntimeError(settings.message)
                    raise PlantedPoison(f"planted poison at token {position} of the marked request")
            return responses

        generate.BatchGenerator.insert_segments = insert_segments
        generate.BatchGenerator.next = next

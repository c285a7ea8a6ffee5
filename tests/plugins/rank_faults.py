"""Faults planted in one rank's own step of stock's, from outside the guardian (a test plugin).

``[guardian] plugins = ["tests.plugins.rank_faults:RankFaults"]`` with ``[rank_faults]
rank = 1`` wraps mlx_lm's own ``BatchGenerator.next`` in that rank of an mlx.launch group
(the guardian's step hook has run by then, as when a native failure or hang happens inside
stock's step):

- ``arm_file = PATH``: once PATH exists, every step raises RuntimeError, so a test can let a
  completion through first and fail the rank mid-burst (``rank_fault_planted``);
- ``hang_at_call = N``: the rank's Nth ``next()`` (the first is 1) blocks until the process
  ends (``rank_step_hang``), its interpreter free, as a native deadlock leaves it.
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass

import mlx.core as mx
import structlog

import guardian

log = structlog.get_logger("tests.rank_faults")
# The module (the package's ``mlx_lm.generate`` attribute is the function).
generate = importlib.import_module("mlx_lm.generate")


@dataclass
class RankFaultsSettings:
    rank: int = 1
    arm_file: str = ""
    hang_at_call: int = 0


class RankFaults:
    name = "rank_faults"
    Settings = RankFaultsSettings

    def __init__(self, settings: RankFaultsSettings):
        self.settings = settings
        self.released = threading.Event()
        self.calls = 0
        if mx.distributed.init().rank() == settings.rank:
            self._plant()

    @guardian.hookimpl
    def guardian_shutdown(self):
        self.released.set()

    def _plant(self) -> None:
        stock_next = generate.BatchGenerator.next
        plugin, settings = self, self.settings

        def next(generator):
            plugin.calls += 1  # the generation loop's thread alone calls it
            if settings.arm_file and os.path.exists(settings.arm_file):
                log.warning("rank_fault_planted", call=plugin.calls)
                raise RuntimeError(f"planted failure on rank {settings.rank}")
            if plugin.calls == settings.hang_at_call:
                log.warning("rank_step_hang", call=plugin.calls)
                plugin.released.wait()
            return stock_next(generator)

        generate.BatchGenerator.next = next

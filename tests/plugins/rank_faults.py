"""A failure planted in one rank's engine step, armed by a file (a test plugin).

``[guardian] plugins = ["tests.plugins.rank_faults:RankFaults"]`` with
``[rank_faults] rank = 1`` and ``arm_file = PATH``: every engine step of
that rank of an mlx.launch group raises RuntimeError once PATH exists, so a
test can let a completion through first and fail the rank mid-burst.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import structlog

import guardian

log = structlog.get_logger("tests.rank_faults")


@dataclass
class RankFaultsSettings:
    rank: int = 1
    arm_file: str = ""


class RankFaults:
    name = "rank_faults"
    Settings = RankFaultsSettings

    def __init__(self, settings: RankFaultsSettings):
        self.settings = settings
        self.mine = mx.distributed.init().rank() == settings.rank

    @guardian.hookimpl
    def on_engine_step(self, step):
        if self.mine and self.settings.arm_file and os.path.exists(self.settings.arm_file):
            log.warning("rank_fault_planted", step=step)
            raise RuntimeError(f"planted failure on rank {self.settings.rank}")

"""A resource sample that takes a while, as one that reads a busy device's counters may.

A test plugin (``[guardian] plugins = ["tests.plugins.slow_sample:SlowSample"]``):
``sample_resources`` (the watchdog's thread) logs ``slow_sample_started`` and
then waits ``hold_s`` before it returns, so a test can pause the whole process
while the watchdog is inside one of its looks. Nothing else.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

import guardian

log = structlog.get_logger("tests.slow_sample")


@dataclass
class SlowSampleSettings:
    hold_s: float = 0.8


class SlowSample:
    name = "slow_sample"
    Settings = SlowSampleSettings

    def __init__(self, settings: SlowSampleSettings):
        self.settings = settings

    @guardian.hookimpl
    def sample_resources(self, engine):
        log.info("slow_sample_started", hold_s=self.settings.hold_s)
        threading.Event().wait(self.settings.hold_s)
        return {"slow_sample_held_s": self.settings.hold_s}

"""Restarts that take a while, as a large model's reload does.

A test plugin (``[guardian] plugins = ["tests.plugins.slow_restart:SlowRestart"]``):
``on_engine_error`` (the loop thread, between the failure and the restart)
holds the restart for ``hold_s`` and answers nothing, so the built-in
recovery decides as ever. Reading 40 GB of weights again after the page cache
was evicted (the incident's memory pressure) takes about as long per GB.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import guardian


@dataclass
class SlowRestartSettings:
    hold_s: float = 0.5


class SlowRestart:
    name = "slow_restart"
    Settings = SlowRestartSettings

    def __init__(self, settings: SlowRestartSettings):
        self.settings = settings

    @guardian.hookimpl
    def on_engine_error(self):
        threading.Event().wait(self.settings.hold_s)
        return None

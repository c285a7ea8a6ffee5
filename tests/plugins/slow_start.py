"""A start that takes a while after the model has loaded, as a large model's does.

A test plugin (``[guardian] plugins = ["tests.plugins.slow_start:SlowStart"]``):
``guardian_startup`` (main thread, before the server installs its signal
handlers) logs ``slow_start_waiting`` and holds the start for ``hold_s``, so a
test can send a signal in the window a real model's load leaves; with
``hold_before_load_s``, the plugin's making holds it before the model loads
and before the server binds its port. With ``judge_s``, each reading of its table
waits that long (logging ``slow_start_judging``): a plugin slow to check a file's
new version, which delays the server's verdict on it. Nothing else.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import structlog

import guardian

log = structlog.get_logger("tests.slow_start")
# The main thread holds in slices this long. A signal that lands as it is about to block
# (after Python last looked for one) interrupts no wait, and its handler runs only once the
# wait ends: a Ctrl-C at one 30 s wait ended the process 30 s later (a CI flake under
# load), where a real model's load returns to Python often.
SLICE_S = 0.05


def hold(seconds: float) -> None:
    """Wait ``seconds`` on this thread, a signal's handler running within SLICE_S."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        threading.Event().wait(min(left, SLICE_S))


@dataclass
class SlowStartSettings:
    hold_s: float = 3.0
    # Held before the model loads too (as a large model's load holds it), logging
    # ``slow_start_loading``: the plugin is made before the load, the server's bind after.
    hold_before_load_s: float = 0.0
    judge_s: float = 0.0

    def __post_init__(self):
        if self.judge_s > 0:
            log.warning("slow_start_judging", judge_s=self.judge_s)
            threading.Event().wait(self.judge_s)


class SlowStart:
    name = "slow_start"
    Settings = SlowStartSettings

    def __init__(self, settings: SlowStartSettings):
        self.settings = settings
        if settings.hold_before_load_s > 0:
            log.warning("slow_start_loading", hold_s=settings.hold_before_load_s)
            hold(settings.hold_before_load_s)

    @guardian.hookimpl
    def guardian_startup(self):
        log.warning("slow_start_waiting", hold_s=self.settings.hold_s)
        hold(self.settings.hold_s)

"""The engine's answers to its requests come late when it gives up.

A test plugin (``[guardian] plugins = ["tests.plugins.slow_give_up:SlowGiveUp"]``).
An engine that gives up changes its state, then answers every request it
holds. On a loaded machine the thread doing that can be paused between the
two, while mlx-lm 0.32's handler threads look at the state once a second as
they wait. Here the pause is made: the ledger's ``close``, which returns the
requests to answer, waits ``delay_s`` first. ``slow_give_up_waiting`` is logged.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from guardian.engine.ledger import RequestLedger

log = structlog.get_logger("tests.slow_give_up")


@dataclass
class SlowGiveUpSettings:
    delay_s: float = 2.5  # over stock's one-second look at the state


class SlowGiveUp:
    name = "slow_give_up"
    Settings = SlowGiveUpSettings

    def __init__(self, settings: SlowGiveUpSettings):
        close = RequestLedger.close

        def close_late(ledger, error):
            log.warning("slow_give_up_waiting", delay_s=settings.delay_s)
            threading.Event().wait(settings.delay_s)
            return close(ledger, error)

        RequestLedger.close = close_late

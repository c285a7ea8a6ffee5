"""A test plugin whose start-up and shutdown hooks raise, after saying what they were given,
and whose resource sample always raises.

``[guardian] plugins = ["tests.plugins.raising_observers:RaisingObservers"]``.
"""

from __future__ import annotations

import structlog

import guardian

log = structlog.get_logger("tests.raising_observers")


class ObserverBroke(RuntimeError):
    pass


class RaisingObservers:
    name = "raising_observers"

    @guardian.hookimpl
    def guardian_startup(self, engine):
        log.warning("observer_saw_engine", hook="guardian_startup", engine_type=type(engine).__name__)
        raise ObserverBroke("guardian_startup broke on purpose")

    @guardian.hookimpl
    def guardian_shutdown(self, engine, exit_code):
        log.warning("observer_saw_engine", hook="guardian_shutdown", engine_type=type(engine).__name__,
                    exit_code=exit_code)
        raise ObserverBroke("guardian_shutdown broke on purpose")

    @guardian.hookimpl
    def sample_resources(self, engine):
        raise ObserverBroke("sample_resources broke on purpose")

"""Test plugins with the mistakes a plugin's author makes, each of which the guardian must
contain, naming the plugin: ``[guardian] plugins = ["tests.plugins.careless_plugins:Name"]``.

- ``TypoRecovery``: ``on_engine_error`` answers ``"restart "`` (a typo), and
  ``classify_engine_error`` raises.
- ``WrongDoor``: ``check_access`` answers a ``GuardianError`` (``admit_request``'s way)
  on ``/ge``, ``True`` on ``/true``; no opinion elsewhere.
- ``OddSampler``: a resource sample with text, a table, and the built-in's
  ``memory_used_bytes`` (a petabyte).
- ``StuckShutdown``: ``guardian_shutdown`` never returns.
- ``RangeGate``: settings whose ``__post_init__`` checks a live field against one
  bound at start.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import guardian
from guardian.errors import GuardianError


class TypoRecovery:
    name = "typo_recovery"

    @guardian.hookimpl(tryfirst=True)
    def classify_engine_error(self, error):
        raise KeyError("a plugin's bug")

    @guardian.hookimpl(tryfirst=True)
    def on_engine_error(self, error, classification):
        return "restart "


class WrongDoor:
    name = "wrong_door"

    @guardian.hookimpl
    def check_access(self, request):
        if request.path == "/ge":
            return GuardianError("go away", status=401, code="invalid_api_key")
        if request.path == "/true":
            return True
        return None


@dataclass
class RangeSettings:
    # ``low`` is read at each use (live); ``high`` only at start.
    low: int = field(default=1, metadata={"live": True})
    high: int = 10

    def __post_init__(self):
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")


class RangeGate:
    """Settings checked across two fields, one live and one bound at start."""

    name = "range_gate"
    Settings = RangeSettings

    def __init__(self, settings):
        self.settings = settings

    @guardian.hookimpl
    def guardian_startup(self):
        pass


class OddSampler:
    """A resource sample with text, a table and a name the built-in gauges use."""

    name = "odd_sampler"

    @guardian.hookimpl
    def sample_resources(self):
        return {"odd_count": 3, "odd_text": "not-a-number", "odd_table": {"a": 1},
                "memory_used_bytes": 10 ** 15}


class StuckShutdown:
    """A shutdown hook that never returns (a plugin waiting on a connection that is gone)."""

    name = "stuck_shutdown"

    @guardian.hookimpl
    def guardian_shutdown(self):
        threading.Event().wait(600)

"""What the door holds, as numbers: the connection layer's limits (guardian.serving.connection),
from the ``[http]`` table, read at each use in one process (``LiveLimits``), and a
handler's headroom beyond the engine's own concurrency. Imports no mlx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from guardian.config.tables import CoreSettings, HttpSettings

# The settings' own defaults: written here again, they had drifted (a header count of 100
# where [http] says 99).
_HTTP, _CORE = HttpSettings(), CoreSettings()
# Handler threads beyond the engine's own concurrency and queue: health
# checks, metrics scrapes, refusals, streams finishing their last writes.
HANDLER_HEADROOM = 32


@dataclass
class ConnectionLimits:
    """The layer's deadlines and caps (the [http] settings, read at each use); by default
    the settings' defaults."""

    header_timeout_s: float = _HTTP.header_timeout_s
    body_timeout_s: float = _HTTP.body_timeout_s
    idle_timeout_s: float = _HTTP.idle_timeout_s
    send_timeout_s: float = _HTTP.send_timeout_s
    send_buffer_bytes: int = _HTTP.send_buffer_bytes
    # [http] max_handlers 0 is worked out from an engine's concurrency: with none, twice the headroom.
    max_handlers: int = _HTTP.max_handlers or 2 * HANDLER_HEADROOM
    max_header_bytes: int = _HTTP.max_header_bytes
    max_header_count: int = _HTTP.max_header_count
    max_buffered_bytes: int = _HTTP.max_buffered_bytes
    linger_s: float = _HTTP.linger_s
    max_lingering: int = _HTTP.max_lingering
    retry_after_s: float = _CORE.retry_after_s


class LiveLimits:
    """[http] as the layer reads it, at each use: ``max_handlers`` 0 is ``auto_max_handlers()``,
    read at each use too (it follows the prompt guard's live queue)."""

    def __init__(self, http, auto_max_handlers: Callable[[], int], retry_after_s=lambda: 1.0,
                 extra_handlers: int = 0, extra_headers: int = 0, extra_header_bytes: int = 0):
        self._http = http
        self._auto_max_handlers = auto_max_handlers
        self._retry_after_s = retry_after_s
        # A supervised child also answers its supervisor's health checks and scrapes.
        self._extra_handlers = extra_handlers
        # ... and reads the headers its supervisor adds to what the public port let in.
        self._extra_headers = extra_headers
        self._extra_header_bytes = extra_header_bytes

    def __getattr__(self, name):
        return getattr(self._http, name)

    @property
    def max_handlers(self) -> int:
        return (self._http.max_handlers or self._auto_max_handlers()) + self._extra_handlers

    @property
    def retry_after_s(self) -> float:
        return self._retry_after_s()

    @property
    def max_header_bytes(self) -> int:
        return self._http.max_header_bytes + self._extra_header_bytes

    @property
    def max_header_count(self) -> int:
        return self._http.max_header_count + self._extra_headers  # judge_head caps it at http.server's


def snapshot(limits) -> ConnectionLimits:
    """The limits as they are now, as plain attributes."""
    if isinstance(limits, ConnectionLimits):
        return limits
    return ConnectionLimits(**{name: getattr(limits, name) for name in ConnectionLimits.__dataclass_fields__})

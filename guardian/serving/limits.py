"""What the door holds, as numbers: the connection layer's limits (guardian.serving.connection),
from the ``[http]`` table, read at each use in one process (``LiveLimits``), and a
handler's headroom beyond the engine's own concurrency. Imports no mlx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class ConnectionLimits:
    """The layer's deadlines and caps (the [http] settings, read at each use)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    send_timeout_s: float = 30.0
    send_buffer_bytes: int = 256 * 1024
    max_handlers: int = 64
    max_header_bytes: int = 64 << 10
    max_header_count: int = 100
    max_buffered_bytes: int = 256 << 20
    linger_s: float = 2.0
    max_lingering: int = 1024
    retry_after_s: float = 1.0


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


# Handler threads beyond the engine's own concurrency and queue: health
# checks, metrics scrapes, refusals, streams finishing their last writes.
HANDLER_HEADROOM = 32


def snapshot(limits) -> ConnectionLimits:
    """The limits as they are now, as plain attributes."""
    if isinstance(limits, ConnectionLimits):
        return limits
    return ConnectionLimits(**{name: getattr(limits, name) for name in ConnectionLimits.__dataclass_fields__})

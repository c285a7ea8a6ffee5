"""A probe plugin that never keeps its deadline: its probe blocks until the server stops
(waiting on a socket or a lock with no timeout of its own). Each call is logged
(``stuck_probe_called``)."""

from __future__ import annotations

import threading

import structlog

import guardian

log = structlog.get_logger("tests.stuck_probe")


class StuckProbe:
    name = "stuck_probe"

    def __init__(self):
        self.released = threading.Event()

    @guardian.hookimpl
    def probe(self, engine, timeout_s):
        log.warning("stuck_probe_called", timeout_s=timeout_s)
        self.released.wait()
        return {"name": self.name, "ok": True, "duration_ms": 0.0, "error": None}

    @guardian.hookimpl
    def guardian_shutdown(self):
        self.released.set()

"""A crash whose process outlives its HTTP port for a while, as on a GPU.

A test plugin (``[guardian] plugins = ["tests.plugins.slow_death:SlowDeath"]``).
A CUDA process killed by a signal first closes its sockets and then, for
~0.15 s on the lent H200, tears down its GPU context before its parent can
reap it; a crash handler (Open MPI's prints a backtrace) adds to that. A
request the supervisor relays in that window finds the port refusing. This
machine's processes die in microseconds, so the window is made here: a
SIGSEGV closes the server's listening socket, waits ``teardown_s``, then
ends the process with the real signal. ``slow_death_port_closed`` is logged.
"""

from __future__ import annotations

import gc
import os
import signal
import socketserver
import threading
from dataclasses import dataclass

import structlog

import guardian

log = structlog.get_logger("tests.slow_death")


@dataclass
class SlowDeathSettings:
    teardown_s: float = 1.0


class SlowDeath:
    name = "slow_death"
    Settings = SlowDeathSettings

    def __init__(self, settings: SlowDeathSettings):
        self.settings = settings
        self.released = threading.Event()  # set at shutdown: the teardown ends early
        # Plugins are made on the main thread, where Python signal handlers live.
        signal.signal(signal.SIGSEGV, self._die_slowly)

    @guardian.hookimpl
    def guardian_shutdown(self):
        self.released.set()

    def _die_slowly(self, signum, frame) -> None:
        # The server was made before the process froze its start-up objects
        # (guardian.long_lived), and gc.get_objects() lists no frozen object.
        gc.unfreeze()
        for server in [o for o in gc.get_objects() if isinstance(o, socketserver.BaseServer)]:
            server.socket.close()
            # Its supervisor's hand-off socket too (guardian.handoff): a dying
            # process's descriptors close together.
            if getattr(server, "handoff_channel", None) is not None:
                server.handoff_channel.close()
        log.warning("slow_death_port_closed", teardown_s=self.settings.teardown_s)
        # The GPU's teardown: the process lives on with its port closed.
        self.released.wait(self.settings.teardown_s)
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)

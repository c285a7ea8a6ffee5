"""The HTTP thread lingers after an answer is sent, until the client's next request has come.

A test plugin (``[guardian] plugins = ["tests.plugins.slow_request_end:SlowRequestEnd"]``).
A busy machine can pause the thread that has just written an answer before it
runs what its request leaves behind (the request scope's end). A client that
sends its next request the moment it has the answer then reaches the server
inside that window. Here the window is held open, for the clients named: the
thread waits until that client's next request is being admitted, or at most
``linger_s`` (a next request refused before this hook is asked never comes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import guardian
from guardian.request_context import at_request_end


@dataclass
class SlowRequestEndSettings:
    linger_s: float = 0.5
    clients: list = field(default_factory=list)


class SlowRequestEnd:
    name = "slow_request_end"
    Settings = SlowRequestEndSettings

    def __init__(self, settings: SlowRequestEndSettings):
        self.settings = settings
        self._lock = threading.Lock()
        self._next_came: dict[str, threading.Event] = {}  # per client: its next request is here

    @guardian.hookimpl(tryfirst=True)
    def admit_request(self, admission):
        client = admission.client
        if client not in self.settings.clients:
            return None
        came = threading.Event()
        with self._lock:
            before, self._next_came[client] = self._next_came.get(client), came
        if before is not None:
            before.set()  # the thread of the request before may end now
        # Registered before the gate's own end-of-request work, so it runs first.
        at_request_end(lambda: came.wait(self.settings.linger_s))
        return None

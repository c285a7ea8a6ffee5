"""The HTTP thread lingers after an answer is sent, before its request ends.

A test plugin (``[guardian] plugins = ["tests.plugins.slow_request_end:SlowRequestEnd"]``).
A busy machine can pause the thread that has just written an answer before it
runs what its request leaves behind (the request scope's end). A client that
sends its next request the moment it has the answer then reaches the server
inside that window; here the window is made, for the clients named.
"""

from __future__ import annotations

import time
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

    @guardian.hookimpl(tryfirst=True)
    def admit_request(self, admission):
        if admission.client in self.settings.clients:
            # Registered before the gate's own end-of-request work, so it runs first.
            at_request_end(lambda: time.sleep(self.settings.linger_s))
        return None

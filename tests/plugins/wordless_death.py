"""A child that dies after its whole answer and before its word that it is done.

A test plugin (``[guardian] plugins = ["tests.plugins.wordless_death:WordlessDeath"]``),
for a supervised child that is handed its connections (guardian.handoff). The
child writes a request's whole answer on the client's connection, ends it, and
only then tells the supervisor it is done: a death in between (microseconds on
this machine) leaves an answered request without its word. Here the death is
planted there, for a request whose body holds ``marker``: the child kills
itself with SIGKILL instead of saying its word. ``wordless_death`` is logged.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import structlog

from guardian import handoff

log = structlog.get_logger("tests.wordless_death")


@dataclass
class WordlessDeathSettings:
    marker: str = "die before the word"


class WordlessDeath:
    name = "wordless_death"
    Settings = WordlessDeathSettings

    def __init__(self, settings: WordlessDeathSettings):
        finish = handoff.Received.finish
        marker = settings.marker.encode()

        def finish_or_die(received, word=handoff.DONE):
            if word == handoff.DONE and marker in received.request:
                log.warning("wordless_death", pid=os.getpid())
                os.kill(os.getpid(), signal.SIGKILL)
            return finish(received, word)

        handoff.Received.finish = finish_or_die

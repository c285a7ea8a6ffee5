"""A hand-off the child cannot open: mapping its journal fails, as mmap does out of memory.

A test plugin (``[guardian] plugins = ["tests.plugins.journal_faults:JournalFaults"]``),
for a supervised child that is handed its connections (guardian.handoff). Once the
file ``armed_by`` exists, the next journal the child maps fails with ENOMEM (what
``mmap`` says out of memory, or past the kernel's count of mappings): one failure
per arming, N for a file holding the number N. ``journal_map_failed`` is logged. The fault is
planted at the system call's door: the hand-off module's ``mmap``.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass

import structlog

from guardian import handoff
from tests.plugins.arming import disarm

log = structlog.get_logger("tests.journal_faults")


@dataclass
class JournalFaultsSettings:
    armed_by: str = ""


class FailingMmap:
    """The ``mmap`` module as guardian.handoff sees it, failing once per arming."""

    PAGESIZE = mmap.PAGESIZE

    def __init__(self, armed_by: str):
        self.armed_by = armed_by

    def mmap(self, fileno: int, length: int, *args, **kwargs):
        if not disarm(self.armed_by):
            return mmap.mmap(fileno, length, *args, **kwargs)
        log.warning("journal_map_failed", length=length)
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))


class JournalFaults:
    name = "journal_faults"
    Settings = JournalFaultsSettings

    def __init__(self, settings: JournalFaultsSettings):
        if settings.armed_by:
            handoff.mmap = FailingMmap(settings.armed_by)

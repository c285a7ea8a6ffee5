"""A probe plugin with a bug: its probe raises."""

from __future__ import annotations

import guardian


class RaisingProbe:
    name = "raising_probe"

    @guardian.hookimpl
    def probe(self, engine, timeout_s):
        raise RuntimeError("a probe plugin's bug")

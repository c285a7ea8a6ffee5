"""A bug in the server's start, after its engine's thread is running.

A test plugin (``[guardian] plugins = ["tests.plugins.serve_fault:ServeFault"]``):
made before the server starts, it plants a RuntimeError in the last step of
``guardian.serving.assembly.serve``'s start (``announce``), where nothing
contains it. Nothing else.
"""

from __future__ import annotations

import guardian.serving.assembly as assembly


class ServeFault:
    name = "serve_fault"

    def __init__(self, settings=None):
        def planted(door):
            raise RuntimeError("a bug in the server's start, planted by tests/plugins/serve_fault.py")

        assembly.announce = planted

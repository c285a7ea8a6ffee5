"""Each plugin's ``probe`` hook on a thread of its own, cut off at its deadline.

A probe is given ``timeout_s`` and must keep it; the built-in one does. A plugin's probe
that does not (blocked on a socket, a lock, a stuck engine it waits on without a
deadline) held the round's lock for as long as it ran: every later round, the
``/readyz?deep=1`` requests behind it and the proof of a replacement loop waited with it,
and readiness went stale. Now a probe that has not answered ``OVERRUN_S`` past its
deadline is a failed result, and the round goes on without it. Its thread cannot be
stopped, so it is left to finish; while it runs, that plugin's next probes fail at once
rather than start another: one thread a plugin at most.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Optional

import structlog

from guardian.plugin_manager import implementations

log = structlog.get_logger("guardian.watchdog")

# How long past its ``timeout_s`` a probe may take before it is cut off: the time a
# probe that keeps its deadline needs to build and return its result.
OVERRUN_S = 1.0


class PluginProbes:
    """The ``probe`` hook's implementations, each bounded by its deadline."""

    def __init__(self, hook):
        self.hook = hook
        self._left_running: dict[str, threading.Thread] = {}

    def run(self, engine, timeout_s: float) -> Iterator[tuple[str, object, Optional[Exception]]]:
        """(plugin name, result, exception) of each probe, as ``call_each`` gives them; a
        probe cut off, or one whose last probe still runs, gives a ``ProbeOverran``."""
        for plugin, call in implementations(self.hook):
            still = self._left_running.get(plugin)
            if still is not None and still.is_alive():
                yield plugin, None, ProbeOverran(f"its previous probe has not returned (timeout_s {timeout_s:g})")
                continue
            self._left_running.pop(plugin, None)
            yield (plugin, *self._bounded(plugin, lambda: call(engine=engine, timeout_s=timeout_s), timeout_s))

    def _bounded(self, plugin: str, probe: Callable[[], object], timeout_s: float):
        answer: dict = {}

        def run():
            try:
                answer["result"] = probe()
            except Exception as e:
                answer["error"] = e

        thread = threading.Thread(target=run, name=f"probe-{plugin}", daemon=True)
        thread.start()
        thread.join(timeout_s + OVERRUN_S)
        if thread.is_alive():
            self._left_running[plugin] = thread
            log.warning("probe_overran", plugin=plugin, timeout_s=timeout_s)
            return None, ProbeOverran(f"no result within {timeout_s + OVERRUN_S:g} s "
                                      f"(timeout_s {timeout_s:g}); left running")
        return answer.get("result"), answer.get("error")


class ProbeOverran(Exception):
    """A plugin's probe did not keep its deadline."""

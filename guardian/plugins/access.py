"""The built-in door: API keys, protected mode, origins and hosts, per-client limits.

The decisions live in ``guardian.access`` (no mlx), which the supervisor's
public port runs as well; this plugin puts them on the server's paths:
``check_access`` for every request, ``admit_request`` for the per-client
limits of a completion, ``on_request_finished`` to count its generated tokens.
A plugin of yours that implements ``check_access`` decides before this one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import guardian

# A request let in but refused by a later hook never finishes in the engine:
# its entry is dropped once this many newer ones exist.
MAX_TRACKED_REQUESTS = 10_000


class Access:
    name = "access"

    def __init__(self):
        # request id -> (the door's limits, client): whose tokens a finished request used.
        self._charging: OrderedDict[str, tuple] = OrderedDict()
        self._lock = threading.Lock()

    @guardian.hookimpl(trylast=True)
    def check_access(self, request, door):
        return door.check(request)

    # First: a client over its limits is refused before any hook reserves memory for it.
    @guardian.hookimpl(tryfirst=True)
    def admit_request(self, admission, door):
        limits = getattr(door, "limits", None)
        if limits is None:
            return None
        client = admission.client
        prompt_tokens = admission.n_prompt_tokens if door.settings.client_tokens_per_minute else 0
        error, receipt = limits.take(client, prompt_tokens)
        if error is not None:
            return error
        with self._lock:
            self._charging[admission.request_id] = (limits, client)
            while len(self._charging) > MAX_TRACKED_REQUESTS:
                self._charging.popitem(last=False)
        admission.on_finish(lambda: self._released(admission, limits, client, receipt))
        return None

    def _released(self, admission, limits, client: str, receipt) -> None:
        limits.release(client)
        if admission.refused:  # by a later hook or the engine: it never ran, nothing is used
            limits.refund(client, receipt)
            with self._lock:  # no on_request_finished comes for it
                self._charging.pop(admission.request_id, None)

    @guardian.hookimpl
    def on_request_finished(self, request_id, generated_tokens):
        with self._lock:
            charged = self._charging.pop(request_id, None)
        if charged is not None:
            limits, client = charged
            limits.charge(client, generated_tokens)

"""An engine failure planted at an exact token of one request.

A test plugin (``[guardian] plugins = ["tests.plugins.token_faults:TokenFaults"]``)
for the continuation tests: the seam must fall at a known token, whatever
the steps of prefill, probes and other requests around it.

- ``marker_top_logprobs``: only requests with exactly this ``top_logprobs``
  count (stock passes it with every token it formats, in
  ``_format_top_logprobs``, the loop's last call before it puts the token
  on the request's queue).
- ``fail_at_token``: stock's loop raises while it formats that request's
  Nth token (1-based), so the client has exactly N - 1 tokens when the
  engine fails. A continuation counts its tokens afresh, from 1, and so
  does each marked request admitted (one at a time: the count is shared).
- ``times``: how many faults in all (0: no limit).

The settings are live, and a save that changes them arms the faults afresh
(the counts start again), so a module's tests can share one server;
``fail_at_token = 0`` plants nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import mlx_lm.server as server
import structlog

import guardian

log = structlog.get_logger("tests.token_faults")


class PlantedFault(RuntimeError):
    pass


def live(default):
    """A setting a save changes while the server runs."""
    return field(default=default, metadata={"live": True})


@dataclass
class TokenFaultsSettings:
    marker_top_logprobs: int = live(0)
    fail_at_token: int = live(0)
    times: int = live(1)


class TokenFaults:
    name = "token_faults"
    Settings = TokenFaultsSettings

    def __init__(self, settings: TokenFaultsSettings):
        self.settings = settings
        self._lock = threading.Lock()
        self._state = {"tokens": 0, "faults": 0}
        self._plant()

    @guardian.hookimpl
    def guardian_startup(self):
        log.warning("token_faults_planted", **vars(self.settings))

    @guardian.hookimpl
    def on_config_reloaded(self, changed):
        """A save that changed these settings: armed afresh."""
        if any(key.startswith(f"{self.name}.") for key in changed):
            with self._lock:
                self._state.update(tokens=0, faults=0)
            log.warning("token_faults_armed", **vars(self.settings))

    @guardian.hookimpl
    def admit_request(self, admission):
        """A marked request arrives: its tokens count from 1."""
        if admission.args.top_logprobs == self.settings.marker_top_logprobs:
            with self._lock:
                self._state["tokens"] = 0
        return None

    def _plant(self) -> None:
        stock_format = server._format_top_logprobs
        settings = self.settings
        lock = self._lock
        state = self._state

        def format_top_logprobs(logprobs, top_n, tokenizer):
            if top_n == settings.marker_top_logprobs:
                with lock:
                    state["tokens"] += 1
                    fire = state["tokens"] == settings.fail_at_token and (
                        not settings.times or state["faults"] < settings.times)
                    if state["tokens"] == settings.fail_at_token:
                        state["tokens"] = 0  # the continuation counts afresh
                    state["faults"] += fire
                if fire:
                    log.warning("token_fault", token=settings.fail_at_token)
                    raise PlantedFault(f"planted engine failure at token {settings.fail_at_token}")
            return stock_format(logprobs, top_n, tokenizer)

        server._format_top_logprobs = format_top_logprobs

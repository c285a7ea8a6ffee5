"""The notifier plugin: four moments a person should hear about.

- ``exit``: the server is exiting with a failure code (the engine kept
  failing, or stalled beyond repair): ``guardian_shutdown``.
- ``restart_storm``: ``storm_restarts`` engine restarts within
  ``storm_window_s``: ``on_engine_restarted``. A single restart is the
  guardian doing its job and sends nothing.
- ``stall``: the watchdog saw no progress while work waited: ``on_stall``.
- ``memory_pressure``: memory crossed the ``[resources]`` refuse line, so new
  requests get 429: ``on_resource_sample``, once per crossing.

Each hook builds a ``Notice`` and hands it to the outbox, which never makes a
hook wait (see outbox.py). With no webhook and no ntfy URL the plugin does
nothing at all, so installing it changes nothing until it is configured.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import structlog

import guardian
from guardian.config.registry import shown
from guardian.exit_codes import reason as exit_reason
from guardian_notifier.notice import DEFAULT, HIGH, URGENT, Notice
from guardian_notifier.outbox import Outbox, destinations

log = structlog.get_logger("guardian_notifier")

EVENTS = ("exit", "restart_storm", "stall", "memory_pressure")


def live(**metadata) -> dict:
    """Field metadata: read at each use, so a saved config file applies at once."""
    return {"live": True, **metadata}


@dataclass
class NotifierSettings:
    """The ``[notifier]`` table of the guardian's TOML file."""

    # Where notices go: JSON POSTed to each webhook, and/or a plain POST to an ntfy
    # topic URL (https://ntfy.sh/your-topic, or your own server's).
    webhook_urls: list = field(default_factory=list, metadata=live())
    ntfy_url: str = field(default="", metadata=live())
    # An ntfy access token (tk_...), sent as a bearer token; never logged.
    ntfy_token: str = field(default="", metadata=live())
    # Which of EVENTS to send.
    events: list = field(default_factory=lambda: list(EVENTS), metadata=live())
    # Each phase of an attempt (connect, send, each read) waits at most this long.
    timeout_s: float = field(default=5.0, metadata=live(min=0.01))
    # Attempts after the first for a receiver that is down, times out, or answers 408, 429 or 5xx.
    retries: int = field(default=3, metadata=live(min=0))
    # The wait before the first retry; each further retry doubles it, up to backoff_max_s.
    backoff_s: float = field(default=1.0, metadata=live(min=0))
    backoff_max_s: float = field(default=30.0, metadata=live(min=0))
    # One notice of a kind per window; the next one says how many were held back.
    dedup_window_s: float = field(default=300.0, metadata=live(min=0))
    # A restart storm: this many engine restarts within storm_window_s.
    storm_restarts: int = field(default=3, metadata=live(min=1))
    storm_window_s: float = field(default=60.0, metadata=live(min=0))
    # Notices waiting for the sender; past this, new ones are dropped (and counted).
    # Bound at start.
    queue_size: int = field(default=64, metadata={"min": 1})
    # At exit, how long queued notices (the exit notice among them) may take to go out.
    exit_flush_s: float = field(default=10.0, metadata=live(min=0))

    def __post_init__(self) -> None:
        """What the types alone do not say. The guardian makes the settings at start and at
        each reload: a version this refuses changes nothing."""
        check(self)


class Notifier:
    name = "notifier"
    Settings = NotifierSettings

    def __init__(self, settings: NotifierSettings):
        check(settings)
        self.settings = settings
        self.outbox = Outbox(settings, settings.queue_size)
        self._restarts: deque[float] = deque()  # monotonic times of recent restarts
        self._lock = threading.Lock()
        self._memory_pressure = False

    # -- hooks --------------------------------------------------------------------
    @guardian.hookimpl
    def guardian_startup(self):
        found = destinations(self.settings)
        if found:
            log.info("notifier_ready", destinations=[d.redacted() for d in found],
                     events=list(self.settings.events))

    @guardian.hookimpl
    def on_engine_restarted(self, classification, restarts):
        """Generation thread: count restarts in the window; a storm is a notice."""
        s = self.settings
        now = time.monotonic()
        with self._lock:
            self._restarts.append(now)
            while self._restarts and now - self._restarts[0] > s.storm_window_s:
                self._restarts.popleft()
            in_window = len(self._restarts)
        if in_window >= s.storm_restarts:
            self.send(Notice(
                kind="restart_storm",
                title="engine restart storm",
                message=(f"{in_window} engine restarts within {s.storm_window_s:g} s "
                         f"(the last after {classification or 'a stall'}; {restarts} since start)."),
                priority=HIGH, tags=("warning", "repeat"),
                details={"restarts_in_window": in_window, "window_s": s.storm_window_s,
                         "restarts": restarts, "classification": classification},
            ))

    @guardian.hookimpl
    def on_stall(self, heartbeat_age_s, action):
        """Watchdog thread, before the action is taken."""
        self.send(Notice(
            kind="stall",
            title="engine stalled",
            message=(f"The engine made no progress for {heartbeat_age_s:.1f} s while work was waiting; "
                     f"the guardian's action: {action}."),
            priority=URGENT if action == "exit" else HIGH, tags=("hourglass",),
            details={"heartbeat_age_s": round(heartbeat_age_s, 2), "action": action},
        ))

    @guardian.hookimpl(trylast=True)
    def on_resource_sample(self, sample):
        """Watchdog thread. Last, so the resources plugin has set ``admission_paused``."""
        paused = bool(sample.get("admission_paused"))
        with self._lock:
            crossed = paused and not self._memory_pressure
            self._memory_pressure = paused
        if not crossed:
            return
        used, limit = sample.get("memory_used_bytes"), sample.get("refuse_above_bytes")
        self.send(Notice(
            kind="memory_pressure",
            title="memory pressure",
            message=(f"Memory in use ({mib(used)}) is over the server's limit ({mib(limit)}): "
                     "new requests get 429 until it falls."),
            priority=DEFAULT, tags=("warning", "chart_with_upwards_trend"),
            details={k: sample.get(k) for k in ("memory_used_bytes", "refuse_above_bytes",
                                                 "device_memory_bytes", "requests_in_flight")},
        ))

    @guardian.hookimpl
    def guardian_shutdown(self, exit_code):
        """Main thread, last thing before exit: a failure exit is a notice; then flush."""
        if exit_code:
            self.send(Notice(
                kind="exit",
                title=f"exiting with code {exit_code}",
                message=(f"The server is exiting with code {exit_code}: {exit_reason(exit_code)}. "
                         "A service manager (systemd, launchd) should start it again."),
                priority=URGENT, tags=("rotating_light",),
                details={"exit_code": exit_code, "reason": exit_reason(exit_code)},
            ))
        self.outbox.close(self.settings.exit_flush_s)

    # -- helpers ------------------------------------------------------------------
    def send(self, notice: Notice) -> None:
        """Offer ``notice`` to the outbox, if its kind is wanted and it has somewhere to go."""
        if notice.kind in self.settings.events and destinations(self.settings):
            self.outbox.offer(notice)


def check(settings: NotifierSettings) -> None:
    """What the types alone do not say: URLs that are http(s), events we know."""
    for url in [*settings.webhook_urls, *([settings.ntfy_url] if settings.ntfy_url else [])]:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            # Not echoed: a URL may hold a secret, and this message is logged.
            raise guardian.ConfigError(
                "[notifier]: every webhook_urls entry and ntfy_url must start with http:// or https://")
    unknown = [event for event in settings.events if event not in EVENTS]
    if unknown:
        # An event's name is shown; anything else (a URL in the wrong key) only by its size.
        named = [e if isinstance(e, str) and re.fullmatch(r"[a-z_]{1,32}", e) else shown(e) for e in unknown]
        raise guardian.ConfigError(f"[notifier] events: unknown {named}; known: {list(EVENTS)}")


def mib(n) -> str:
    return "?" if n is None else f"{n / 2**20:.0f} MiB"

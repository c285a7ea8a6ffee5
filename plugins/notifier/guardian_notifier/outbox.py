"""Delivery off the hook threads: a dedup window, a bounded queue, one sender thread.

A hook must never wait on the network: ``on_engine_restarted`` runs on the
generation thread, ``on_stall`` and ``on_resource_sample`` on the watchdog's.
A hook only offers a notice here. The dedup window decides at once whether it
goes out (one notice of a kind per window, so a restart storm is one message,
not hundreds); one that does is put on a bounded queue without waiting, or
dropped with a counted log line when the queue is full. One daemon thread sends
what is queued, a notice at a time, to every destination: each attempt bounded
by ``timeout_s``, failures retried with exponential backoff.

Secrets stay out of the logs: a destination is logged as its scheme, host and
port only (a webhook's path is often its secret, an ntfy topic is readable by
whoever knows its name), the ntfy token never, and httpx's own request lines
from the sender thread (which carry the full URL) are filtered out.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import httpx
import structlog

from guardian_notifier.notice import Notice

log = structlog.get_logger("guardian_notifier")

SENDER_THREAD = "guardian-notifier"
# Put on the queue by close(): the sender stops when it reaches it.
STOP = object()


@dataclass(frozen=True)
class Destination:
    channel: str  # "webhook" or "ntfy"
    url: str

    def redacted(self) -> str:
        """What logs show of the URL: scheme, host and port, never the path or query."""
        try:
            url = httpx.URL(self.url)
        except (httpx.InvalidURL, TypeError, ValueError):  # say so without echoing it
            return "<invalid url>"
        port = f":{url.port}" if url.port else ""
        return f"{url.scheme}://{url.host}{port}"


def destinations(settings) -> list[Destination]:
    """Where notices go now: read at each delivery, so a saved config applies live."""
    found = [Destination("webhook", url) for url in settings.webhook_urls]
    if settings.ntfy_url:
        found.append(Destination("ntfy", settings.ntfy_url))
    return found


class Dedup:
    """At most one notice of a kind per window; counts the ones held back."""

    def __init__(self):
        self._lock = threading.Lock()  # hooks run on several threads
        self._last_sent: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def admit(self, notice: Notice, window_s: float, now: float) -> Notice | None:
        """The notice to send (carrying how many were held back since the last), or None."""
        with self._lock:
            last = self._last_sent.get(notice.kind)
            if last is not None and now - last < window_s:
                self._held[notice.kind] = self._held.get(notice.kind, 0) + 1
                return None
            self._last_sent[notice.kind] = now
            held = self._held.pop(notice.kind, 0)
        return notice.with_suppressed(held)

    def held(self) -> int:
        with self._lock:
            return sum(self._held.values())


@dataclass(frozen=True)
class Attempt:
    sent: bool
    retry: bool  # whether another attempt could go better
    outcome: str  # "HTTP 503", "ReadTimeout": never the URL, never a header


class NotOnSenderThread(logging.Filter):
    """Drops httpx's "HTTP Request: POST <full url>" lines for our own requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != SENDER_THREAD


_httpx_filter = NotOnSenderThread()


class Outbox:
    def __init__(self, settings, queue_size: int):
        self.settings = settings  # live: read at each use
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.dedup = Dedup()
        self.dropped = 0
        self.closed = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Set at exit once the flush time is over: ends a backoff wait at once.
        self._stopping = threading.Event()
        logging.getLogger("httpx").addFilter(_httpx_filter)  # the same filter once, however many outboxes

    # -- the hook side: never waits ------------------------------------------------------
    def offer(self, notice: Notice) -> None:
        """Queue ``notice`` unless the dedup window holds it back; returns at once."""
        if self.closed:
            return
        admitted = self.dedup.admit(notice, self.settings.dedup_window_s, time.monotonic())
        if admitted is None:
            log.debug("notification_suppressed", kind=notice.kind, held_back=self.dedup.held())
            return
        self._start_sender()
        try:
            self.queue.put_nowait(admitted)
        except queue.Full:
            with self._lock:
                self.dropped += 1
                dropped = self.dropped
            log.warning("notification_dropped", kind=notice.kind, dropped_total=dropped,
                        queue_size=self.queue.maxsize,
                        why="the sender is behind: its receivers are slow or down")

    def _start_sender(self) -> None:
        """The thread starts with the first notice: an idle plugin costs no thread."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=SENDER_THREAD, daemon=True)
                self._thread.start()

    def close(self, flush_s: float) -> None:
        """At exit: wait up to ``flush_s`` for the queued notices to go out, then stop.

        The sender is a daemon thread, so a receiver that never answers
        cannot keep the process from exiting.
        """
        with self._lock:
            self.closed = True
            thread = self._thread
        if thread is None:
            return
        deadline = time.monotonic() + flush_s
        try:
            self.queue.put(STOP, timeout=flush_s)
        except queue.Full:
            pass
        thread.join(max(0.0, deadline - time.monotonic()))
        self._stopping.set()
        if thread.is_alive():
            log.warning("notifications_unsent", queued=self.queue.qsize(), flush_s=flush_s,
                        why="the receivers did not answer within the flush time")

    # -- the sender thread -------------------------------------------------------------
    def _run(self) -> None:
        with httpx.Client() as client:
            while True:
                notice = self.queue.get()
                if notice is STOP:
                    return
                for destination in destinations(self.settings):
                    try:
                        self._deliver(client, destination, notice)
                    except Exception:  # a bug here must not end the thread: later notices still go
                        log.exception("notification_failed", kind=notice.kind, channel=destination.channel,
                                      destination=destination.redacted())

    def _deliver(self, client: httpx.Client, destination: Destination, notice: Notice) -> None:
        """Send until one attempt succeeds, one fails for good, or the retries are spent."""
        s = self.settings
        attempt_number = 0
        while True:
            attempt_number += 1
            started = time.monotonic()
            attempt = self._attempt(client, destination, notice)
            fields = {"kind": notice.kind, "channel": destination.channel,
                      "destination": destination.redacted(), "attempts": attempt_number,
                      "outcome": attempt.outcome, "duration_ms": round((time.monotonic() - started) * 1000, 1)}
            if attempt.sent:
                log.info("notification_sent", **fields)
                return
            if not attempt.retry or attempt_number > s.retries:
                log.warning("notification_failed", **fields)
                return
            delay = min(s.backoff_s * 2 ** (attempt_number - 1), s.backoff_max_s)
            log.info("notification_retrying", retry_in_s=delay, **fields)
            if self._stopping.wait(delay):
                log.warning("notification_failed", **fields)
                return

    def _attempt(self, client: httpx.Client, destination: Destination, notice: Notice) -> Attempt:
        s = self.settings
        if destination.channel == "ntfy":
            request = {"content": notice.text().encode(), "headers": notice.ntfy_headers(s.ntfy_token)}
        else:
            request = {"json": notice.webhook_json()}
        try:
            # timeout_s bounds each phase: connecting, sending, and each wait for bytes.
            response = client.post(destination.url, timeout=s.timeout_s, **request)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            # The exception's name only: some messages quote the URL.
            return Attempt(sent=False, retry=not isinstance(e, (httpx.UnsupportedProtocol, httpx.InvalidURL)),
                           outcome=type(e).__name__)
        status = response.status_code
        if response.is_success:
            return Attempt(sent=True, retry=False, outcome=f"HTTP {status}")
        # 408, 429 and 5xx: the receiver is busy or restarting. Any other 4xx says the
        # request is wrong (a bad URL or token): it would fail the same way again.
        return Attempt(sent=False, retry=status in (408, 429) or status >= 500, outcome=f"HTTP {status}")

"""The public port's common case, handed to the child by the reader thread itself.

A request the supervisor neither answers nor holds back (a child is ready,
the door lets it in, no crash suspect is about) needs no handler thread: the
connection layer's reader has it whole, and ``guardian.handoff`` passes it to
the child with the client's connection. Here the reader does that, and waits
for the child's word on the same selector as every connection. A request
costs the supervisor a parse of its head, the door's check and the hand-off
(~0.3 ms of CPU on this machine, against ~1.2 ms through a handler thread
and http.server), and nothing per token.

Everything else takes the handler path (``guardian.supervise.proxy``), which
this falls back to before anything reaches the child: the supervisor's own
paths, a refusal at the door, a request to hold (no child ready), a crash
suspect about (its request runs alone), anything unusual in the head. After
the hand-off, a child that dies or gives the request back resumes the handler
path with what the journal says, on a handler thread of its own.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import structlog

from guardian import handoff, relay_protocol
from guardian.access.keys import API_KEY_HEADER, AUTHORIZATION
from guardian.access.policy import CLIENT_HEADER, KEY_NAME_HEADER, AccessDecision, AccessRequest
from guardian.serving import framing
from guardian.serving.deadlines import COMPLETION_PATHS, Deadline, deadlines_of
from guardian.serving.sockets import close_quietly
from guardian.observability.logs import loggable_line

log = structlog.get_logger("guardian.supervisor")

_REQUEST_LINE = re.compile(rb"([A-Z]{1,16}) (/[\x21-\x7e]*) HTTP/1\.([01])")
# Heads the handler path reads better: a body not sent whole (the door refuses it first).
# A client's ``Expect: 100-continue`` was met by the door, and is not forwarded.
_NOT_FAST = frozenset({"transfer-encoding"})
# A header that must not come twice on the fast path (http.server would take the first).
_ONCE = frozenset({"host", "content-length", AUTHORIZATION.lower(), API_KEY_HEADER.lower(), "origin"})


class Headers:
    """A request's headers as the door reads them (``get``, ``get_all``), case-insensitive,
    in the order sent."""

    __slots__ = ("items", "_first")

    def __init__(self, items: list[tuple[str, str]]):
        self.items = items
        self._first: dict[str, str] = {}
        for name, value in items:
            self._first.setdefault(name.lower(), value)

    def get(self, name: str, default=None):
        return self._first.get(name.lower(), default)

    def get_all(self, name: str, default=None):
        lowered = name.lower()
        found = [value for n, value in self.items if n.lower() == lowered]
        return found or default


class RequestHead:
    """A request's line and headers, parsed where they are plain; None from ``parse`` otherwise."""

    __slots__ = ("method", "target", "path", "headers", "body")

    def __init__(self, method: str, target: str, headers: Headers, body: bytes):
        self.method = method
        self.target = target
        self.path = framing.request_path(target)
        self.headers = headers
        self.body = body

    @classmethod
    def parse(cls, buffer: bytes, headers_end: int) -> Optional["RequestHead"]:
        lines = buffer[:headers_end - 4].split(b"\r\n")
        line = _REQUEST_LINE.fullmatch(lines[0])
        if line is None:
            return None
        items = []
        seen_once = set()
        for raw in lines[1:]:
            name, colon, value = raw.partition(b":")
            if not colon or framing.TOKEN.fullmatch(name) is None:
                return None  # obs-fold, a space before the colon, no colon: the handler answers
            text = name.decode("latin-1")
            lowered = text.lower()
            if lowered in _NOT_FAST or (lowered in _ONCE and lowered in seen_once):
                return None
            if lowered in _ONCE:
                seen_once.add(lowered)
            items.append((text, value.decode("latin-1").lstrip(" \t")))
        headers = Headers(items)
        body = buffer[headers_end:]
        length = headers.get("Content-Length", "0").strip()
        if not length.isdigit() or int(length) != len(body):
            return None  # a pipelined request after it, or a length the handler must refuse
        return cls(line.group(1).decode(), line.group(2).decode("latin-1"), headers, body)


@dataclass(slots=True)
class FastHandOff:
    """One request the reader handed to the child; what ends it. ``buffer``,
    ``address`` and ``access``: what a handler needs to take the request back."""

    server: object
    child: object
    handed: Optional[handoff.HandedOff]
    buffer: bytes
    address: tuple
    access: AccessDecision
    relay: object  # the crash quarantine's record (guardian.quarantine.crashes.Relay)
    client: socket.socket
    word: bytes = b""  # the child's, once it has spoken
    # When the child had it: a request resumed on the handler path keeps its deadlines from here.
    handed_at: float = field(default_factory=time.monotonic)
    # Its first deadline, as a moment (time.monotonic()), with what set it; None: none.
    due: Optional[tuple[float, Deadline]] = None

    def on_word(self) -> None:
        """The child's word (the reader's thread): done, or the handler path takes over."""
        word = self.word = self.handed.wait()
        supervisor = self.server.supervisor
        # The counts go whatever fails on the way (the reader logs it and goes on): one left
        # behind would keep the child from its idle stop and a stopping supervisor waiting.
        try:
            self.server.handoff_over(self)
            opened = word != handoff.NOT_OPENED  # else the child never had the request
            supervisor.quarantine.end_fast_relay(self.child.generation, self.relay,
                                                 answered=word == handoff.DONE, sent=opened)
            if opened:
                supervisor.metrics.passed_handed_off.inc()
        finally:
            self.server.handoffs_in_flight.__exit__(None, None, None)
        if word == handoff.DONE:
            try:
                self.handed.close()
                close_quietly(self.client)
            finally:
                supervisor.in_flight.__exit__(None, None, None)
            return
        # Given back, or the child died with the connection: on a handler thread, which
        # ends the request's time in flight (a stopping supervisor waits for its answer).
        try:
            self.server.resume(self)
        except BaseException:
            self.resumed()
            close_quietly(self.client)
            raise

    def resumed(self) -> None:
        """The handler path is done with it (once, whatever became of it)."""
        if self.handed is None:
            return
        self.handed.close()
        self.handed = None
        self.server.supervisor.in_flight.__exit__(None, None, None)


def first_deadline(head: RequestHead, request_timeout_s: float, since: float) -> Optional[tuple[float, Deadline]]:
    """A handed-off completion's first deadline, as a moment. The child keeps its deadlines;
    this one only tells when a child that answers no check (frozen) holds it too long
    (``PublicServer.overdue_handoff``). Whether the request streams is not read here (its
    body is not parsed for it): the client's read timeout is taken as a stream's, which
    ends once the answer's head went out, as it does for a request that does not stream."""
    if head.method != "POST" or head.path not in COMPLETION_PATHS:
        return None
    deadlines = deadlines_of(head.headers, request_timeout_s, stream=True, continued=False)
    if not deadlines:
        return None
    first = min(deadlines, key=lambda deadline: deadline.seconds)
    return since + first.seconds, first


def try_fast_hand_off(server, incoming) -> bool:
    """Hand ``incoming`` (a whole request, on the reader's thread) to the child now;
    False: take the handler path (nothing was sent anywhere)."""
    supervisor = server.supervisor
    if server.tls is not None or incoming.headers_end < 0 or incoming.body_unread or server.busy():
        return False
    buffer = bytes(incoming.buffer)
    head = RequestHead.parse(buffer, incoming.headers_end)
    if head is None or head.path in server.own_paths:
        return False
    access = incoming.access or supervisor.door.check(  # made on the head where the body came later
        AccessRequest(head.method, head.path, head.headers, incoming.address[0]))
    if not access.allowed:
        return False
    # In flight before it asks for the child, as on the handler path: an idle stop decided
    # meanwhile sees it and keeps the child (Supervisor.stop_idle_child), or it sees the stop.
    # (Not a path the supervisor answers itself: a load balancer's checks wake no child.)
    supervisor.in_flight.__enter__()
    handed_off = False
    try:
        handed_off = _hand_off_counted(server, supervisor, incoming, buffer, head, access)
    finally:
        if not handed_off:
            supervisor.in_flight.__exit__(None, None, None)
    return handed_off


def _hand_off_counted(server, supervisor, incoming, buffer: bytes, head: RequestHead, access) -> bool:
    """``try_fast_hand_off`` once the request counts as in flight: False leaves the count to
    the caller to take back; True, to whoever ends the request (``FastHandOff``)."""
    child = supervisor.serving_child()
    if child is None or not child.hands_off() or child.kill_reason is not None:
        return False
    request = child_request(supervisor, child, head.method, head.target, head.headers.items,
                            incoming.address[0], access, head.body)
    if request is None:
        return False
    relay = supervisor.quarantine.start_fast_relay(child.generation, head.method, head.path, head.target, head.body)
    if relay is None:  # a crash suspect is about: the handler path isolates it
        return False
    try:
        handed = child.handoff.hand(incoming.sock, request)
    except OSError:
        handed = None
    if handed is None:  # the child's channel is closed (it is dying), or nothing to count
        supervisor.quarantine.end_fast_relay(child.generation, relay, answered=False, sent=False)
        return False
    # The child has the request: from here on it answers, whatever happens here.
    server.handoffs_in_flight.__enter__()
    passed = FastHandOff(server, child, handed, buffer, incoming.address, access, relay, incoming.sock)
    passed.due = first_deadline(head, supervisor.core.request_timeout_s, passed.handed_at)
    server.handoff_begun(passed)
    try:
        relay.stream = handed.progress()  # where it stands, should the child be reaped first
        server.when_readable(handed.control, passed.on_word)
    except (OSError, ValueError, KeyError) as e:  # out of descriptors: the child answers untracked
        log.error("handoff_untracked", path=loggable_line(head.path), error_type=type(e).__name__, error_message=str(e))
        supervisor.quarantine.end_fast_relay(child.generation, relay, answered=False, sent=False)
        server.handoff_over(passed)
        server.handoffs_in_flight.__exit__(None, None, None)
        supervisor.in_flight.__exit__(None, None, None)
        handed.close()
        close_quietly(incoming.sock)
    return True


# Shared with the handler path (guardian.supervise.proxy).
CHILD_HOST = "127.0.0.1"
# The API key stops at the public port (the child serves only the supervisor),
# and a client cannot name itself to the child; httpx or the hand-off write
# Host and Content-Length themselves.
NOT_FORWARDED_UPSTREAM = (relay_protocol.HOP_BY_HOP | {"host", "content-length", "expect"}
                          | relay_protocol.PRIVATE_HEADERS
                          | {AUTHORIZATION.lower(), API_KEY_HEADER.lower(), CLIENT_HEADER.lower(),
                             KEY_NAME_HEADER.lower()})



def forwarded_headers(items, client_ip: str, access: Optional[AccessDecision]) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop and private ones, plus who the client is."""
    headers = [(k, v) for k, v in items if k.lower() not in NOT_FORWARDED_UPSTREAM]
    headers.append(("X-Forwarded-For", client_ip))
    if access is not None:  # who the door let in: the child's per-client limits and fairness
        headers.append((CLIENT_HEADER, access.client))
        if access.key_name:
            headers.append((KEY_NAME_HEADER, access.key_name))
    return headers


def child_request(supervisor, child, method: str, target: str, header_items, client_ip: str,
                  access: Optional[AccessDecision], body: bytes, age_s: float = 0.0) -> Optional[bytes]:
    """The request as a child reads it from a hand-off: the client's headers as forwarded,
    the child's Host, the supervisor's key, how long ago it reached the public port (``age_s``).
    None if a header cannot be written (a key's name beyond latin-1): then it is relayed,
    as http.client refuses it."""
    headers = [("Host", f"{CHILD_HOST}:{child.port}"), *forwarded_headers(header_items, client_ip, access),
               (relay_protocol.KEY_HEADER, supervisor.relay_key)]
    headers += relay_protocol.age_headers(age_s)
    try:
        return handoff.request_bytes(method, target, headers, body)
    except UnicodeEncodeError:
        return None

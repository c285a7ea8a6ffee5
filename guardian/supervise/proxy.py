"""The supervisor's public port: every request relayed to the child.

Imports neither mlx nor mlx_lm: the supervisor stays small. Requests go to
the child on a connection each (``guardian.supervise.upstream``). Responses pass
through as they arrive (SSE events one by one), with the child's status and
headers. When the child dies under a request, the request is sent again to
the next child; a stream the client had begun to receive is continued there
after the tokens it already has (``guardian.relay_protocol``). Past
``max_resends`` (or while no child comes) the client gets a 503 if nothing
was sent yet, or an error event and ``[DONE]`` if a stream had started. The crash quarantine (``guardian.quarantine.crashes``)
sees every POST: it refuses the ones it quarantined and holds its
suspects back until they can run alone. No read from the child needs a timeout: the supervisor
forgets a child only once it is reaped, and the kernel has then closed the
child's end of every connection, so every read from it ends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Optional
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote

import httpx
import structlog

from guardian import handoff, relay_protocol
from guardian.access.limits import CONCURRENCY_RETRY_AFTER_S, rate_limited
from guardian.access.policy import AccessDecision, AccessRequest
from guardian.access.tls import ServerCertificate
from guardian.serving.connection import BufferedConnection, HeldConnections, raw_socket
from guardian.serving.sockets import client_left_now, close_quietly
from guardian.serving.deadlines import COMPLETION_PATHS, Deadline, deadlines_of, takes_body
from guardian.serving.framing import asks_for_probes, request_path
from guardian.request_context import REQUEST_ID_HEADER, made_request_id, sane_request_id
from guardian.supervise import metrics as supervise_metrics
from guardian.supervise.child import CHILD_GONE_ERRORS
from guardian.supervise.client_writes import StreamKeepAlive, client_writer
from guardian.supervise.fast_handoff import (FastHandOff, child_request, forwarded_headers,
                                             try_fast_hand_off)
from guardian.supervise.state import OVER_CLIENT_SHARE, State
from guardian.supervise.upstream import ChildUnreachable, Upstream, child_deadline_error
from guardian.quarantine import isolation
from guardian.quarantine.crashes import fingerprint
from guardian.errors import CLIENT_GONE, GuardianError, body_too_large, method_not_allowed
from guardian.observability.counting import ActiveCount
from guardian.observability.logs import loggable_line, without_query_values

LOGGER_NAME = "guardian.supervisor"
log = structlog.get_logger(LOGGER_NAME)

BODY_METHODS = relay_protocol.BODY_METHODS
HOP_BY_HOP = relay_protocol.HOP_BY_HOP
# What the supervisor writes itself on the answers it writes (send_cors_headers).
CORS_HEADERS = frozenset({"access-control-allow-origin", "access-control-allow-methods",
                          "access-control-allow-headers", "access-control-expose-headers", "vary"})
# A child's word that it tagged a stream's tokens; not for the client.
CONTINUABLE = relay_protocol.CONTINUABLE_HEADER.lower()
# What relaying a request to one child came to (besides a stream cut, to continue).
ANSWERED = "answered"
NOTHING_SENT = "nothing sent"
CHILD_GONE = "the child died before the request was sent"
REFUSED_BY_STOPPING_CHILD = "refused by a child being replaced"
# The connection cannot be handed off (guardian.handoff): relay the request.
RELAY_INSTEAD = "relay instead"
# The child could not open a hand-off (its journal): the next attempt, at once.
NOT_OPENED_BY_CHILD = "not opened by the child"
# A suspect's turn comes when the request before it ended, perhaps by
# crashing the child: its socket closes a moment before the process can be
# waited for. The suspect looks this long for the child's exit first.
SUSPECT_SEND_GRACE_S = 0.05
# Answered by the supervisor whoever the child is.
LIVENESS_PATH = "/livez"
STATUS_PATH = "/guardian/supervisor"
METRICS_PATH = "/metrics"
READINESS_PATH = "/readyz"
HEALTH_PATHS = ("/health", READINESS_PATH)
# What a target passed on to the child keeps as it is: printable ASCII ("%" too: the
# client's own escapes stay as the child would read them).
TARGET_AS_IS = "".join(map(chr, range(0x21, 0x7F)))
# /readyz?deep=1 runs the child's probes now, each within [watchdog] probe_timeout_s:
# the supervisor waits that long and this much more (Supervisor.deep_readiness_timeout_s).
DEEP_READINESS_MARGIN_S = 5.0
SSE_CONTENT_TYPE = relay_protocol.SSE_CONTENT_TYPE


@dataclass
class HandlerHandOff:
    """A hand-off a handler thread made, tracked as the reader's are (``FastHandOff``) for
    ``PublicServer.overdue_handoff``: its child, its first deadline, its relay on record."""
    child: object
    due: Optional[tuple[float, Deadline]]
    relay: object


class PublicServer(HeldConnections, ThreadingHTTPServer):
    """The public host:port, behind the same connection layer as the engine's
    server (guardian.serving.connection): requests read under deadlines, handler threads
    bounded. With a certificate it serves HTTPS (the child behind it stays plain
    HTTP on loopback)."""

    # A failed supervisor must exit without waiting for slow clients.
    daemon_threads = True

    # Paths the supervisor answers itself, whoever the child is.
    own_paths = frozenset({LIVENESS_PATH, STATUS_PATH, METRICS_PATH, *HEALTH_PATHS})

    def __init__(self, address, supervisor, tls: Optional[ServerCertificate] = None, limits=None):
        self.supervisor = supervisor
        self.tls = tls
        if limits is not None:
            self.limits = limits
        # Requests the reader handed to the child, not yet done (guardian.supervise.fast_handoff).
        self.handoffs_in_flight = ActiveCount()
        # Those of them with a deadline: the child's to keep, unless it is frozen (``overdue_handoff``).
        self._handoffs_due: dict[int, FastHandOff] = {}
        self._handoffs_due_lock = threading.Lock()
        super().__init__(address, ProxyHandler)

    def handoff_begun(self, passed: FastHandOff) -> None:
        if passed.due is not None:
            with self._handoffs_due_lock:
                self._handoffs_due[id(passed)] = passed

    def handoff_over(self, passed: FastHandOff) -> None:
        """The child's word came (or the hand-off was never tracked): no longer the child's to keep."""
        if passed.due is not None:
            with self._handoffs_due_lock:
                self._handoffs_due.pop(id(passed), None)

    def overdue_handoff(self, child, now: float) -> Optional[tuple[float, Deadline]]:
        """The most overdue of the requests handed to ``child``: how far past its deadline
        it is (more than ``[supervisor] deadline_backstop_s``), and that deadline; None: none is. A child keeps
        the deadlines of the requests handed to it (a 504, a stream's error event); one
        that is frozen keeps none, and the supervisor, which cannot answer on a connection
        the child holds, replaces it (``Supervisor.check_health``): on SIGCONT and SIGTERM
        the child answers each overdue request at once."""
        with self._handoffs_due_lock:
            handed = [passed for passed in self._handoffs_due.values() if passed.child is child]
        backstop_s = self.supervisor.settings.deadline_backstop_s
        late = []
        for passed in handed:
            at, deadline = passed.due
            if now - at <= backstop_s:
                continue
            # Its journal (set as it was handed off), read only now.
            progress = passed.relay.stream if passed.relay is not None else None
            if deadline.until_head and progress is not None and progress.head_sent:
                continue  # a stream under way: its client's read timeout is over
            late.append((now - at, deadline))
        return max(late, key=lambda item: item[0], default=None)

    def decide_at_head(self, incoming):
        """The door on the head of a request whose body is still to come: a refused
        client's body is never held (a handler answers it, with this decision)."""
        return self.supervisor.door.check(self.head_request(incoming))

    def body_limit(self) -> Optional[int]:
        """A guardian child's ``max_body_bytes``: a longer body is answered 413 here from
        its head, as the child answers it, never waited for."""
        return self.supervisor.child_body_limit

    def busy(self) -> bool:
        """Requests the reader handed off count against ``max_handlers`` as handler threads do:
        the child answers each on a thread of its own."""
        return self.handlers.active + self.handoffs_in_flight.active >= self.limits.max_handlers

    def connection_status(self) -> dict:
        return {**super().connection_status(), "handed_off": self.handoffs_in_flight.active}

    def dispatch(self, incoming) -> None:
        """A whole request: to the child straight from the reader where it can go
        (guardian.supervise.fast_handoff), else to a handler thread. A preflight never
        goes to the child: a handler answers it (``ProxyHandler.answer_preflight``)."""
        if is_preflight(incoming):
            return super().dispatch(incoming)
        try:
            handed_off = try_fast_hand_off(self, incoming)
        except Exception:  # noqa: BLE001 - raised before the hand-off (it handles what may fail after): the handler path answers, the reader lives on
            log.exception("fast_handoff_failed")
            handed_off = False
        if not handed_off:
            super().dispatch(incoming)

    def resume(self, passed: FastHandOff) -> None:
        """A request the reader handed off that the child gave back or died with:
        the handler path takes it from there (``ProxyHandler.resumed_outcome``)."""
        sock = passed.client
        try:
            sock.setblocking(True)
            sock.settimeout(self.limits.send_timeout_s or None)
        except OSError:
            pass
        if not self.start_handler(ResumedConnection(sock, passed.buffer, passed), passed.address):
            passed.resumed()
            close_quietly(sock)

    def _handle(self, request, client_address) -> None:
        # A resumed request stays in flight until its handler is done, however it ends.
        try:
            super()._handle(request, client_address)
        finally:
            if isinstance(request, ResumedConnection):
                request.passed.resumed()


class ResumedConnection(BufferedConnection):
    """The connection of a request handed off by the reader, for the handler that takes it back."""

    def __init__(self, sock: socket.socket, prefix: bytes, passed: FastHandOff):
        super().__init__(sock, prefix)
        self.passed = passed


class ProxyHandler(BaseHTTPRequestHandler):
    """Answers the supervisor's own paths and CORS preflights; relays everything else to the child."""

    # Like stock's handler: each response ends its connection, so a stream
    # of unknown length needs no chunked framing.
    protocol_version = "HTTP/1.0"
    server_version = "mlx-guardian-supervisor"
    # The crash quarantine's record of the request being relayed, if any.
    relay_record = None
    # The door's decision on the request being answered (guardian.access).
    access: Optional[AccessDecision] = None

    @property
    def logged_path(self) -> str:
        """The request's target as a log may hold it: query values hidden (``?api-key=``), cut if long."""
        return loggable_line(self.path)

    @property
    def passed(self) -> Optional[FastHandOff]:
        """The reader's hand-off of this request, if it took it first (``resumed_outcome``)."""
        return getattr(self.connection, "passed", None)

    def parse_request(self) -> bool:
        """The door decides before anything is routed or read: the same code as
        the one-process server's (guardian.access.policy)."""
        self.access = None
        # Per request (``answer_id``), reset before parsing: a request refused by the parse
        # itself must not answer with the last one's id.
        self._given_request_id = self._made_request_id = None
        if not super().parse_request():
            return False
        self._given_request_id = sane_request_id(self.headers.get(REQUEST_ID_HEADER))
        door = self.server.supervisor.door
        passed = self.passed
        # Made already: by the reader that handed it off, or on the head (PublicServer.decide_at_head).
        decided = passed.access if passed is not None else getattr(self.connection, "access", None)
        self.access = decided or door.check(
            AccessRequest(self.command, request_path(self.path), self.headers, self.client_address[0]))
        if self.access.allowed:
            return True
        self.server.supervisor.metrics.access_refused.labels(self.access.error.code).inc()
        log.info("request_refused_at_door", path=loggable_line(request_path(self.path)), code=self.access.error.code,
                 client=self.client_address[0])
        self.close_connection = True
        self.send_error_json(self.access.error)  # an unread body: the connection layer lingers at the close
        return False

    def do_GET(self):
        """Every method takes the same route; the child says which it supports."""
        self.route()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = do_GET

    def send_error(self, code, message=None, explain=None):
        # http.server answers a method it has no do_X for 501: the child says what it allows.
        if code == 501 and getattr(self, "command", None) and self.access is not None:
            return self.route()
        super().send_error(code, message, explain)

    def route(self) -> None:
        """Pick who answers: the supervisor itself, the crash quarantine, or the child's turn."""
        supervisor = self.server.supervisor
        path = request_path(self.path)
        if getattr(self.connection, "body_unread", False):  # the reader never read it (PublicServer.reads_body)
            if takes_body(self.command, path):  # past the child's max_body_bytes (as the reader read it): 413
                limit = self.server.body_limit()
                self.close_connection = True
                return self.send_error_json(body_too_large(int(self.headers["Content-Length"]), limit))
            body = b""  # a route that reads none: the child answers without it
        else:
            # Read the body first even when refusing: closing a socket with
            # unread data can reset the connection before the client reads.
            body = self.read_body()
        if self.command == "OPTIONS":
            return self.answer_preflight()
        if path in self.server.own_paths:
            return self.answer_own(path)
        # Its deadlines count from here (or from the reader's hand-off of it).
        self.arrived_at = self.passed.handed_at if self.passed is not None else time.monotonic()
        request_fingerprint = fingerprint(self.command, self.path, body)
        refusal = supervisor.quarantine.refusal(self.command, request_fingerprint)
        if refusal is not None and self.passed is None:  # a resumed one may have been answered in part
            return self.refuse(refusal)
        # A client that closes its connection while it waits for a completion: held for a
        # child, it gives its place up; relayed, the relay to the child is cut at once (the
        # child, seeing its own client leave, ends the request). Only a completion, as in
        # one process: a client that half-closes once its request is sent (nc -N) still
        # reads, and its close cannot be told from one that left (relayed, every other
        # answer was cut as a client gone, 0 bytes).
        self.watched = self.command == "POST" and path in COMPLETION_PATHS
        if self.watched:
            self.server.watch_client(self.connection, self.client_left)
        try:
            # A request the reader handed off is in flight since then (until ``resumed``).
            with supervisor.in_flight if self.passed is None else contextlib.nullcontext():
                self.serve(path, body, request_fingerprint)
        finally:
            self.stop_watching()

    def answer_preflight(self) -> None:
        """A CORS preflight (OPTIONS), answered here as the child answers it: 204 with the
        door's CORS headers for its Origin (``send_cors_headers``, as every answer the
        supervisor writes has), whatever the child's state. The door lets a preflight in
        without a key (browsers send none with it), so one sent on to the child let anyone
        without a key wake an idle-stopped child (a model load), keep it from its idle stop,
        and take a ``hold_requests`` place while a child started. An Origin the door refuses
        never comes here (``parse_request`` answers its 403)."""
        try:
            self.send_response(204)
            # Stock's do_OPTIONS answers with the JSON content type of every answer it writes.
            self.send_header("Content-Type", "application/json")
            self.send_header(REQUEST_ID_HEADER, self.answer_id())
            self.send_cors_headers()
            self.end_headers()
            self.answered = True
        except CLIENT_GONE:
            pass

    def answer_own(self, path: str) -> None:
        """A path the supervisor answers itself, whoever the child is: GET or HEAD only,
        as the one-process server answers its own."""
        if self.command not in ("GET", "HEAD"):
            return self.send_error_json(method_not_allowed(self.command, path, "GET, HEAD, OPTIONS"))
        if path == LIVENESS_PATH:
            return self.send_json(200, {"status": "ok"})
        if path == STATUS_PATH:
            return self.send_json(200, self.server.supervisor.status())
        if path == METRICS_PATH:
            return self.send_metrics()
        return self.answer_health(path)

    # Set when the client closed its connection; the relay in progress then.
    gone = False
    # Set once the whole answer went out: a client that closes then has left nothing (a
    # fast one read its 503 and closed before this thread's unwatch, and was logged gone).
    answered = False
    # Whether the client's leaving is watched (a completion's).
    watched = True
    upstream: Optional["Upstream"] = None

    def client_left(self) -> None:
        """The client closed its connection (the connection layer's reader thread): the relay
        is cut, and a request held for a child gives its place up now."""
        self.gone = True
        upstream = self.upstream
        if upstream is not None:
            upstream.abort()
        supervisor = self.server.supervisor
        with supervisor.changed:
            supervisor.changed.notify_all()
        # Logged by this request's thread once it knows the answer was not whole (``stop_watching``).

    def stop_watching(self) -> None:
        """The request is over: its client's leaving is no news now. One that left before
        its whole answer went out is logged (after it, it left nothing)."""
        self.server.unwatch_client(self.connection)  # (a continuation's relay may watch it too)
        if self.gone and not self.answered:
            self.say_client_gone()

    # Whether proxy_client_gone was logged for this connection: ``stop_watching`` and a
    # relay's failed write may both say the client left.
    _gone_said = False
    _gone_saying = threading.Lock()  # one for all: taken only as a client leaves

    def say_client_gone(self, **fields) -> None:
        with self._gone_saying:
            if self._gone_said:
                return
            self._gone_said = True
        log.info("proxy_client_gone", path=self.logged_path, **fields)

    def serve(self, path: str, body: bytes, request_fingerprint: str) -> None:
        """Relay to a ready child, waiting for one if need be. If it dies before
        answering, send the request again; if it dies mid-stream, continue the
        stream on the next child (guardian.relay_protocol).

        Every attempt passes the crash quarantine again: a request the dead
        child struck is relayed alone, and one it struck twice is refused.
        """
        try:
            self.relay_attempts(path, body, request_fingerprint)
        finally:
            self.keepalive.stop()

    def relay_attempts(self, path: str, body: bytes, request_fingerprint: str) -> None:
        """``serve``'s attempts, each to a child, until one answers or the request is given up."""
        supervisor = self.server.supervisor
        resends = 0
        stream = None  # a stream the client is receiving, once it can be continued
        relayed_at_last_cut = 0  # its tokens when the last child died under it
        dead_child_pid = None  # set while a resend is due: counted once a child has it
        passed = self.passed
        while not self.gone:
            if stream is not None:
                self.keepalive.start()  # until the next child has it
            if passed is not None:  # the reader's hand-off was the first attempt
                # What the client has is known only from here (a stream's head may be out):
                # its deadlines are judged at the next attempt, as any continuation's.
                child, outcome, passed = passed.child, self.resumed_outcome(passed), None
            else:
                due = self.next_deadline(path, stream)
                if due is not None and due[0] <= time.monotonic():
                    return self.deadline_passed(due[1], stream)
                if self.watched:  # again: a child that had the connection gave it back, or died
                    self.server.watch_client(self.connection, self.client_left)
                child = supervisor.wait_for_child(given_up=lambda: self.gone, until=due and due[0],
                                                  client=self.access.client if self.access is not None else None)
                if self.gone:
                    return  # left while held: nobody to answer, nothing to send
                if child == OVER_CLIENT_SHARE:
                    share = supervisor.door.settings.client_max_concurrent
                    return self.give_up(stream, rate_limited(
                        f"This client has {share} requests waiting for the engine to start already; the "
                        f"limit is {share} ([access] client_max_concurrent).", CONCURRENCY_RETRY_AFTER_S))
                if child is None and due is not None and due[0] <= time.monotonic():
                    return self.deadline_passed(due[1], stream)  # it came while held
                if child is None:
                    return self.give_up(stream, supervisor.unavailable_error())
                # A crash suspect waits to run alone; others wait behind it.
                with supervisor.quarantine.turn(self.command, request_fingerprint, until=due and due[0],
                                                given_up=lambda: self.gone) as alone:
                    if self.gone:
                        return  # left while it waited its turn
                    if alone is isolation.GAVE_UP:  # its deadline passed while it waited its turn
                        return self.deadline_passed(due[1], stream)
                    if alone is isolation.REFUSED:
                        return self.refuse(supervisor.isolation_busy_error(), stream)
                    # The turn may come just after the request before it crashed
                    # this child: never send to a dead one (it would be struck too).
                    self.keepalive.stop()  # the next child writes from here
                    if child_died(child, alone):
                        outcome = CHILD_GONE
                    else:
                        if dead_child_pid is not None:
                            self.resending(path, stream, dead_child_pid, resends)
                            dead_child_pid = None
                        outcome = self.to_child(child, path, body, request_fingerprint, stream)
            if outcome is CHILD_GONE:
                if self.wait_reaped(child, path, stream):
                    continue
                if self.gone or self.answered_past_deadline(path, stream):
                    return
                # Alive after all, though its port took nothing: bounded as resends are.
                if resends >= supervisor.settings.max_resends:
                    return self.give_up(stream, supervisor.lost_child_error())
                resends += 1
                continue
            if outcome is REFUSED_BY_STOPPING_CHILD or outcome is NOT_OPENED_BY_CHILD:
                continue  # the supervisor holds it for the next child, or sends it again
            if outcome is ANSWERED:
                return
            if outcome is not NOTHING_SENT:
                stream = outcome  # cut, to be continued
                self.keepalive.start()
                # A stream that progressed since its last cut starts its count again, as an
                # in-process continuation does: max_resends bounds deaths at one point.
                relayed = len(stream.tokens)
                if relayed > relayed_at_last_cut:
                    resends, relayed_at_last_cut = 0, relayed
            # Once the dead child is reaped, its crash has struck this
            # request: refused, or relayed alone.
            reaped = self.wait_reaped(child, path, stream)
            if self.gone:
                return
            refusal = supervisor.quarantine.refusal(self.command, request_fingerprint)
            if refusal is not None:
                return self.refuse(refusal, stream)
            if not reaped:
                if self.answered_past_deadline(path, stream):
                    return
                return self.give_up(stream, self.dropped_by(child))
            if resends >= supervisor.settings.max_resends:
                return self.give_up(stream, supervisor.lost_child_error())
            resends += 1
            dead_child_pid = child.pid

    def past_deadline(self, path: str, stream) -> Optional[Deadline]:
        """The request's deadline that has passed, if one has."""
        due = self.next_deadline(path, stream)
        return due[1] if due is not None and due[0] <= time.monotonic() else None

    def answered_past_deadline(self, path: str, stream) -> bool:
        """Whether the request's deadline has passed; if so, it is answered (504)."""
        passed = self.past_deadline(path, stream)
        if passed is not None:
            self.deadline_passed(passed, stream)
        return passed is not None

    def wait_reaped(self, child, path: str, stream) -> bool:
        """``Supervisor.wait_reaped``, ended by this request's deadline or its client leaving:
        a child alive after dropping the connection held each attempt its 5 s whatever they said."""
        due = self.next_deadline(path, stream)
        return self.server.supervisor.wait_reaped(child, given_up=lambda: self.gone, until=due and due[0])

    def resending(self, path: str, stream, dead_child_pid: int, resends: int) -> None:
        """The request goes to the next child after its own died: counted and logged here, once
        a child takes it (counted when decided, a request given up meanwhile, its deadline
        past or the hold full, counted as sent again)."""
        self.server.supervisor.metrics.requests_resent.labels("request" if stream is None else "stream").inc()
        if stream is None:
            log.info("request_resent", path=loggable_line(path), dead_child_pid=dead_child_pid, resends=resends)
        else:
            log.info("stream_continuing", path=loggable_line(path), dead_child_pid=dead_child_pid,
                     resends=resends, tokens_relayed=len(stream.tokens))

    # When the request reached the public port (monotonic): its deadlines count from here.
    arrived_at = 0.0

    @functools.cached_property
    def keepalive(self) -> "StreamKeepAlive":
        """A cut stream's comments while it waits for the next child (``[guardian] stream_keepalive_s``)."""
        return StreamKeepAlive(self.connection, self.server.supervisor.core.stream_keepalive_s)

    def next_deadline(self, path: str, stream) -> Optional[tuple[float, Deadline]]:
        """(when, which) of a completion's deadlines comes first (guardian.serving.deadlines);
        a continued ``stream``'s head reached its client, so its read timeout is over."""
        if self.command != "POST" or path not in COMPLETION_PATHS:
            return None
        deadlines = deadlines_of(self.headers, self.server.supervisor.core.request_timeout_s,
                                 stream=False, continued=stream is not None)
        return min(((self.arrived_at + d.seconds, d) for d in deadlines), default=None, key=lambda due: due[0])

    def deadline_passed(self, deadline: Deadline, stream) -> None:
        """Its deadline passed while no child had it (held for one that was starting, or
        between a child that died under it and the next): a 504, or a stream's error event."""
        self.give_up(stream, self.deadline_error(deadline, continued=stream is not None))

    def deadline_error(self, deadline: Deadline, continued: bool) -> GuardianError:
        """``deadline``'s 504, counted and logged."""
        self.server.supervisor.metrics.requests_deadline_exceeded.inc()
        log.warning("request_deadline_exceeded", path=self.logged_path, continued=continued,
                    age_s=round(self.age_s(), 3), deadline_s=deadline.seconds, deadline=deadline.source)
        return deadline.error()

    def age_s(self) -> float:
        """Since the request reached the public port: the child's deadlines count it too."""
        return time.monotonic() - self.arrived_at

    def resumed_outcome(self, passed: FastHandOff):
        """What the reader's hand-off came to, as ``proxy`` says it: the child gave
        the request back (stopping), or died with part of the answer sent or none."""
        self.relay_record = passed.relay
        try:
            if passed.word == handoff.GIVEN_BACK:
                log.info("request_refused_by_stopping_child", path=self.logged_path, child_pid=passed.child.pid)
                # One stopping on its own is taken as one being replaced: held for the next.
                self.server.supervisor.child_stops_on_its_own(passed.child, "it gave a request back")
                return REFUSED_BY_STOPPING_CHILD  # the next attempt takes the handler path
            if passed.word == handoff.NOT_OPENED:
                self.not_opened(passed.child)
                return NOT_OPENED_BY_CHILD  # the handler path's hand-off, or its relay
            return self.after_handed_off_cut(passed.child, passed.handed)
        finally:
            self.server.supervisor.quarantine.settle(passed.child.generation, passed.relay,
                                                     answered=passed.relay.answered)
            self.relay_record = None

    def to_child(self, child, path: str, body: bytes, request_fingerprint: str, stream):
        """Relay on record for the crash quarantine (see ``proxy`` for the outcome)."""
        supervisor = self.server.supervisor
        with supervisor.quarantine.relaying(child.generation, self.command, path,
                                            request_fingerprint) as self.relay_record:
            self.relay_record.stream = stream  # a continuation: where it stands (no strike for progress)
            return self.proxy(child, body, stream)

    def refuse(self, error: GuardianError, stream=None) -> None:
        """The crash quarantine's answer (``give_up``), counted by its code."""
        self.server.supervisor.metrics.requests_refused.labels(error.code).inc()
        self.give_up(stream, error)

    def give_up(self, stream, error: Optional[GuardianError]) -> None:
        """Answer ``error``: as the response if nothing was sent, else as the stream's end."""
        self.keepalive.stop()
        if stream is None:
            return self.send_error_json(error)
        try:
            # A stream that had its finish_reason lacks only its [DONE].
            self.connection.sendall(b"data: [DONE]\n\n" if stream.finished else error.sse_bytes())
            self.answered = True
        except CLIENT_GONE:
            pass

    def answer_health(self, path: str) -> None:
        """/health and /readyz: the child's answer if it comes soon and the child is still held ready.

        Never waits on a frozen child (a SIGSTOPped one accepts connections
        and never answers): past ``health_timeout_s``, or whenever the
        supervisor holds the child not ready, the supervisor's own checks answer.
        """
        supervisor = self.server.supervisor
        child = supervisor.serving_child(health_check=True)
        if child is None and supervisor.state == State.IDLE:
            # No child by choice ([supervisor] idle_stop_s): a request starts one, so a load
            # balancer keeps this replica in, and its checks wake nothing.
            return self.send_json(200, {**supervisor.unavailable_health(),
                                        "status": "ready" if path == READINESS_PATH else "ok"})
        if child is None:
            return self.send_json(503, supervisor.unavailable_health())
        if path == READINESS_PATH and not child.has_readyz:
            # Stock has no /readyz: the supervisor's last check of /health is the answer.
            return self.send_json(200, {"status": "ready", "state": supervisor.state})
        query = self.path.partition("?")[2]
        timeout = supervisor.settings.health_timeout_s
        if asks_for_probes(query):  # probes run now, each within the child's own probe deadline
            timeout = max(timeout, supervisor.deep_readiness_timeout_s)
        try:
            # Who asks, not what else the client sent: the child's answer depends on none of it,
            # and httpx refuses what the door lets in (a value's trailing space: a 503 for a
            # healthy child; a byte past ASCII: no answer at all, and a traceback logged).
            headers = forwarded_headers((), self.client_address[0], self.access)
            response = child.client.request(self.command, self.target(child), headers=headers, timeout=timeout)
        except CHILD_GONE_ERRORS as e:
            reason = f"the child did not answer {path} within {timeout:g} s ({type(e).__name__})"
            return self.send_json(503, supervisor.unavailable_health(reason))
        if supervisor.serving_child(health_check=True) is not child:
            # Held unhealthy (or replaced) while it answered: its 200 is stale.
            return self.send_json(503, supervisor.unavailable_health())
        self.send_whole(response)

    def read_body(self) -> bytes:
        """The request body, by Content-Length (stock requires one too)."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return b""
        return self.rfile.read(max(length, 0))

    # -- relaying ---------------------------------------------------------
    def proxy(self, child, body: bytes, stream):
        """Send the request to the child and relay its answer: ANSWERED; NOTHING_SENT
        if the child failed before answering; or the stream it cut, to continue.
        A first attempt is handed off where it can be (``hand_off``)."""
        if stream is None and child.hands_off() and not self.gone:
            outcome = self.hand_off(child, body)
            if outcome is not RELAY_INSTEAD:
                return outcome
        headers = self.upstream_headers()
        key = self.server.supervisor.relay_key
        if stream is not None:
            headers += relay_protocol.continue_headers(key, stream.continuation_tokens())
        elif not child.stock:  # stock checks no key: it need not see one
            headers.append((relay_protocol.KEY_HEADER, key))
        headers += relay_protocol.age_headers(self.age_s())
        if self.gone:  # left before its relay began (a FIN with the request): nobody to answer
            return ANSWERED
        self.server.supervisor.metrics.passed_relayed.inc()
        self.arm_backstop(stream)
        try:
            return self.relay_to(child, headers, body, stream)
        finally:
            self.disarm_backstop()
            self.upstream = None

    def relay_to(self, child, headers: list, body: bytes, stream):
        """``proxy``'s relay, its deadline's backstop armed."""
        self.reading_child = True  # until its head comes
        try:
            upstream = Upstream(child.port, self.command, self.target(child), headers, body, holder=self)
        except ChildUnreachable as e:
            # A dying child closes its port before it can be reaped (an
            # allocator's or a crash handler's teardown takes ~0.2 s on a GPU):
            # the request never reached it, so its crash cannot be the
            # request's fault. No strike; the next child takes it.
            log.info("proxy_child_unreachable", path=self.logged_path, child_pid=child.pid,
                     error_type=type(e.__cause__).__name__, error_message=str(e.__cause__))
            return CHILD_GONE
        except Exception as e:  # noqa: BLE001 - reset, or closed by a dying child
            if self.gone:  # we cut it: the client left
                return ANSWERED
            if self.backstop is not None:  # we cut it: its deadline passed, and the child kept none
                return self.backstop_answer(stream, is_sse=False, continued=stream is not None)
            self.child_lost(child, e, sent=False)
            return NOTHING_SENT
        finally:
            self.reading_child = False
        try:
            response = upstream.response
            stopping = response.status == 503 and response.getheader(relay_protocol.STOPPING_HEADER) is not None
            if response.status == 503 and (stopping or child.kill_reason is not None):
                # Being replaced (a frozen child gets SIGTERM and drains), or stopping on its
                # own (a guardian child says so), it refused a request it never ran: the next
                # child takes it.
                log.info("request_refused_by_stopping_child", path=self.logged_path, child_pid=child.pid)
                if stopping:
                    self.server.supervisor.child_stops_on_its_own(child, "it refused a request as stopping")
                return REFUSED_BY_STOPPING_CHILD
            return self.relay(child, upstream, stream)
        finally:
            upstream.close()

    # The relay's deadline backstop (``arm_backstop``): the deadline it answered; whether
    # the response's head went out (a stream's read timeout is then over); whether the
    # handler waits on the child now (not on its client); the attempt the timer is for.
    backstop: Optional[Deadline] = None
    head_sent = False
    reading_child = False
    _backstop_attempt: Optional[object] = None
    _backstop_call = None

    @functools.cached_property
    def _backstop_lock(self) -> threading.Lock:
        return threading.Lock()

    def arm_backstop(self, stream) -> None:
        """A relayed completion's deadline is the child's to keep: it answers 504 at it, or
        ends a stream with its error event. A frozen child (SIGSTOP, a stopped VM) keeps
        none, and the client waited for its replacement, --supervisor-unhealthy-after (30 s),
        then got its 504. So the relay is cut ``[supervisor] deadline_backstop_s`` past it while the
        handler waits on the child, and the supervisor answers (``backstop_answer``). Not
        where the connection is handed off: the child answers on it, and the supervisor
        cannot take it back."""
        self.backstop, self.head_sent, self.reading_child = None, stream is not None, False
        due = self.backstop_deadline()
        with self._backstop_lock:
            self._backstop_attempt = attempt = object()
            if due is not None:
                self._backstop_call = self.server.call_at(due[0] + self.backstop_s,
                                                          functools.partial(self.backstop_due, attempt))

    def backstop_due(self, attempt: object) -> None:
        """The reader's thread: past the deadline (as it stands now: a stream whose head went
        out has no read timeout left) while the handler waits on the child, cut the relay;
        else look again (at the new deadline, or a second on: a handler held by a slow
        client has its send timeout)."""
        due = self.backstop_deadline()
        with self._backstop_lock:
            if attempt is not self._backstop_attempt or due is None:  # this attempt is over
                return
            now = time.monotonic()
            if now < due[0] + self.backstop_s or not self.reading_child:
                self._backstop_call = self.server.call_at(max(due[0] + self.backstop_s, now + 1.0),
                                                          functools.partial(self.backstop_due, attempt))
                return
            self.backstop, upstream = due[1], self.upstream
        log.warning("relay_cut_past_deadline", path=self.logged_path, deadline=due[1].source,
                    late_s=round(time.monotonic() - due[0], 3),
                    why="the child kept none of the request's deadlines: frozen, or --engine stock, "
                        "which keeps none")
        if upstream is not None:
            upstream.abort()

    @property
    def backstop_s(self) -> float:
        return self.server.supervisor.settings.deadline_backstop_s

    def backstop_deadline(self) -> Optional[tuple[float, Deadline]]:
        """``next_deadline`` as it stands now: once the head went out, no read timeout is left."""
        return self.next_deadline(request_path(self.path), True if self.head_sent else None)

    def disarm_backstop(self) -> None:
        with self._backstop_lock:
            self._backstop_attempt = None
            call, self._backstop_call = self._backstop_call, None
        if call is not None:
            self.server.cancel_call(call)

    def from_child(self, chunks):
        """``chunks``, said to be waited for from the child (``reading_child``) while read."""
        chunks = iter(chunks)
        while True:
            self.reading_child = True
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            finally:
                self.reading_child = False
            yield chunk

    def backstop_answer(self, stream, is_sse: bool, continued: bool):
        """The relay cut at its deadline's backstop: its 504, or a stream's error event."""
        if stream is not None and stream.finished:  # it had its end, short of its [DONE]
            self.give_up(stream, None)
            return ANSWERED
        error = self.deadline_error(self.backstop, continued=continued)
        if not self.head_sent:
            self.give_up(None, error)
        elif stream is not None:
            self.give_up(stream, error)
        elif is_sse:
            try:
                self.connection.sendall(error.sse_bytes())
            except CLIENT_GONE:
                pass
        return ANSWERED

    def hand_off(self, child, body: bytes):
        """Pass the client's connection and request to the child, which answers on it
        (guardian.handoff); wait until it has finished. The same outcomes as
        ``proxy``, or RELAY_INSTEAD where the connection cannot be handed off."""
        sock = raw_socket(self.connection)
        if type(sock) is not socket.socket:  # TLS: only this process holds the session
            return RELAY_INSTEAD
        request = child_request(self.server.supervisor, child, self.command, self.target(child), self.headers.items(),
                                self.client_address[0], self.access, body, age_s=self.age_s())
        if request is None:
            return RELAY_INSTEAD
        try:
            handed = child.handoff.hand(sock, request)
        except OSError as e:  # its end is closed: the child is gone
            log.info("proxy_child_unreachable", path=self.logged_path, child_pid=child.pid,
                     error_type=type(e).__name__, error_message=str(e))
            return CHILD_GONE
        if handed is None:
            return RELAY_INSTEAD
        # The child watches for the client's leaving now: the client closing once
        # it has the child's answer is no news here.
        self.server.unwatch_client(self.connection)
        # Its deadline is the child's to keep; a frozen one keeps none, and is replaced 2 s
        # past it (``overdue_handoff``), as for the reader's hand-offs: untracked, a request
        # held for a starting child waited for the frozen one to miss its checks (a review).
        tracked = HandlerHandOff(child, self.backstop_deadline(), self.relay_record)
        self.server.handoff_begun(tracked)
        with handed, contextlib.ExitStack() as tracking:
            tracking.callback(self.server.handoff_over, tracked)
            if self.relay_record is not None:
                self.relay_record.stream = handed.progress()
            word = handed.wait()
            if word != handoff.NOT_OPENED:  # counted once the child had it (its word says)
                self.server.supervisor.metrics.passed_handed_off.inc()
            if word == handoff.DONE:
                if self.relay_record is not None:
                    self.relay_record.answered = True
                if access_lines_wanted():  # reading the status back costs a little
                    self.log_request(handed.status() or "-")
                return ANSWERED
            if word == handoff.GIVEN_BACK:
                log.info("request_refused_by_stopping_child", path=self.logged_path, child_pid=child.pid)
                # The next child takes it: one stopping on its own is taken as one being replaced.
                self.server.supervisor.child_stops_on_its_own(child, "it gave a request back")
                return REFUSED_BY_STOPPING_CHILD
            if word == handoff.NOT_OPENED:
                self.not_opened(child)
                if self.relay_record is not None:
                    self.relay_record.stream = None  # (the relay's own from here)
                if self.watched:  # relayed from here: the client's leaving is news again
                    self.server.watch_client(self.connection, self.client_left)
                return RELAY_INSTEAD
            return self.after_handed_off_cut(child, handed)

    def not_opened(self, child) -> None:
        """The child could not open a hand-off: this request is sent again, and the child's
        next ones relayed for ``handoff_pause_s`` (a lasting cause would fail each one first)."""
        pause_s = self.server.supervisor.settings.handoff_pause_s
        child.handoffs_paused_until = time.monotonic() + pause_s
        log.warning("handoff_not_opened", path=self.logged_path, child_pid=child.pid, handoffs_paused_s=pause_s,
                    hint="the child could not open the hand-off (see its own handoff_not_opened); the "
                         "request is sent again, and requests are relayed until the pause ends")

    def after_handed_off_cut(self, child, handed: "handoff.HandedOff"):
        """The child died with the connection: what the client has, by the kernel's
        count and the journal; the rest of a write it cut; then as a relay cut there."""
        if not handed.taken():
            # Still in the hand-off socket when the child died: it never had the
            # request, so its crash cannot be the request's fault. No strike.
            log.info("proxy_child_unreachable", path=self.logged_path, child_pid=child.pid,
                     error_type="HandOffNotTaken", error_message="the child died before taking the request")
            return CHILD_GONE
        try:
            written = handed.written()
        except OSError:  # the client's socket is gone too
            return ANSWERED
        view, rest = handed.replay(written)
        if rest:
            try:
                self.connection.sendall(rest)
            except (OSError, ValueError):
                return ANSWERED
        if client_left_now(raw_socket(self.connection)):
            return ANSWERED
        # Relayed from here on (a continuation): the client's leaving cuts it.
        if self.watched:
            self.server.watch_client(self.connection, self.client_left)
        cut = ConnectionResetError("the child died while answering on the client's connection")
        if written == 0:
            self.child_lost(child, cut, sent=False)
            return NOTHING_SENT
        if view.complete:  # all of it went out: the child died after its [DONE] or its body's end
            if self.relay_record is not None:
                self.relay_record.answered = True
            return ANSWERED
        if self.relay_record is not None:
            self.relay_record.stream = view.stream
        return self.after_cut(child, cut, view.is_sse, view.stream)

    def target(self, child) -> str:
        """The target the child is asked for: the client's, as the child would have read it
        (framing made an absolute-form one its path), with any byte a request line may not
        carry as it is (past ASCII, controls) percent-encoded, which http.client asks for.
        A stock child gets its query values hidden: it writes each request line to the
        log as it came (a key in ``?api_key=`` with it), and routes none by its query."""
        target = quote(self.path, safe=TARGET_AS_IS, encoding="latin-1")
        return without_query_values(target) if child.stock else target

    def upstream_headers(self) -> list[tuple[str, str]]:
        """The client's headers minus hop-by-hop ones, plus who the client is."""
        return forwarded_headers(self.headers.items(), self.client_address[0], self.access)

    def relay(self, child, upstream: "Upstream", stream):
        """Status, headers, then the body as it arrives; a continuation's events only."""
        response = upstream.response
        continued = stream is not None
        try:
            if stream is None:
                is_sse, stream = self.relay_head(response, stock=child.stock)
                if self.relay_record is not None:
                    self.relay_record.stream = stream
            elif self.continues(response):
                is_sse = True
                stream.continued()
            else:
                log.warning("stream_continuation_refused", path=self.logged_path, child_pid=child.pid,
                            status=response.status)
                # Its deadline passed as it reached the child: said as such, not as a lost child.
                deadline = child_deadline_error(response) if response.status == 504 else None
                self.give_up(stream, deadline or self.server.supervisor.lost_child_error())
                return ANSWERED
            cut = self.relay_events(upstream, stream) if is_sse else self.relay_bytes(upstream)
            if cut is not None and self.gone:  # we cut it: the client left
                return ANSWERED
            if cut is not None and self.backstop is not None:  # we cut it: past its deadline
                return self.backstop_answer(stream, is_sse, continued=continued)
            if cut is not None:
                return self.after_cut(child, cut, is_sse, stream)
            self.answered = True
            if self.relay_record is not None:
                self.relay_record.answered = True
        except CLIENT_GONE:
            # Closing the upstream connection tells the child its client left.
            self.say_client_gone(child_pid=child.pid)
        return ANSWERED

    def after_cut(self, child, cut: BaseException, is_sse: bool, stream):
        """The child died with part of the answer sent: ANSWERED (ended for the
        client), or the stream to continue on the next child."""
        try:
            self.child_lost(child, cut, sent=True)
            if stream is None:
                if is_sse:  # a stream no child can continue (stock's, an untagged one)
                    self.wfile.write(self.cut_stream_error(child).sse_bytes())
                return ANSWERED
            if stream.finished:  # cut just before its [DONE]
                self.give_up(stream, None)
                return ANSWERED
            if not stream.continuable:
                self.give_up(stream, self.cut_stream_error(child))
                return ANSWERED
            return stream
        except CLIENT_GONE:
            self.say_client_gone(child_pid=child.pid)
            return ANSWERED

    def cut_stream_error(self, child) -> GuardianError:
        """The error event that ends a stream its child cut and no child continues: a crash's
        (engine_restarting, to retry) once the child is reaped; a drop's (engine_dropped_request,
        not to retry) if it lives on past reap_wait_s (stock, whose handler failed on this
        request: the same request fails again). Its head went out: only request_timeout_s
        bounds the wait, as a continued stream's; past it, its 504's event."""
        path = request_path(self.path)
        if self.wait_reaped(child, path, stream=True) or self.gone:
            return self.server.supervisor.lost_child_error()
        passed = self.past_deadline(path, stream=True)
        if passed is not None:
            return self.deadline_error(passed, continued=True)
        return self.dropped_by(child)

    def dropped_by(self, child) -> GuardianError:
        """What a request gets whose ``child`` dropped it and lives on past reap_wait_s, logged."""
        supervisor = self.server.supervisor
        log.warning("request_dropped_by_child", path=self.logged_path, child_pid=child.pid,
                    reap_wait_s=supervisor.settings.reap_wait_s)
        return supervisor.dropped_request_error()

    def relay_head(self, response, stock: bool):
        """The child's status and headers; whether it is a stream, and the
        RelayedStream to keep if the child tags it for continuation. A ``stock`` child's
        answer gets the door's CORS headers in place of stock's (which grant every origin
        and cover no Authorization: a page let in with a key could not send it), and an
        X-Request-ID, as a guardian child's has."""
        # send_response_only: the child's own Server and Date headers follow.
        self.head_sent = True
        self.send_response_only(response.status, response.reason)
        is_sse = continuable = False
        for name, value in response.getheaders():  # names as the child spelled them
            lowered = name.lower()
            if lowered == CONTINUABLE:
                continuable = True
            elif lowered not in HOP_BY_HOP and not (stock and lowered in CORS_HEADERS):
                self.send_header(name, value)
                if lowered == "content-type":
                    is_sse = value.startswith(SSE_CONTENT_TYPE)
        if stock:
            self.send_cors_headers()
            self.send_header(REQUEST_ID_HEADER, self.answer_id())
        self.send_header("Connection", "close")
        self.end_headers()
        self.log_request(response.status)
        return is_sse, relay_protocol.RelayedStream() if is_sse and continuable else None

    @staticmethod
    def continues(response) -> bool:
        """Whether the next child took a continuation and streams it."""
        return response.status == 200 and any(name.lower() == CONTINUABLE for name, _ in response.getheaders())

    def relay_bytes(self, upstream: "Upstream"):
        """Pass the body through chunk by chunk; the upstream error if it was cut."""
        write = client_writer(self.connection)
        try:
            for chunk in self.from_child(upstream.chunks()):
                write(chunk)
        except CLIENT_GONE:
            raise
        except Exception as e:  # noqa: BLE001 - any failure reading from the child is a cut
            return e
        return None

    def relay_events(self, upstream: "Upstream", stream=None):
        """Pass SSE events on whole, as each ends (``relay_protocol.EventRelay``);
        the cause if the stream was cut (it ended without ``[DONE]``)."""
        write = client_writer(self.connection)
        events = relay_protocol.EventRelay(stream)
        pass_on = events.pass_on
        try:
            # One read takes every event the child has written since the last
            # (one write to the client for all of them); a child writes whole
            # events, so a read rarely ends inside one.
            for chunk in self.from_child(upstream.chunks()):
                shown = pass_on(chunk)
                if shown:
                    write(shown)
        except CLIENT_GONE:
            raise
        except Exception as e:  # noqa: BLE001 - any failure reading from the child is a cut
            return e
        return None if events.done else EOFError("the stream ended without [DONE]")

    def child_lost(self, child, cause: BaseException, sent: bool) -> None:
        """The child failed under this request: counted and logged. The caller answers:
        sends the request again, continues or ends a stream (``after_cut``); a body of
        known length stops short, and its client sees the cut."""
        supervisor = self.server.supervisor
        if self.relay_record is not None:
            # Answered, but a suspect of the child's death until it is reaped.
            self.relay_record.lost = True
        supervisor.metrics.relay_errors.labels("during_response" if sent else "before_response").inc()
        log.warning("proxy_child_lost", path=self.logged_path, child_pid=child.pid, bytes_sent=sent,
                    error_type=type(cause).__name__, error_message=str(cause))

    # -- answering ourselves ----------------------------------------------
    def send_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        """A JSON response written by the supervisor."""
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            # As the child does: an X-Request-ID comes back, whoever answers (the client's
            # own when sane, else one made for it, which the access line names too).
            self.send_header(REQUEST_ID_HEADER, self.answer_id())
            self.send_cors_headers()
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self.answered = True
        except CLIENT_GONE:
            pass

    def send_cors_headers(self) -> None:
        """The CORS headers the child's answers carry: a page let in reads the supervisor's
        answers too (its 503 while a child starts, its 504, its refusals at the door)."""
        headers = getattr(self, "headers", None)
        origin = headers.get("Origin") if headers is not None else None
        for name, value in self.server.supervisor.door.cors_headers(origin).items():
            self.send_header(name, value)

    def send_metrics(self) -> None:
        """The supervisor's metrics and its child's (guardian.supervise.metrics)."""
        body = self.server.supervisor.metrics.exposition()
        try:
            self.send_response(200)
            self.send_header("Content-Type", supervise_metrics.CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.send_header(REQUEST_ID_HEADER, self.answer_id())
            self.send_cors_headers()
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except CLIENT_GONE:
            pass

    def send_whole(self, response: httpx.Response) -> None:
        """A response read whole from the child (its health check), with its status and
        headers; its CORS headers the supervisor's, as the child was sent no Origin; its
        X-Request-ID the client's (the child was sent none: it made one, and a stock child
        sends none), as every answer the supervisor writes itself."""
        try:
            self.send_response_only(response.status_code, response.reason_phrase)
            for raw_name, raw_value in response.headers.raw:
                name = raw_name.decode("latin-1")
                if name.lower() not in HOP_BY_HOP and name.lower() not in CORS_HEADERS \
                        and name.lower() != REQUEST_ID_HEADER.lower():
                    self.send_header(name, raw_value.decode("latin-1"))
            self.send_header(REQUEST_ID_HEADER, self.answer_id())
            self.send_cors_headers()
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(response.content)
        except CLIENT_GONE:
            pass

    def send_error_json(self, error: GuardianError) -> None:
        """An OpenAI-shaped error, with Retry-After when it has one."""
        self.send_json(error.status, error.body(), error.response_headers())

    def answer_id(self) -> str:
        """The X-Request-ID of an answer the supervisor writes itself: the client's own when
        sane, else one made for this request (``_made_request_id``, reset per request)."""
        given = getattr(self, "_given_request_id", None)
        if given:
            return given
        if getattr(self, "_made_request_id", None) is None:
            self._made_request_id = made_request_id()
        return self._made_request_id

    def log_message(self, format, *args):
        # The child logs every request it serves; the supervisor's own
        # access lines are for debugging only, as JSON like the rest.
        if not access_lines_wanted():
            return
        key_name = self.access.key_name if self.access is not None else None
        log.debug("proxy_access", client=self.client_address[0], line=loggable_line(format % args),
                  request_id=self.answer_id(), **({"api_key": key_name} if key_name else {}))


def is_preflight(incoming) -> bool:
    """Whether a request the reader has whole is an OPTIONS (a CORS preflight). Its head is
    canonical by now (guardian.serving.framing): it starts with its method, which is
    case-sensitive (an ``options`` is another method, which the door does not let in
    without a key)."""
    return incoming.buffer.startswith(b"OPTIONS ")


def access_lines_wanted() -> bool:
    """Whether the supervisor's access lines are logged (DEBUG): each costs tens of
    microseconds of structlog's processors even when dropped."""
    return logging.getLogger(LOGGER_NAME).isEnabledFor(logging.DEBUG)


def child_died(child, alone: bool) -> bool:
    """Whether the child has exited; a suspect about to run alone waits a moment to be sure."""
    try:
        child.proc.wait(timeout=SUSPECT_SEND_GRACE_S if alone else 0)
    except subprocess.TimeoutExpired:
        return False
    return True

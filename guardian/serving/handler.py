"""The HTTP handler: stock's APIHandler, answering faults properly.

Stock answers any exception from the engine with a 404 and drops streams
without a word. This subclass lets stock parse, generate and format every
normal response, and steps in only when a request ends with an error:
an OpenAI-shaped body with the right status before any byte was sent, or
an SSE error event followed by ``[DONE]`` once a stream has started.

Stock's handler calls its ``response_generator``; here that is a
``guardian.serving.assembly.ServedModel``, whose ``generate`` runs admission and then the
engine. The handler's own endpoints (``GET``, guardian.serving.endpoints) read its
``engine``, ``gate`` (request limits) and ``stall_detector`` (health).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import time
from typing import Optional

import structlog

from guardian import relay_protocol, stock
from guardian.access.policy import AccessDecision, AccessRequest
from guardian.serving.deadlines import COMPLETION_PATHS, SDK_RETRY_COUNT_HEADER, TEXT_COMPLETION_PATH, deadlines_of
from guardian.serving.endpoints import GET_PATHS, MONITORING_PATHS, Endpoints
from guardian.request_context import (REQUEST_ID_HEADER, add_response_headers, bind_log_fields, client_gone,
                                      current_request, deadline_passed, made_request_id, request_scope,
                                      sane_request_id)
from guardian.errors import (CLIENT_GONE, SERVER_STOPPING, AbortRequest, ClientGoneAbort, GuardianError,
                             body_too_large, from_stock_exception, method_not_allowed)
from guardian.observability.logs import loggable_line
from guardian.plugin_manager import call_each, notify

# Fields whose null stock reads as "none", not as the default: a null draft model is no
# draft model where left out it is the server's --draft-model (leave_out_nulls).
NULL_MEANS_NONE = frozenset({"draft_model", "adapters"})

log = structlog.get_logger("guardian.http")

# Sampling fields stock's handler reads from the body and checks as floats alone.
XTC_FIELDS = ("xtc_probability", "xtc_threshold")


class GuardianHandler(Endpoints, stock.handler.DoorCorsHandler):
    # Where responses go while stock's do_POST has not yet dispatched (see do_POST).
    _client_wfile = None
    # The client's X-Request-ID for the request being answered, when sane.
    client_request_id: Optional[str] = None
    # The id made for a response outside a completion when the client sent none (``answer_id``).
    _made_request_id: Optional[str] = None
    # The door's decision on the request being answered (guardian.access).
    access: Optional[AccessDecision] = None

    def parse_request(self) -> bool:
        # Per request: one connection (one handler) may carry several. Reset before parsing:
        # a request refused by the parse itself must not answer with the last one's id.
        self.client_request_id = self._made_request_id = None
        parsed = super().parse_request()
        self.client_request_id = sane_request_id(self.headers.get(REQUEST_ID_HEADER)) if parsed else None
        self.access = None
        return parsed and self.let_in()

    def let_in(self) -> bool:
        """The door's decision, before the request is routed or its body read;
        a refusal is answered here (the method's handler never runs)."""
        door = self.server.door
        request = AccessRequest(self.command, self.path.partition("?")[0], self.headers, self.client_address[0])
        pm = self.response_generator.pm
        # Made on the head already where the body was still to come (GuardianHTTPServer.decide_at_head).
        decision = getattr(self.connection, "access", None) or decide_access(pm, door, request)
        # No plugin answered (the built-in disabled): as if there were no door.
        self.access = decision if decision is not None else AccessDecision(self.client_address[0])
        notify(pm.hook.on_access_decision, request=for_plugins(request), decision=self.access)
        if self.access.allowed:
            return True
        self.close_connection = True
        self.send_error_json(self.access.error)  # an unread body: the connection layer lingers at the close
        return False

    def cors_headers(self) -> dict:
        """Stock's CORS headers, granting what the door lets in (guardian.access)."""
        return self.server.door.cors_headers(self.headers.get("Origin"))

    @property
    def client_name(self) -> str:
        """Who sent the request being answered: an API key's name, or an address."""
        return self.access.client if self.access is not None else self.client_address[0]

    def handle_completion(self, request, stop_words):
        # Stock accepted the body: from here on it writes to the client.
        self.resume_client_output()
        by_supervisor = relay_protocol.relayed_by_supervisor(self.headers)
        relayed = by_supervisor and getattr(self.connection, "handed_off", None) is None
        if relayed:
            # Relayed: this connection is the supervisor's, which reads as fast as its own
            # client does. A client reading a long answer slowly but steadily held the
            # relay past send_timeout_s, and the answer was cut here (27,820 bytes short).
            # The supervisor applies the client's send timeout, and closes this connection
            # when its client stops reading. Restored after: it bounds a keep-alive's read.
            self.connection.settimeout(None)
        with self.server.completions, request_scope(self.client_request_id or self.request_id, bool(self.stream),
                                                    client=self.client_name):
            # A client that closes its connection ends its request wherever it is:
            # queued, in prefill, generating an answer not yet written (guardian.serving.connection).
            info = current_request()
            self.server.watch_client(self.connection, lambda: client_gone(info))
            deadlines = []
            try:  # the watch ends whatever fails from here: it must not outlive the socket
                deadlines = self.start_deadlines(info)
                if self.stream and by_supervisor:  # relayed or handed off
                    return self.handle_relayed_stream(request, stop_words)
                self.handle_completion_answered(request, stop_words)
            finally:
                if relayed:
                    self.connection.settimeout(self.server.limits.send_timeout_s or None)
                self.server.unwatch_client(self.connection)
                self._head_deadline = None
                for deadline in deadlines:
                    self.server.cancel_call(deadline)

    # A stream's deadline that ends once its head is sent (the client's read timeout).
    _head_deadline = None

    def start_deadlines(self, info) -> list:
        """The request's deadlines (guardian.serving.deadlines), as timers on the connection
        layer's clock, counted from when the request reached the public port: here, or at
        the supervisor that held it (``relay_protocol.request_age``)."""
        retries = relay_protocol.header_number(self.headers.get(SDK_RETRY_COUNT_HEADER), max_digits=6)
        if retries:
            bind_log_fields(client_retry=retries)  # the openai SDK sent it again
        relayed = relay_protocol.relayed_by_supervisor(self.headers)
        age_s = relay_protocol.request_age(self.headers) if relayed else 0.0
        arrived = info.started_at - age_s
        handed_at = relay_protocol.handed_at(self.headers) if relayed else None
        if handed_at is not None:
            # Its age was written when it was handed off or relayed, and it may have waited for
            # this child since (frozen, or busy). Both processes read the machine's one
            # monotonic clock.
            arrived = min(arrived, handed_at - age_s)
        continued = relayed and relay_protocol.CONTINUE_HEADER in self.headers
        timers = []
        for deadline in deadlines_of(self.headers, self.response_generator.config.core.request_timeout_s,
                                     stream=bool(self.stream), continued=continued):
            due = arrived + deadline.seconds
            if due <= time.monotonic():
                # Passed already (a deadline shorter than reading the request): fail it here. A timer
                # would run on the reader's thread, and a short answer could win that race.
                deadline_passed(info, deadline.error())
                break
            timers.append(self.server.call_at(due, functools.partial(deadline_passed, info, deadline.error())))
            if deadline.until_head:
                self._head_deadline = timers[-1]
        return timers

    def handle_relayed_stream(self, request, stop_words):
        """A stream the supervisor relays: tagged with its tokens, perhaps a continuation
        of one a dead child began (guardian.relay_protocol)."""
        try:
            vocab_size = self.response_generator.gate.request_bounds(self.body).vocab_size
            continued = relay_protocol.continued_from(self.headers, vocab_size)
        except ValueError as e:
            return self.send_error_json(GuardianError(str(e), status=400, type="invalid_request_error",
                                                      code="invalid_request"))
        generator = self.response_generator
        # On a connection handed to this child (guardian.handoff), tags go to the journal only.
        output = relay_protocol.TokenTaggingOutput(self.wfile, getattr(self.connection, "write_tagged", None))
        add_response_headers({relay_protocol.CONTINUABLE_HEADER: "1"})
        self.response_generator, self.wfile = RelayedGenerator(generator, output, continued), output
        try:
            self.handle_completion_answered(request, stop_words)
        finally:
            try:
                output.release()  # a tail held with no [DONE] after it (an error's end)
            except CLIENT_GONE:
                pass
            self.response_generator, self.wfile = generator, output.wrapped

    def handle_completion_answered(self, request, stop_words):
        """Stock's handle_completion, its faults answered in OpenAI's shape."""
        started = time.monotonic()
        # Stock logs its 200 when it buffers a non-streaming response's
        # headers; an error may replace that 200. One access line, with
        # the status the client got, is written when the request ends.
        self._answering_completion, self._access_status = True, None
        try:
            super().handle_completion(request, stop_words)
        except AbortRequest as abort:
            if abort.error.code == SERVER_STOPPING and self.give_back():
                return
            self.send_error_json(abort.error)
        except (ClientGoneAbort, *CLIENT_GONE):
            log.info("client_disconnected")
        except GuardianError as error:
            self.finish_with_error(error)
        except Exception as e:
            self.finish_with_error(self.response_generator.error_for(e))
        finally:
            self._answering_completion = False
            if self._access_status is not None:
                super().log_request(self._access_status)
            log.debug("request_finished", duration_ms=round((time.monotonic() - started) * 1000, 1))

    # While a completion is answered, the last status line written: logged at its end.
    _answering_completion = False
    _access_status = None

    def log_request(self, code="-", size="-"):
        if self._answering_completion:
            self._access_status = code
            return
        super().log_request(code, size)

    def give_back(self) -> bool:
        """A stopping child refuses a request its supervisor handed over by giving the
        connection back untouched: the supervisor sends it to the next child."""
        give_back = getattr(self.connection, "give_back", None)
        if give_back is None or not give_back():
            return False
        self.close_connection = True
        log.info("request_given_back", reason=SERVER_STOPPING)
        return True

    def finish_with_error(self, error: GuardianError) -> None:
        """End a request whose headers stock has prepared or sent."""
        if not self.stream:
            # Non-streaming headers wait in the buffer until the body is
            # ready: drop stock's 200 and answer with the error instead.
            self._headers_buffer = []
            self.send_error_json(error)
            return
        try:
            self.wfile.write(error.sse_bytes())
            self.wfile.flush()
        except CLIENT_GONE:
            return
        log.warning("stream_ended_with_error", status=error.status, code=error.code)

    def send_error_json(self, error: GuardianError) -> None:
        """``error`` in OpenAI's shape. A refusal because this server stops is marked for a
        supervisor that relayed the request (``relay_protocol.STOPPING_HEADER``); not on a
        connection handed off, whose answer goes to the client itself."""
        headers = error.response_headers()
        if (error.code == SERVER_STOPPING and relay_protocol.relayed_by_supervisor(self.headers)
                and getattr(self.connection, "give_back", None) is None):
            headers = {**headers, relay_protocol.STOPPING_HEADER: "1"}
        try:
            self.send_json(error.status, error.body(), headers)
        except CLIENT_GONE:
            return
        log.warning("request_rejected" if error.status < 500 else "request_errored",
                    status=error.status, code=error.code, error_message=loggable_line(error.message))

    def send_json(self, status: int, payload: dict, headers: Optional[dict] = None) -> None:
        """A JSON response with stock's status line and CORS headers."""
        body = json.dumps(payload).encode()
        stock.handler.set_completion_headers(self, status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":  # its answer is the headers alone (RFC 9110 §9.3.2), a refusal too
            self.wfile.write(body)
        self.wfile.flush()

    def validate_model_parameters(self):
        """Every field checked against the model the request goes to, then stock's own checks.

        Stock calls this once it has read the fields, before it builds the
        request; a refusal is an AbortRequest, which stock's ``except
        ValueError`` lets through to do_POST, with the field in ``param``.
        """
        error = self.response_generator.gate.check_body(self.body, chat=self.path != TEXT_COMPLETION_PATH)
        if error is not None:
            raise AbortRequest(error)
        # JSON has one kind of number, and JavaScript writes 1.0 as 1: stock's check takes
        # these two as floats only, and refused 0 and 1 (400, no param). Checked above.
        for name in XTC_FIELDS:
            if type(getattr(self, name, None)) is int:
                setattr(self, name, float(getattr(self, name)))
        super().validate_model_parameters()

    def send_unknown_path(self):
        """OpenAI's answer to a path it does not have (stock: a text/plain "Not Found")."""
        self.send_error_json(GuardianError(
            f"Invalid URL ({self.command} {self.path.partition('?')[0]})", status=404,
            type="invalid_request_error", code="unknown_url",
        ))

    def send_method_not_allowed(self):
        """405 with Allow for a path that exists under other methods; else the unknown path's 404."""
        path = self.path.partition("?")[0]
        if path in GET_PATHS or path.startswith("/v1/models/"):
            allowed = "GET, HEAD, OPTIONS"
        elif path in COMPLETION_PATHS:
            allowed = "POST, OPTIONS"
        else:
            return self.send_unknown_path()
        self.send_error_json(method_not_allowed(self.command, path, allowed))

    do_PUT = do_PATCH = do_DELETE = send_method_not_allowed

    def send_error(self, code, message=None, explain=None):
        # http.server answers a method no do_X exists for (TRACE, anything) 501: it is a 405 here.
        if code == 501 and getattr(self, "command", None):
            return self.send_method_not_allowed()
        super().send_error(code, message, explain)

    def do_POST(self):
        """Stock's, behind a body guard (413 unread past max_body_bytes), its refusals OpenAI-shaped."""
        path = self.path.partition("?")[0]
        if path not in COMPLETION_PATHS:
            return self.send_method_not_allowed()  # 404 where no method has the path
        # Stock routes on the whole target, so a query (a client's default_query, an
        # ?api-version=) found no path (404): it means nothing here, as for GET.
        self.path = path
        limit = self.response_generator.gate.max_body_bytes
        length = self.content_length()
        if length < 0:
            # Stock would read until the client closes: a request that never ends.
            return self.send_error_json(GuardianError(
                "Invalid Content-Length header", status=400, type="invalid_request_error",
                code="invalid_request",
            ))
        # The reader left the body unread (over the limit then: the door's refusals never get
        # here): refused whatever a save made of the limit since. Read now, it would come
        # from the socket with no body deadline, at the client's pace.
        over = limit is not None and length > limit
        if over or getattr(self.connection, "body_unread", False):
            # Answered from the header alone; the body is never read into
            # memory, and this connection cannot carry another request.
            self.close_connection = True
            return self.send_error_json(body_too_large(length, limit if over else None))
        # Stock reads and parses the body, and refuses a bad one (Content-Length,
        # JSON, not an object, parameters) with {"error": "text"} before it
        # calls handle_completion. Until that call its writes go to a buffer,
        # so a refusal can be answered again in OpenAI's shape.
        self._client_wfile, self.wfile = self.wfile, io.BytesIO()
        self.log_request = lambda *args: None  # the answer sent is logged, not stock's
        self.leave_out_nulls(length)
        error = None
        try:
            super().do_POST()
        except AbortRequest as abort:  # the guardian's own check of the fields
            error = abort.error
        except Exception as e:
            if self._client_wfile is None:
                raise  # not a refusal: handle_completion had begun
            # Stock lets some refusals escape as exceptions, and the client
            # would get no answer at all: a body that is not UTF-8 or nested
            # deeper than the JSON parser goes, and (0.31) a parameter its
            # validation refuses.
            error = (invalid_json(f"Invalid JSON in request body: {type(e).__name__}: {e}")
                     if isinstance(e, (UnicodeDecodeError, RecursionError)) else from_stock_exception(e))
        finally:
            refusal = self.resume_client_output()
        if error is None and refusal:
            error = stock_refusal(refusal)
        if error is not None:
            self.send_error_json(error)

    def leave_out_nulls(self, length: int) -> None:
        """A field sent as null is a field left out, as OpenAI takes it: the openai SDK sends
        ``temperature=None`` (a setting read with ``.get()``) as null, which stock read as
        the value and refused (400 "temperature must be a number"). Stock reads the body
        from here, with what it would have had without those fields. Only the body's own
        fields; parsed twice only where "null" is written at all."""
        raw = self.rfile.read(length)
        if b"null" in raw:
            try:
                body = json.loads(raw.decode())  # as stock reads it (a byte order mark is refused)
            except (ValueError, RecursionError):  # stock refuses it, as it is
                body = None
            if isinstance(body, dict) and any(value is None and key not in NULL_MEANS_NONE
                                              for key, value in body.items()):
                raw = json.dumps({key: value for key, value in body.items()
                                  if value is not None or key in NULL_MEANS_NONE}).encode()
                self.headers.replace_header("Content-Length", str(len(raw)))
        self.rfile = io.BytesIO(raw)

    def content_length(self) -> int:
        """The Content-Length header; 0 when absent or not a number (stock answers those)."""
        try:
            return int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return 0

    def resume_client_output(self) -> bytes:
        """Write to the client again; return what stock wrote to the buffer meanwhile."""
        if self._client_wfile is None:
            return b""
        buffered, self.wfile, self._client_wfile = self.wfile, self._client_wfile, None
        del self.log_request
        return buffered.getvalue()

    def answer_id(self) -> str:
        """The X-Request-ID of a response outside a completion (a refusal at the door, a 404,
        /health): the client's own when sane, else one made for it, which the access line
        names too (a completion's is its own: ``request_scope``)."""
        if self.client_request_id:
            return self.client_request_id
        if self._made_request_id is None:
            self._made_request_id = made_request_id()
        return self._made_request_id

    def end_headers(self):
        # Headers admission set for this request (X-Guardian-...) and its
        # X-Request-ID, whoever writes the response: stock or the guardian's
        # error path. Every response has one, as OpenAI's do (the openai SDK
        # shows it as an error's request_id): a client reporting a refusal can name it.
        headers = current_request().response_headers
        if headers is None:
            headers = {REQUEST_ID_HEADER: self.answer_id()}
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self._head_deadline is not None:  # a stream's head goes out now: the client reads on
            self.server.cancel_call(self._head_deadline)
            self._head_deadline = None
        super().end_headers()

    def flush_headers(self):
        """A head that promises a body of known length goes out with that body, in one write.

        Stock writes a completion's head, then its body: a supervised child that died
        between the two left its client a 200 and a ``Content-Length`` with no body,
        which nothing can complete (the next child's answer is another length). In one
        write, all or none of it reaches the client, or the journal (handed off) holds
        all of it for the supervisor to finish.
        """
        buffered = getattr(self, "_headers_buffer", None)
        if buffered and self.command != "HEAD":
            head = b"".join(buffered)
            if b"\r\nContent-Length: " in head and b"\r\nContent-Length: 0\r\n" not in head:
                self._headers_buffer = []
                self.wfile = HeadWithBody(self, head)
                return
        super().flush_headers()

    def log_message(self, format, *args):
        # BaseHTTPRequestHandler writes access lines straight to stderr;
        # route them through structlog so every line is JSON.
        # A load balancer's checks come every few seconds, by GET or HEAD: at DEBUG.
        routine = self.command in ("GET", "HEAD") and getattr(self, "path", "").partition("?")[0] in MONITORING_PATHS
        # The key's name, never the key: the request line (its query's values hidden) and
        # the status are all the line holds.
        key_name = self.access.key_name if self.access is not None else None
        # Within a completion the log's context names its id already.
        named = {} if current_request().response_headers is not None else {"request_id": self.answer_id()}
        (log.debug if routine else log.info)("http_access", client=self.client_name,
                                             line=loggable_line(format % args),
                                             **({"api_key": key_name} if key_name else {}), **named)


class HeadWithBody:
    """A handler's output while its head waits for its body (``flush_headers``): the first
    write sends both; a flush with no write sends the head alone."""

    def __init__(self, handler, head: bytes):
        self.handler, self.wrapped, self.head = handler, handler.wfile, head

    def write(self, data) -> int:
        self.handler.wfile = self.wrapped
        self.wrapped.write(self.head + bytes(data))
        return len(data)

    def flush(self) -> None:
        self.handler.wfile = self.wrapped
        self.wrapped.write(self.head)
        self.wrapped.flush()

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


class RelayedGenerator:
    """The response generator for one relayed stream: a continuation goes on
    after the tokens its client has; each token taken is told to the tagging output."""

    def __init__(self, generator, output, continued: Optional[list]):
        self._generator = generator
        self._output = output
        self._continued = continued

    def generate(self, request, args, progress_callback=None):
        if self._continued is not None:
            if 0 < args.max_tokens <= len(self._continued):
                # Nothing left to generate: a stream that ended has no continuation.
                raise AbortRequest(GuardianError(
                    f"{relay_protocol.CONTINUE_HEADER} holds {len(self._continued)} tokens, "
                    f"max_tokens is {args.max_tokens}", status=400, type="invalid_request_error",
                    param="max_tokens", code="invalid_request"))
            args = stock.continuation.continuation_args(args, self._continued)
        ctx, responses = self._generator.generate(request, args, progress_callback)
        return ctx, relay_protocol.tap_tokens(responses, self._output)

    def __getattr__(self, name):
        return getattr(self._generator, name)


def stock_refusal(response: bytes) -> GuardianError:
    """Stock's refusal of a request body (status line, headers, ``{"error": "text"}``), in OpenAI's shape."""
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(None, 2)[1])
    try:
        message = str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace") or f"HTTP {status}"
    # Stock's own words for a body that is not a JSON object.
    if message.startswith(("Invalid JSON", "Request should be a JSON dictionary")):
        return invalid_json(message)
    return GuardianError(message, status=status, type="invalid_request_error", code="invalid_request")


def invalid_json(message: str) -> GuardianError:
    return GuardianError(message, status=400, type="invalid_request_error", code="invalid_json")


def for_plugins(request: AccessRequest, key_checked: bool = False) -> AccessRequest:
    """``request`` as plugins see it: a supervised child's without the supervisor's key
    (``key_checked``: the door found it valid, and its own check in the plugins' turn,
    the built-in access plugin's, takes that word for it)."""
    headers = relay_protocol.without_relay_key(request.headers)
    if headers is request.headers:
        return request
    return dataclasses.replace(request, headers=headers, relay_key_checked=key_checked)


def decide_access(pm, door, request: AccessRequest) -> Optional[AccessDecision]:
    """The door's decision on ``request``: in a supervised child the relay key's first
    (AccessPolicy.decided_by_relay_key), then the check_access hooks. A hook that raises
    refuses the request with a 500 (the client got an empty reply, its traceback went to
    stderr unstructured); None: no hook answered."""
    decision = door.decided_by_relay_key(request) if door is not None else None
    if decision is not None:
        return decision
    # Checked: only a key that matched (a public path lets a wrong one this far, and a
    # plugin's turn that took its word would see the client and key name it forges).
    request = for_plugins(request, key_checked=door is not None and door.relay_key is not None
                          and relay_protocol.relayed_by_supervisor(request.headers))
    if pm is None:
        return door.check(request) if door is not None else None
    # Each plugin's on its own: one that raises, or answers something other than an
    # AccessDecision (its client got no reply at all), refuses the request, never lets it in.
    for plugin, decision, error in call_each(pm.hook.check_access, request=request, door=door):
        if error is not None:
            log.error("access_check_failed", path=loggable_line(request.path), plugin=plugin, exc_info=error)
        elif decision is not None and not isinstance(decision, AccessDecision):
            log.error("access_check_failed", path=loggable_line(request.path), plugin=plugin,
                      error_message=f"check_access returned {type(decision).__name__}, not an AccessDecision")
        elif decision is not None:
            return decision
        else:
            continue
        return AccessDecision(request.client_address, GuardianError(
            "The server failed to check the request's access.", status=500, code="internal_error"))
    return None

"""The request an HTTP thread is serving, visible to code it calls.

Stock's handler calls ``ResponseGenerator.generate(request, args)`` with no
word of the request id or whether the client streams; the guardian's handler
sets them here first, and structlog's contextvars put the id on every log
line the thread writes meanwhile. Admission, which runs inside that call,
leaves here what the handler needs later: headers for the response, and
what to do when the request ends (give back its share of the KV budget).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import structlog

from guardian.errors import ClientGoneAbort

log = structlog.get_logger("guardian.context")


@dataclass(frozen=True)
class RequestInfo:
    request_id: str = "-"
    stream: bool = False
    # Set only inside request_scope: headers for this request's response
    # (GuardianHandler.end_headers adds them) and callbacks for its end.
    response_headers: Optional[dict] = None
    at_end: Optional[list] = None
    # When the handler took the request (time.monotonic()): time to first token counts from here.
    started_at: Optional[float] = None
    # Who sent it (guardian.access): an API key's name, or the client's address
    # when the server has no keys. Per-client limits and fair admission key on it.
    client: str = "-"
    # Called (on another thread) if the client closes its connection while the
    # request is answered; the engine adds its request's cancellation here.
    on_client_gone: Optional[list] = None
    # Not empty once the client left: a callback added later runs at once (the close
    # may come before the engine has queued the request).
    client_left: Optional[list] = None
    # The engine's records of this request (guardian.engine.ledger), for its deadline,
    # and the deadline's error once it passed (perhaps before the engine had a record).
    engine_requests: Optional[list] = None
    deadline_errors: Optional[list] = None


# The request's id goes back to its client in this header (the client's own
# when it sent a sane one: guardian.serving.handler).
REQUEST_ID_HEADER = "X-Request-ID"
# A client's X-Request-ID is used as the request's id when it is one token
# of these characters: it goes into log lines and back into a header.
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=@-]{0,127}")


def sane_request_id(given: Optional[str]) -> Optional[str]:
    """The client's X-Request-ID if it is safe to log and echo, else None."""
    return given if given and SANE_REQUEST_ID.fullmatch(given) else None


def made_request_id() -> str:
    """An id for a response whose client sent no sane X-Request-ID (OpenAI's look alike)."""
    return f"req-{uuid.uuid4().hex}"


# Only the first bytes of a head are searched for a client's id in a refusal: a head refused
# for its size (431) may be 64 KiB, and a refusal is written on the reader's thread.
REQUEST_ID_SEARCHED_BYTES = 8192


def request_id_in_head(head) -> Optional[str]:
    """The client's sane X-Request-ID among the whole header lines at the start of a raw
    ``head`` (bytes, perhaps cut short, perhaps not framed right: the connection layer
    refuses such heads before any handler parses them), else None."""
    lines = bytes(head[:REQUEST_ID_SEARCHED_BYTES]).split(b"\n")[1:-1]  # past the request line; whole lines
    for at, line in enumerate(lines):
        line = line.rstrip(b"\r")
        if not line:
            break
        name, colon, value = line.partition(b":")
        if colon and name.lower() == b"x-request-id":
            folded = at + 1 < len(lines) and lines[at + 1][:1] in (b" ", b"\t")  # obs-fold: its value goes on
            return None if folded else sane_request_id(value.strip(b" \t").decode("latin-1"))
    return None


_current: contextvars.ContextVar[RequestInfo] = contextvars.ContextVar(
    "guardian_request", default=RequestInfo()
)


def current_request() -> RequestInfo:
    return _current.get()


def add_response_headers(headers: dict) -> None:
    """Send ``headers`` with the current request's response (no-op outside one)."""
    info = _current.get()
    if info.response_headers is not None:
        info.response_headers.update(headers)


def at_request_end(callback: Callable[[], None]) -> bool:
    """Call ``callback`` when the HTTP thread is done with the current request.

    Returns False outside a request scope: the caller must arrange another way.
    """
    info = _current.get()
    if info.at_end is None:
        return False
    info.at_end.append(callback)
    return True


def _when_gone(info: RequestInfo, callback: Callable[[], None]) -> None:
    """``callback`` among ``info``'s leaving callbacks; run now if its client left already.
    ``client_gone`` runs on the reader's thread: whichever of the two takes the callback
    from the list runs it, once."""
    if not info.client_left:
        info.on_client_gone.append(callback)
        if not info.client_left:
            return
        try:
            info.on_client_gone.remove(callback)
        except ValueError:
            return  # client_gone took it
    callback()


def track_engine_request(record) -> None:
    """The engine queued the current request as ``record``: its client's leaving
    cancels it (``record.client_left``), its deadline fails it (``record.time_out``)."""
    info = _current.get()
    if info.engine_requests is not None:
        info.engine_requests.append(record)
        _when_gone(info, record.client_left)
        if info.deadline_errors:  # it passed during admission: the request ends at once
            record.time_out(info.deadline_errors[0])


def deadline_passed(info: RequestInfo, error) -> None:
    """The request ``info`` describes is past its deadline: it ends with ``error`` (a 504),
    now or as soon as the engine queues it."""
    info.deadline_errors.append(error)
    for record in list(info.engine_requests or ()):
        record.time_out(error)


def client_gone(info: RequestInfo) -> None:
    """The client of the request ``info`` describes closed its connection: run its callbacks, once,
    and any added from now on (``_when_gone``)."""
    if info.client_left is not None:
        info.client_left.append(True)
    callbacks = info.on_client_gone or []
    while True:
        try:
            callback = callbacks.pop()
        except IndexError:  # none left (``_when_gone`` may take one back meanwhile)
            return
        try:
            callback()
        except Exception:
            log.exception("client_gone_callback_failed")


def request_ended():
    """For the current request, waiting its turn: its deadline's error (a 504) once passed;
    ``ClientGoneAbort`` raised once its client left (nobody to answer). None while it waits."""
    info = _current.get()
    if info.client_left:
        raise ClientGoneAbort()
    return info.deadline_errors[0] if info.deadline_errors else None


def bind_log_fields(**fields) -> None:
    """Add fields to every later log line of the current request (no-op outside one)."""
    if _current.get().at_end is not None:
        structlog.contextvars.bind_contextvars(**fields)


@contextlib.contextmanager
def request_scope(request_id: str, stream: bool, client: str = "-"):
    info = RequestInfo(request_id=request_id, stream=stream, response_headers={REQUEST_ID_HEADER: request_id},
                       at_end=[], started_at=time.monotonic(), client=client, on_client_gone=[], client_left=[],
                       engine_requests=[], deadline_errors=[])
    token = _current.set(info)
    # Fields bound during the request must not follow the thread to the
    # next request of a keep-alive connection.
    saved_fields = structlog.contextvars.get_contextvars()
    try:
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                yield
            finally:
                info.on_client_gone.clear()  # answered: a close from now on is no one's leaving
                for callback in info.at_end:
                    try:
                        callback()
                    except Exception:
                        log.exception("request_end_callback_failed")
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**saved_fields)
        _current.reset(token)

"""The request an HTTP thread is serving, visible to code it calls.

Stock's handler calls ``ResponseGenerator.generate(request, args)`` with no
word of the request id or whether the client streams; the guardian's handler
sets them here first, and structlog's contextvars put the id on every log
line the thread writes meanwhile.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import structlog


@dataclass(frozen=True)
class RequestInfo:
    request_id: str = "-"
    stream: bool = False


_current: contextvars.ContextVar[RequestInfo] = contextvars.ContextVar(
    "guardian_request", default=RequestInfo()
)


def current_request() -> RequestInfo:
    return _current.get()


@contextlib.contextmanager
def request_scope(request_id: str, stream: bool):
    token = _current.set(RequestInfo(request_id=request_id, stream=stream))
    try:
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            yield
    finally:
        _current.reset(token)

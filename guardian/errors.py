"""Errors clients get, in OpenAI's shape, and how engine errors are named."""

from __future__ import annotations

import errno
import json
import ssl
from dataclasses import dataclass, field
from typing import Optional

# The code of a 503 from a server that is stopping (its requests drain meanwhile).
SERVER_STOPPING = "server_stopping"
# /health's and /readyz's reason from the stop on: a supervisor reads it in its child's answer.
STOPPING_REASON = "the server is stopping"
# /readyz's reason, at its start, while a step that computes runs past the stall limit, as
# the watchdog allows (stall_busy_extra_s): a supervisor waits for its child's own verdict.
BUSY_STEP_REASON = "a step computes or pages past the stall limit"


@dataclass
class GuardianError(Exception):
    """A request ends with this error instead of a completion.

    It travels on a request's response queue like stock's own exceptions,
    so stock's consumer code raises it on the HTTP thread.
    """

    message: str
    status: int = 503
    # OpenAI's error type; None: from the status (a plugin's 400 said "server_error").
    type: Optional[str] = None
    code: Optional[str] = None
    param: Optional[str] = None
    retry_after_s: Optional[float] = None
    # Whether a client should send the request again: the x-should-retry
    # header, which the openai SDK obeys over its own rule (it retries every
    # 5xx twice by default). None: from the status (see should_retry).
    retry: Optional[bool] = None
    extra: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__init__(self.message)
        if self.type is None:
            self.type = ("rate_limit_error" if self.status == 429
                         else "invalid_request_error" if 400 <= self.status < 500 else "server_error")

    def body(self) -> dict:
        error = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        error.update(self.extra)
        return {"error": error}

    def sse_bytes(self) -> bytes:
        """The error as the last event of a stream that has started: the event, then [DONE]."""
        return f"data: {json.dumps(self.body())}\n\ndata: [DONE]\n\n".encode()

    @property
    def should_retry(self) -> Optional[bool]:
        """Busy (429) and unavailable (503) pass; another 4xx never will; other 5xx: no opinion."""
        if self.retry is not None:
            return self.retry
        if self.status in RETRYABLE_STATUSES:
            return True
        if 400 <= self.status < 500:
            return False
        return None

    def response_headers(self) -> dict:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return headers


# Statuses that mean "not now": the same request may succeed later.
RETRYABLE_STATUSES = (429, 503)


class EngineStepError(Exception):
    """An engine step raised inside code that stock guards with ``except``.

    Stock's non-batched path puts every exception on the request's queue and
    carries on. A failed model step there is the engine's failure, not the
    request's: the request's record re-raises it so the supervisor sees it.
    """

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class AbortRequest(BaseException):
    """Carries a GuardianError past stock's ``except Exception`` handler.

    Stock's ``handle_completion`` answers any exception from ``generate()``
    with a 404; deriving from BaseException (like GeneratorExit) lets the
    guardian's handler answer with the right status instead.
    """

    def __init__(self, error: GuardianError):
        super().__init__(error.message)
        self.error = error


# What a write to a client that left raises. A write that made no progress for
# [http] send_timeout_s raises TimeoutError: the client stopped reading, which
# ends its request as a client that left does.
CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


def write_error_as_client_gone(error: BaseException) -> BaseException:
    """A write's error as the client's leaving where it is one. macOS answers a write
    to a connection its peer is tearing down with EPROTOTYPE now and then (CPython
    issue 77631), a plain OSError: here it is the BrokenPipeError it means. Over TLS, a
    write to a client that left raises an SSL error (SSLEOFError, then "bad length" for
    any write after it): its session is over, as its connection is."""
    if type(error) is OSError and error.errno == errno.EPROTOTYPE:
        gone = BrokenPipeError(errno.EPIPE, f"the client left ({error.strerror})")
    elif isinstance(error, ssl.SSLError) and not isinstance(error, (ssl.SSLWantReadError, ssl.SSLWantWriteError)):
        gone = BrokenPipeError(errno.EPIPE, f"the client's TLS session ended ({error})")
    else:
        return error
    gone.__cause__ = error
    return gone


class ClientGoneAbort(BaseException):
    """The client left while ``generate()`` waited for its request's first answer:
    carried past stock's ``except Exception`` (as ``AbortRequest`` is) to a handler that
    has nobody to answer, not a server error (a half-closed client still reads)."""


def method_not_allowed(method: str, path: str, allowed: str) -> GuardianError:
    """405 for a path that exists under other methods (``allowed``, the Allow header's value):
    the same words from the one-process server and the supervisor."""
    return GuardianError(f"{method} is not allowed on {path}; use {allowed.split(',')[0]}.", status=405,
                         type="invalid_request_error", code="method_not_allowed", retry=False,
                         headers={"Allow": allowed})


def body_too_large(length: int, limit: Optional[int]) -> GuardianError:
    """413 for a body over ``max_body_bytes``, answered from its Content-Length: the same
    words from the one-process server and the supervisor's public port (``limit`` None:
    lifted by a save since the head was read)."""
    most = f"at most {limit} bytes" if limit is not None else "no more than its limit at the time"
    return GuardianError(f"The request body is {length} bytes; this server accepts {most}.",
                         status=413, type="invalid_request_error", code="request_too_large", retry=False,
                         headers={"Connection": "close"})


def engine_unavailable(message: str, retry_after_s: Optional[float] = None) -> GuardianError:
    """A 503 that says come back: after ``retry_after_s``, by default ``[guardian] retry_after_s``'s default."""
    if retry_after_s is None:
        from guardian.config.tables import CoreSettings

        retry_after_s = CoreSettings.retry_after_s.default
    return GuardianError(
        message, status=503, code="engine_unavailable", retry_after_s=retry_after_s
    )


# Exceptions stock puts on a request's queue that are the request's fault.
_CLIENT_ERRORS = (ValueError, TypeError, KeyError, IndexError, AssertionError)


def from_stock_exception(exc: Exception) -> GuardianError:
    """What to tell a client for an exception stock gave its request."""
    if isinstance(exc, GuardianError):
        return exc
    if is_model_not_found(exc):
        return GuardianError(
            f"The model could not be loaded: {exc}",
            status=404,
            type="invalid_request_error",
            code="model_not_found",
            param="model",
        )
    if type(exc).__name__ == "TemplateError" or isinstance(exc, _CLIENT_ERRORS):
        return GuardianError(
            f"{type(exc).__name__}: {exc}",
            status=400,
            type="invalid_request_error",
            code="invalid_request",
        )
    return GuardianError(
        f"{type(exc).__name__}: {exc}", status=500, code="internal_error"
    )


# huggingface_hub's names for "no such model": a bad repo id (a ValueError),
# a repo the hub does not have, one missing from the cache when offline.
_MODEL_NOT_FOUND_ERRORS = ("HFValidationError", "RepositoryNotFoundError", "LocalEntryNotFoundError")


def is_model_not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or type(exc).__name__ in _MODEL_NOT_FOUND_ERRORS



class ClientLeft(ConnectionAbortedError):
    """The client closed its connection while its request was being answered.

    Put on a request's response queue when the connection layer sees the
    close, so the HTTP thread waiting there stops at once (it has no one to
    write to) and the engine drops the request at its next step.
    """

"""A completion's deadlines: ``[guardian] request_timeout_s``, and the client's own read
timeout where its SDK sends one (the openai SDK's ``x-stainless-read-timeout``).

Both count from when the request reached the server's public port. The one-process
handler sets them as timers on the connection layer's clock (guardian.serving.handler).
Under ``--supervise`` the supervisor holds a request no longer than they allow while
no child is ready, and tells the child how long the request was held
(``relay_protocol.AGE_HEADER``), so that a child started after a crash does not give a
held or continued request its whole time again. Imports no mlx: the supervisor reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from guardian.errors import GuardianError

# The openai SDK's own read timeout (seconds), and how many times it sent this request before.
SDK_READ_TIMEOUT_HEADER = "x-stainless-read-timeout"
SDK_RETRY_COUNT_HEADER = "x-stainless-retry-count"
# A deadline from the client's read timeout is this much earlier: the lesser of the two.
CLIENT_TIMEOUT_LEAD_S = 0.5
CLIENT_TIMEOUT_LEAD_SHARE = 0.1
# Stock's completion endpoints: the POST paths that carry a JSON body, and have deadlines.
TEXT_COMPLETION_PATH = "/v1/completions"
COMPLETION_PATHS = (TEXT_COMPLETION_PATH, "/v1/chat/completions", "/chat/completions")


def takes_body(method: str, path: str) -> bool:
    """Whether a request's route reads its body: a completion's alone (stock's, and ours)."""
    return method == "POST" and path in COMPLETION_PATHS


@dataclass(frozen=True)
class Deadline:
    seconds: float
    source: str  # what set it, as the 504 says
    # Ends once a stream's head is sent: the client's read timeout is httpx's limit on one
    # wait for bytes, and a stream's events keep each wait short.
    until_head: bool = False

    def error(self) -> GuardianError:
        return GuardianError(
            f"The request was not answered within its deadline of {self.seconds:g} s ({self.source}).",
            status=504, type="server_error", code="deadline_exceeded", retry=False)


def client_read_timeout(headers) -> Optional[float]:
    """The client's read timeout in seconds (its SDK's header), if a sane one."""
    try:
        client_s = float(headers.get(SDK_READ_TIMEOUT_HEADER) or "nan")
    except ValueError:
        return None
    return client_s if 0 < client_s < float("inf") else None  # NaN fails both


def deadlines_of(headers, request_timeout_s: float, *, stream: bool, continued: bool) -> list[Deadline]:
    """The deadlines of one completion request. ``continued``: a stream whose head its
    client has had (a continuation on a new child), which the client's read timeout no
    longer bounds."""
    deadlines = []
    if request_timeout_s:
        deadlines.append(Deadline(request_timeout_s, "request_timeout_s"))
    client_s = client_read_timeout(headers)
    if client_s and not continued:
        # A moment before the client's own timeout, so that the 504 (which says not to
        # retry) reaches it first: at the same moment the SDK nearly always gave up first
        # and sent the request again, twice, each run cut at its deadline.
        ahead_s = min(CLIENT_TIMEOUT_LEAD_S, CLIENT_TIMEOUT_LEAD_SHARE * client_s)
        deadlines.append(Deadline(client_s - ahead_s, f"the client's {SDK_READ_TIMEOUT_HEADER} of {client_s:g} s, "
                                  "less a moment for this answer to reach it first", until_head=stream))
    return deadlines

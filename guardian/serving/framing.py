"""A request's framing, judged once at the door (RFC 9112), for both HTTP servers.

Where two parsers could read one message two ways, a proxy in front of this
server (HAProxy, docs/deploy.md) and the server may disagree on where one
request ends and the next begins: that is how a request is smuggled past the
proxy's checks. http.server is lenient (of two Content-Lengths it takes the
first; it reads ``Host : x`` as a Host), and the supervisor's handler read a
bad length as none. So the connection layer judges every head before a
handler reads it, and both modes give one answer, in OpenAI's shape, the
connection closed after it:

- a request line that is not ``METHOD target HTTP/1.x``: 400 (505 for HTTP/2
  or later, which is not spoken here);
- ``Transfer-Encoding`` (stock reads a body by its Content-Length alone): 411
  on its own, 400 beside a Content-Length;
- a Content-Length that is not digits, or two that differ: 400; one of more
  than 18 digits: 413; POST, PUT or PATCH without one: 411;
- a header line with no name, whitespace before its colon, a folded line
  (obs-fold), a CR or NUL inside it: 400;
- Host twice, or none in an HTTP/1.1 request: 400;
- an ``Expect`` other than ``100-continue``: 417;
- more headers, or a longer line, than http.server reads (99; 64 KiB): 431 (414
  for the request line).

Where RFC 9112 lets a server be lenient and stock was, the door is too: a
bare LF ends a line (``printf 'GET /health HTTP/1.0\\n\\n' | nc``). An
absolute-form target (``GET http://host/path``, which a server must accept)
is read as its path, with its authority as the Host, the one the door checks.
The handlers then read a canonical head: CRLF lines, an origin-form target.

A client that sent ``Expect: 100-continue`` waits for ``100 Continue`` before
its body (curl, for a body over 1 MiB, waits a second): it gets one as soon
as its head has passed. Imports no mlx.
"""

from __future__ import annotations

import http.client
import io
import re
from dataclasses import dataclass
from typing import Optional

from guardian.errors import GuardianError

# The blank line that ends a head: CRLF CRLF, or bare LFs (RFC 9112 §2.2).
HEAD_END = re.compile(rb"\r?\n\r?\n")
# What a client waiting on ``Expect: 100-continue`` is sent once its head has passed.
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# RFC 9110 §5.6.2: a method, a header's name.
TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
# Inside a request target: anything but controls and spaces (obs-text is let through, as stock did).
_BAD_TARGET_BYTE = re.compile(rb"[\x00-\x20\x7f]")
# Inside a header value once lines are split: a bare CR or a NUL (RFC 9110 §5.5).
_BAD_VALUE_BYTE = re.compile(rb"[\x00\r]")
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
# A Content-Length with more digits than this is past any body a server reads (10^18 bytes).
MAX_LENGTH_DIGITS = 18
# Stock's own words for a missing or bad length (mlx_lm.server's do_POST), kept.
LENGTH_REQUIRED = "Content-Length header is required"
INVALID_LENGTH = "Invalid Content-Length header"
# http.server's own limits (http.client's _MAXHEADERS and _MAXLINE): past them it answers
# in HTML, so the door refuses first, in OpenAI's shape. Its count of 100 takes in the
# blank line; a line's length, its line feed.
STDLIB_MAX_HEADERS = 99
STDLIB_MAX_LINE = 65536


@dataclass(slots=True)
class Head:
    """A head that passed: its body's length, and what the handlers should read."""

    body_length: int
    # The head rewritten (CRLF lines, an origin-form target), CRLF CRLF included; None: as received.
    canonical: Optional[bytes] = None
    expects_continue: bool = False


def find_head_end(buffer, start: int, limit: int) -> Optional[int]:
    """Where the body begins in ``buffer`` (past the head's blank line), searched from
    ``start`` (the length already searched, less the three bytes a blank line may
    have begun in), no further than ``limit``; None until the blank line comes."""
    found = HEAD_END.search(buffer, max(0, start - 3), limit)
    return None if found is None else found.end()


def refusal(status: int, message: str, code: str = "invalid_request") -> GuardianError:
    return GuardianError(message, status=status, type="invalid_request_error", code=code, retry=False)


def judge_head(head: bytes, max_header_count: int) -> Head:
    """``head`` (its blank line included) if it frames one request one way only;
    raises GuardianError, the client's answer, if not."""
    *lines, blank, _ = head.split(b"\n")  # the blank line's LF, and the nothing after it
    max_header_count = min(max_header_count, STDLIB_MAX_HEADERS)
    if len(lines) - 1 > max_header_count:
        raise refusal(431, f"The request has more than {max_header_count} headers.", "too_many_headers")
    if len(head) > STDLIB_MAX_LINE:
        # Each line as the handler reads it: ended by CRLF (a bare LF's line is rewritten so).
        if len(lines[0].rstrip(b"\r")) + 2 > STDLIB_MAX_LINE:
            raise refusal(414, f"The request line is longer than {STDLIB_MAX_LINE} bytes.", "uri_too_long")
        if any(len(line.rstrip(b"\r")) + 2 > STDLIB_MAX_LINE for line in lines):
            raise refusal(431, f"A header line is longer than {STDLIB_MAX_LINE} bytes.", "headers_too_large")
    bare_lf = blank != b"\r"
    for i, line in enumerate(lines):
        if line.endswith(b"\r"):
            lines[i] = line[:-1]
        else:
            bare_lf = True
    parts = lines[0].split(b" ")
    if lines[0].decode("latin-1").split() != [part.decode("latin-1") for part in parts]:
        # http.server splits a request line at any whitespace (str.split: \x0b, \x1c, \x85,
        # \xa0 too): "GET /x\x0bHTTP/1.1" was a request of HTTP/1.1 to it, or its HTML 400.
        raise refusal(400, "The request line is not METHOD TARGET HTTP-VERSION, each one space apart.")
    if len(parts) == 2 and parts[0] == b"GET" and len(lines) == 1:
        if _BAD_TARGET_BYTE.search(parts[1]):
            raise refusal(400, "The request target holds a control character.")
        return Head(0)  # HTTP/0.9's simple request: answered as stock answered it
    if len(parts) != 3 or not TOKEN.fullmatch(parts[0]) or not parts[1]:
        raise refusal(400, "The request line is not METHOD TARGET HTTP-VERSION.")
    method, target, version = parts
    matched = _VERSION.fullmatch(version)
    if matched is None:
        raise refusal(400, "The request line's HTTP version is not HTTP/1.0 or HTTP/1.1.")
    if matched.group(1) != b"1":
        raise refusal(505, "This server speaks HTTP/1.0 and HTTP/1.1 only.", "http_version_not_supported")
    if _BAD_TARGET_BYTE.search(target):
        raise refusal(400, "The request target holds a control character.")
    authority = None
    if target[:7].lower() == b"http://" or target[:8].lower() == b"https://":
        target, authority = _origin_form(target)

    hosts, lengths, transfer_encoded, expect = 0, [], False, None
    for number, line in enumerate(lines[1:], 1):
        if line[:1] in (b" ", b"\t"):
            raise refusal(400, f"Header line {number} is folded onto the one before (obs-fold).")
        name, colon, value = line.partition(b":")
        if not colon or not TOKEN.fullmatch(name):
            raise refusal(400, f"Header line {number} is not NAME: VALUE (no space before the colon).")
        if _BAD_VALUE_BYTE.search(value):
            raise refusal(400, f"Header line {number} holds a CR or NUL.")
        name = name.lower()
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            # A list, even of one value repeated (RFC 9112 §6.3 lets a recipient take it):
            # the handlers read one number, and the supervisor's read none.
            lengths.append(b"-" if b"," in value else value.strip(b" \t"))
        elif name == b"transfer-encoding":
            transfer_encoded = True
        elif name == b"expect":
            expect = value.strip(b" \t").lower()

    if transfer_encoded:
        if lengths:
            raise refusal(400, "The request has both Transfer-Encoding and Content-Length.")
        raise refusal(411, LENGTH_REQUIRED + "; request bodies are not read chunked.", "length_required")
    if not all(item.isdigit() for item in lengths):
        raise refusal(400, INVALID_LENGTH)
    if any(len(item) > MAX_LENGTH_DIGITS for item in lengths):  # int() refuses past 4,300 digits
        raise refusal(413, "The request body is larger than this server reads.", "request_too_large")
    if len(set(lengths)) > 1:
        raise refusal(400, "The request has Content-Length twice, with different values.")
    if not lengths and method in _BODY_METHODS:
        raise refusal(411, LENGTH_REQUIRED, "length_required")
    if hosts > 1:
        raise refusal(400, "The request has more than one Host header.")
    http11 = matched.group(2) != b"0"
    if http11 and hosts == 0 and authority is None:
        raise refusal(400, "An HTTP/1.1 request needs a Host header.")
    if expect is not None and expect != b"100-continue":
        raise refusal(417, "The only expectation this server meets is Expect: 100-continue.",
                      "expectation_failed")

    canonical = None
    if bare_lf or authority is not None:
        fields = lines[1:]
        if authority is not None:  # RFC 9112 §3.2.2: the target's authority, not the Host sent
            fields = [b"Host: " + authority] + [f for f in fields if f.partition(b":")[0].lower() != b"host"]
        canonical = b"\r\n".join([b" ".join((method, target, version)), *fields]) + b"\r\n\r\n"
    return Head(int(lengths[0]) if lengths else 0, canonical, expect is not None and http11)


def _origin_form(target: bytes) -> tuple[bytes, bytes]:
    """An absolute-form target as (its path and query, its authority)."""
    rest = target.partition(b"://")[2]
    cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if not authority or b"@" in authority:
        raise refusal(400, "The request target's authority is missing or names a user.")
    if not path.startswith(b"/"):
        path = b"/" + path
    return path, authority


def handler_target(target: str) -> str:
    """A target as http.server gives it to a handler: a leading ``//`` made one ``/``
    (CPython gh-87389: a browser reads ``//name/path`` as another host's)."""
    return "/" + target.lstrip("/") if target.startswith("//") else target


def request_path(target: str) -> str:
    """The path the one-process server routes and its door checks: the handler's
    target up to its query, and nothing else taken off (stock routes no path with a
    fragment or a scheme in it). The supervisor reads a target the same way, so both
    modes answer alike. Never raises, whatever the target."""
    return handler_target(target).partition("?")[0]


def asks_for_probes(query: str) -> bool:
    """Whether a ``/readyz`` query asks for a deep check (``deep=1``: the probes run
    now). Read alike by a server and by a supervisor in front of it, which waits that
    much longer for the answer: ``?deep=0`` or ``?nodeep`` held a public handler thread
    of the supervisor's for a probe's deadline while its child ran none."""
    return "deep=1" in query.split("&")


def read_head(head: bytes) -> tuple[str, str, http.client.HTTPMessage]:
    """A canonical head (one ``judge_head`` passed) as http.server reads it: the
    method, the path without its query, and the headers (an HTTPMessage, as a
    handler's ``self.headers``)."""
    request_line, _, fields = head.partition(b"\r\n")
    method, target = request_line.decode("latin-1").split(" ")[:2]
    return method, request_path(target), http.client.parse_headers(io.BytesIO(fields))

"""How a supervised child and its supervisor continue a stream across the child's death.

In subprocess mode a client's stream is relayed by the supervisor. When the
child dies mid-stream, the supervisor sends the request to the next child
as a continuation: the same body, plus the token ids the client already has
the text of; the new child's engine goes on after them (the same prompt-
cache, stop-matching and detokenizer priming as an in-process continuation,
``guardian.stock.continuation.continuation_args``), and the supervisor relays its events
as the rest of the first stream (same ``id`` and ``created``, ``usage``
counting every token).

For that the supervisor must know which tokens' text it relayed. The child
says so in the stream itself: each ``data:`` event that carries text is
preceded, in the same SSE event, by a comment line naming the token ids
consumed since the last one (``: guardian-tokens 12,873``). SSE clients
ignore comments; the supervisor strips them anyway. Tokens whose text stock
has not written yet (a partial character) are named only with the event
that writes it: a cut before that event regenerates them. A stream whose
events stop matching its tokens' text (a tool call, reasoning) is marked not
continuable, and a cut ends it with an error event as before.

Only the supervisor may ask for this: it starts each child with a random
key in the environment, and a child tags streams and accepts continuations
only for requests that carry the key. Both ends live here, and this module
imports no mlx (the supervisor carries none).
"""

from __future__ import annotations

import hmac
import json
import math
import os
import re
import secrets
import time
from typing import Iterable, Optional

# The supervisor's key, given to each child it starts.
RELAY_KEY_ENV = "MLX_GUARDIAN_RELAY_KEY"
# Request headers the supervisor adds; clients' own are dropped at the public port.
KEY_HEADER = "X-Guardian-Relay-Key"
CONTINUE_HEADER = "X-Guardian-Continue-From"
# How long ago the request reached the supervisor's public port, in milliseconds: held
# while no child was ready, or a stream continued after its first child died. Its
# deadlines count from then (guardian.serving.deadlines).
AGE_HEADER = "X-Guardian-Request-Age-Ms"
# When the supervisor handed the request to a child or wrote it to the child's socket, on
# the machine's monotonic clock, which both processes read alike (seconds; a child is
# always on the supervisor's machine, guardian.supervise.fast_handoff.CHILD_HOST). A
# request waits in the child's channel or socket until the child takes it: frozen
# (SIGSTOP) or busy, a child took a request 9 s old for a fresh one, and generated it
# past its deadline.
HANDED_AT_HEADER = "X-Guardian-Handed-At"
PRIVATE_HEADERS = frozenset({KEY_HEADER.lower(), CONTINUE_HEADER.lower(), AGE_HEADER.lower(),
                             HANDED_AT_HEADER.lower()})
# A day: a larger age is read as this (the deadlines it serves are shorter).
MAX_AGE_MS = 86_400_000
# What a child's head may hold more than its client's. Added by the supervisor:
# X-Forwarded-For, the client's name, its key's name, the supervisor's key, a
# continuation's tokens, the request's age and when it was passed on. Added by the client library the supervisor
# sends it with: http.client's Host, Accept-Encoding and Content-Length when it relays
# (the Host replaces the client's, or comes where it sent none); httpx's Accept,
# Accept-Encoding, Connection and User-Agent on a health check. The public door leaves
# room for them under http.server's count (guardian.serving.framing), and a supervised
# child allows them beyond its own [http] max_header_count.
HEADERS_ADDED_FOR_CHILD = 12
# The child's answer: this stream is tagged, and can be continued.
CONTINUABLE_HEADER = "X-Guardian-Continuable"
# The child's 503 to a request its supervisor relayed (not handed off: TLS, macOS, a
# group) while it stops on its own: it never ran the request, which its supervisor sends
# to the next child, as it does one a child gives back when handed off.
STOPPING_HEADER = "X-Guardian-Stopping"
TOKENS_COMMENT = b": guardian-tokens "
NOT_CONTINUABLE = b"-"
# A continuation longer than this is not one the supervisor made.
MAX_CONTINUED_TOKENS = 1 << 20
# A continuation's ids go in header lines of at most this many bytes: http.server reads
# no longer line (64 KiB, guardian.serving.framing), and a stream of ~10,000 tokens of a
# large vocabulary writes more than that.
CONTINUE_LINE_BYTES = 60_000
# What a supervised child's head may hold more than [http] max_header_bytes: the
# headers the supervisor adds, a continuation's ids among them (in lines of
# CONTINUE_LINE_BYTES, as many as http.server's count of 99 lines leaves room for: a
# client of 10 headers leaves ~80, some 700,000 ids of 7 bytes; one of the 87 the public
# door lets in, ~3). The public door counted none of it: a head near its limit got the
# child's 431, and a stream of more tokens than the limit's bytes could not be continued.
# At most what http.server reads: 99 lines of 64 KiB.
HEADER_BYTES_ADDED_FOR_CHILD = 99 * 65536
_DATA = b"data: "
_LF = ord("\n")
_TAG_AFTER_LINE = b"\n" + TOKENS_COMMENT
_FINISHED = b'"finish_reason": "'  # stock's json.dumps spacing; null while a stream goes on


def new_relay_key() -> str:
    return secrets.token_hex(16)


# -- the child's end ------------------------------------------------------
def started_by_supervisor() -> bool:
    """Whether a supervisor started this process (it gave us its relay key)."""
    return bool(os.environ.get(RELAY_KEY_ENV))


def relayed_by_supervisor(headers) -> bool:
    """Whether a request came through the supervisor that started this child."""
    expected = os.environ.get(RELAY_KEY_ENV)
    given = headers.get(KEY_HEADER)
    # Bytes: a header's non-ASCII (latin-1) text makes compare_digest of str raise.
    return bool(expected) and given is not None and hmac.compare_digest(
        given.encode("latin-1", "replace"), expected.encode())


def without_relay_key(headers):
    """``headers`` (an http.client.HTTPMessage) without the supervisor's key: what plugins see
    of a relayed request (one that logged its headers wrote the key to the log)."""
    if headers.get(KEY_HEADER) is None:
        return headers
    kept = type(headers)()
    for name, value in headers.items():
        if name.lower() != KEY_HEADER.lower():
            kept[name] = value
    return kept


def header_number(value: Optional[str], max_digits: int) -> Optional[int]:
    """A header's whole number (this protocol's, and the openai SDK's retry count), if it is
    ASCII digits and no more than ``max_digits`` of them (str.isdigit() takes "²", which
    int() refuses, as it refuses 5,000 digits); else None."""
    if value and value.isascii() and value.isdigit() and len(value) <= max_digits:
        return int(value)
    return None


def request_age(headers) -> float:
    """Seconds since the request reached the supervisor's public port (0 if it says none)."""
    age_ms = header_number(headers.get(AGE_HEADER), max_digits=9)
    return 0.0 if age_ms is None else min(age_ms, MAX_AGE_MS) / 1000


def handed_at(headers) -> Optional[float]:
    """When the supervisor handed the request off (``HANDED_AT_HEADER``); None if not said."""
    try:
        value = float(headers.get(HANDED_AT_HEADER) or "nan")
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def continued_from(headers, vocab_size: Optional[int]) -> Optional[list[int]]:
    """The token ids a continuation goes on after; None for a first run.

    Raises ValueError for a header that is not a list of the model's token
    ids: even the supervisor's word is checked, since an id outside the
    vocabulary would crash the engine (see guardian.admission.validation).
    """
    lines = headers.get_all(CONTINUE_HEADER)
    if not lines:
        return None
    value = ",".join(line for line in lines if line)
    try:
        tokens = [int(part) for part in value.split(",")] if value else []
    except ValueError:
        tokens = None
    limit = vocab_size if vocab_size is not None else float("inf")
    if tokens is None or len(tokens) > MAX_CONTINUED_TOKENS or not all(0 <= t < limit for t in tokens):
        raise ValueError(f"{CONTINUE_HEADER} is not a list of this model's token ids")
    return tokens


class TokenTaggingOutput:
    """The handler's output for a relayed stream: each text event tagged with its tokens.

    ``tap_tokens`` gives it every token stock's handler takes from the engine.
    A ``data:`` event that writes exactly the text of the tokens consumed
    since the last tag carries them. One that writes the beginning of that text
    is held (``_lagging``): 0.32 holds back text that may begin a stop string,
    mid-token ("atti" of "attic" for a stop of "cheese sandwich"), and writes it
    with a later token's; the held events go out with the one that catches up,
    under one tag, so a client never has text past the last tag. One that writes
    anything else (a tool call, reasoning) would leave a seam no continuation
    can match, so from then on the stream is marked not continuable
    (``: guardian-tokens -``).
    """

    def __init__(self, wfile, tagged_writer=None):
        self.wrapped = wfile
        # Given (a connection handed to the child, guardian.handoff): called with each
        # event's tag and the event itself, so the tag need not be stripped again.
        self._tagged_writer = tagged_writer
        self._tokens: list[int] = []
        self._text: list[str] = []
        self.continuable = True
        # Stock flushes after every event: straight to the wrapped file, no call of ours between.
        self.flush = wfile.flush
        self._tail: Optional[_HeldTail] = None  # from the last token on (``hold_to_the_end``)
        # Events held while the text they wrote lags behind their tokens' (``_lag``).
        self._lagging: list[bytes] = []
        self._lagging_text = ""

    def consumed(self, token: int, text: str) -> None:
        """One token taken, as ``tap_tokens`` adds each inline (tests and benches tell it so)."""
        self._tokens.append(token)
        if text:
            self._text.append(text)

    def write(self, data: bytes):
        """Write ``data``, tagged if it is a ``data:`` event: with the tokens consumed since
        the last tag if it writes exactly their text, else with the mark that the stream is
        not continuable. Called once per streamed token, so it does all of that itself,
        without calls of its own: in a supervised child, between engine steps, each call on
        this path costs far more than timed alone (bench/compare_trees.py;
        bench/results/relay-cost-handoff.md)."""
        if self.continuable and (self._tokens or self._text) and data.startswith(_DATA):
            texts, tag = self._text, None
            if texts:  # else it owes no text (a stop token's, discarded)
                text = texts[0] if len(texts) == 1 else "".join(texts)
                if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
                    escaped = text.encode()  # what json.dumps would write, without its cost
                else:
                    escaped = json.dumps(text)[1:-1].encode()
                # As stock's json.dumps writes the field: chat delta or text completion.
                if not self._lagging and (b'"content": "' + escaped + b'"' in data
                                          or b'"text": "' + escaped + b'"' in data):
                    texts.clear()
                else:
                    written, caught_up = self._lag(data, text)
                    if written is None:
                        return len(data)  # held, to go out with the event that catches up
                    data = written
                    if caught_up:
                        texts.clear()
                    else:
                        self.continuable = False
                        tag = TOKENS_COMMENT + NOT_CONTINUABLE + b"\n"
            if tag is None:
                tokens = self._tokens
                # One token an event, nearly always: its number alone, without join's list.
                named = str(tokens[0]) if len(tokens) == 1 else ",".join(map(str, tokens))
                tokens.clear()
                tag = TOKENS_COMMENT + named.encode() + b"\n"
            if self._tagged_writer is not None:
                self._tagged_writer(tag, data)
                return len(data)
            data = tag + data
        return self.wrapped.write(data)

    def _lag(self, data: bytes, owed: str) -> tuple[Optional[bytes], bool]:
        """An event that does not write all the text ``owed`` (its tokens' since the last
        tag), or one after events held: (what to write now, None when it is held too;
        whether the events written now catch up with ``owed``)."""
        event = event_text(data)
        written = self._lagging_text + event if event is not None else None
        if written is not None and event and written != owed and owed.startswith(written) \
                and len(self._lagging) < MAX_LAGGING_EVENTS:
            self._lagging.append(bytes(data))
            self._lagging_text = written
            return None, False
        out = b"".join(self._lagging) + data if self._lagging else data
        self._lagging, self._lagging_text = [], ""
        return out, written == owed

    def __getattr__(self, name):  # closed, ...
        return getattr(self.wrapped, name)

    def hold_to_the_end(self) -> None:
        """The engine gave the stream's last token: what follows up to ``[DONE]`` (that
        token's event, the finish chunk, usage) goes out in one write (``release``).

        A child that died between those writes left its client every token and no
        end, which no continuation can give (nothing is left to generate: an error
        event), or an end without the usage it asked for (dropped without a word). In
        one write, all or none of it reaches the client, or the journal (handed off)
        holds all of it for the supervisor to finish; none is a stream cut before its
        last token, continued as any other.
        """
        if self._tail is None:
            self._tail = _HeldTail(self)
            self.wrapped, self._tagged_writer, self.flush = self._tail, self._tail.tagged, _HeldTail.flush

    def release(self) -> None:
        """Write what ``hold_to_the_end`` held, in one write (at ``[DONE]``, or as the request ends)."""
        if self._lagging:  # the request ended after events held, with no event after them
            lagging, self._lagging, self._lagging_text = b"".join(self._lagging), [], ""
            self.continuable = False
            self._emit(TOKENS_COMMENT + NOT_CONTINUABLE + b"\n", lagging)
        tail = self._tail
        if tail is None:
            return
        self._tail = None
        self.wrapped, self._tagged_writer, self.flush = tail.wrapped, tail.tagged_writer, tail.wrapped.flush
        items = tail.items
        if not items:
            return
        if any(tag is not None for tag, _ in items[1:]):  # a tag past the first event: each its own write
            for tag, data in items:
                self._emit(tag, data)
        else:
            self._emit(items[0][0], b"".join(data for _, data in items))
        self.flush()

    def _emit(self, tag: Optional[bytes], data: bytes) -> None:
        if tag is None:
            self.wrapped.write(data)
        elif self._tagged_writer is not None:
            self._tagged_writer(tag, data)
        else:
            self.wrapped.write(tag + data)


# Events held at most while their text lags behind their tokens': a stop string's
# beginning is seldom long (past this, the stream is marked not continuable).
MAX_LAGGING_EVENTS = 64


def event_text(data: bytes) -> Optional[str]:
    """The text a stock ``data:`` event writes (a chat delta's content, a text completion's
    text; "" for none); None for anything else (a tool call, reasoning, an error, [DONE])."""
    try:
        event = json.loads(data[len(_DATA):])
        [choice] = event["choices"]
    except (ValueError, KeyError, TypeError):
        return None
    delta = choice.get("delta")
    if delta is None:
        text = choice.get("text")
        return text if isinstance(text, str) else None
    if set(delta) - {"role", "content"}:
        return None
    content = delta.get("content") or ""
    return content if isinstance(content, str) else None


class _HeldTail:
    """A stream's writes from its last token to its ``[DONE]``, each with its tag (or None)."""

    def __init__(self, output: TokenTaggingOutput):
        self.output = output
        self.wrapped, self.tagged_writer = output.wrapped, output._tagged_writer
        self.items: list[tuple[Optional[bytes], bytes]] = []

    def write(self, data) -> int:
        data = bytes(data)
        self.items.append((None, data))
        if ends_stream(data):
            self.output.release()
        return len(data)

    def tagged(self, tag: bytes, data: bytes) -> None:
        self.items.append((tag, bytes(data)))
        if ends_stream(data):
            self.output.release()

    @staticmethod
    def flush() -> None:
        """Nothing goes out until ``release``."""

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def tap_tokens(responses: Iterable, output: TokenTaggingOutput):
    """Stock's response iterator, telling ``output`` of each token as the handler takes it
    (``consumed``'s work, without a call per token), and of the last (``hold_to_the_end``)."""
    add_token, add_text = output._tokens.append, output._text.append
    for response in responses:
        add_token(response.token)
        if response.text:
            add_text(response.text)
        if response.finish_reason is not None:
            output.hold_to_the_end()
        yield response


# -- the supervisor's end -------------------------------------------------
# Methods whose requests carry a Content-Length even when empty.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# RFC 9110 §7.6.1: these describe one connection, never the message.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "proxy-connection", "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
SSE_CONTENT_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]"
# ``[DONE]`` as an event of its own: a line of its own (a token's text that says
# "data: [DONE]" is inside an event's JSON, escaped, and ends no stream).
_DONE_EVENT = re.compile(rb"(?:^|\n)data: \[DONE\]\r?(?:\n|$)")


def ends_stream(data: bytes) -> bool:
    """Whether ``data`` (whole SSE events) holds the stream's ``[DONE]`` event."""
    return SSE_DONE in data and _DONE_EVENT.search(data) is not None


# An "event" this long with no blank line is not SSE framing: pass it on.
MAX_HELD_EVENT_BYTES = 1 << 20


class EventRelay:
    """A child's SSE body as the client gets it: whole events only, a continuable
    stream's tags stripped (``stream``, a RelayedStream; None: passed as they are).

    A chunk is passed on up to its last complete event, so nothing waits on a
    well-formed stream, and a cut never leaves half an event glued to the
    error event that follows it. ``done``: ``[DONE]`` went out (a stream that
    ends without it was cut: both the guardian and stock always send it).
    """

    __slots__ = ("stream", "held", "done")

    def __init__(self, stream: Optional["RelayedStream"]):
        self.stream = stream
        self.held = b""
        self.done = False

    def pass_on(self, chunk: bytes) -> bytes:
        if self.held:
            chunk, self.held = self.held + chunk, b""
        if not chunk.endswith(b"\n\n"):
            end = last_event_end(chunk)
            if end == 0 and len(chunk) > MAX_HELD_EVENT_BYTES:
                end = len(chunk)
            chunk, self.held = chunk[:end], chunk[end:]
            if not chunk:
                return b""
        self.done = self.done or ends_stream(chunk)
        return self.stream.relay(chunk) if self.stream is not None else chunk


def last_event_end(data: bytes) -> int:
    """Offset just past the last complete SSE event in ``data``, or 0."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def continue_headers(key: str, tokens: list[int]) -> list[tuple[str, str]]:
    """The headers of a continuation after ``tokens``: the key, then the ids in lines of
    at most CONTINUE_LINE_BYTES (``continued_from`` joins them)."""
    headers, line, size = [(KEY_HEADER, key)], [], 0
    for text in map(str, tokens):
        if line and size + 1 + len(text) > CONTINUE_LINE_BYTES:
            headers.append((CONTINUE_HEADER, ",".join(line)))
            line, size = [], 0
        size += len(text) + (1 if line else 0)
        line.append(text)
    headers.append((CONTINUE_HEADER, ",".join(line)))  # none at all: an empty value
    return headers


def age_headers(age_s: float) -> list[tuple[str, str]]:
    """The headers that tell a child the request reached the public port ``age_s`` ago, as
    of now: the child counts the time the request then waits for it (``handed_at``)."""
    headers = [(AGE_HEADER, str(min(int(age_s * 1000), MAX_AGE_MS)))] if age_s > 0 else []
    headers.append((HANDED_AT_HEADER, f"{time.monotonic():.6f}"))
    return headers


class RelayedStream:
    """What the supervisor relayed of one stream: its tokens, identity and end.

    ``relay(block)`` takes whole SSE events from a child and returns what
    the client gets: tags stripped, and once the stream is continued on
    another child, each event made part of the first stream.
    """

    def __init__(self):
        # Each tag's ids as written ("12,873"), read only when asked (``tokens``):
        # a supervisor thread relays every event of every stream.
        self._tags: list[bytes] = []
        self.continuations = 0
        self.finished = False  # an event with a finish_reason went out
        self.continuable = True  # every text the client got is covered by tokens
        self._identity: Optional[dict] = None  # id and created of the first child's events
        self._tokens_at_continuation = 0  # the continuing child's prompt holds these

    @property
    def tokens(self) -> list[int]:
        """The ids of the tokens whose text the client has, in order."""
        tokens: list[int] = []
        for tag in self._tags:
            tokens.extend(map(int, tag.split(b",")))
        return tokens

    def relay(self, block: bytes) -> bytes:
        if block.startswith(TOKENS_COMMENT):
            end = block.find(b"\n")
            if end > 0 and block.find(_TAG_AFTER_LINE, end) < 0:  # one event, its tag first: the usual block
                self._take_tag(block[len(TOKENS_COMMENT):end])
                block = block[end + 1:]
            else:
                block = self._take_tags(block)
        elif _TAG_AFTER_LINE in block:
            block = self._take_tags(block)
        if self._identity is None:
            self._identity = _identity_of(block)
        elif self.continuations:
            block = self._as_first_stream(block)
        if _FINISHED in block:
            self.finished = True
        return block

    def continued(self) -> None:
        """The next events come from another child, after ``tokens``."""
        self.continuations += 1

    def _take_tags(self, block: bytes) -> bytes:
        """``block`` without its tag lines, their tokens taken. Looks only where
        a tag is (once per event, or none): this runs for every relayed event."""
        kept = []
        start = 0
        find = block.find
        at = find(TOKENS_COMMENT)
        while at >= 0:
            if at and block[at - 1] != _LF:  # inside a line, not a tag
                at = find(TOKENS_COMMENT, at + 1)
                continue
            end = find(b"\n", at)
            self._take_tag(block[at + len(TOKENS_COMMENT):end if end >= 0 else None])
            kept.append(block[start:at])
            if end < 0:  # the last line: it goes with the line break before it
                return b"".join(kept)[:-1]
            start = end + 1
            at = find(TOKENS_COMMENT, start)
        kept.append(block[start:])
        return b"".join(kept)

    def _take_tag(self, tag: bytes) -> None:
        """One tag's text: the ids its event carries, or ``-`` (not continuable)."""
        if tag.isdigit():  # one token, the usual tag
            self._tags.append(tag)
        elif tag == NOT_CONTINUABLE:
            self.continuable = False
        else:  # read now, so that ``tokens`` never fails
            self._tags.append(b",".join(b"%d" % int(part) for part in tag.split(b",")))

    def _as_first_stream(self, block: bytes) -> bytes:
        """The continuing child's events with the first child's id and created,
        and usage counting the tokens the first child(ren) generated."""
        events = []
        for event in block.split(b"\n\n"):
            if event.startswith(_DATA) and not event.startswith(b"data: [DONE]"):
                try:
                    payload = json.loads(event[len(_DATA):])
                except ValueError:
                    events.append(event)
                    continue
                if isinstance(payload, dict):
                    payload.update(self._identity or {})
                    usage = payload.get("usage")
                    if isinstance(usage, dict) and "prompt_tokens" in usage:
                        # The continuing child counted these as prompt.
                        carried = self._tokens_at_continuation
                        usage["prompt_tokens"] -= carried
                        usage["completion_tokens"] = usage.get("completion_tokens", 0) + carried
                        # Its prompt cache's hits were of that longer prompt: of the client's,
                        # at most all of it (it read 31 cached of 17).
                        details = usage.get("prompt_tokens_details")
                        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                            details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])
                event = _DATA + json.dumps(payload).encode()
            events.append(event)
        return b"\n\n".join(events)

    def continuation_tokens(self) -> list[int]:
        """The ids to continue after; remembers how many the continuing child's prompt holds."""
        tokens = self.tokens
        self._tokens_at_continuation = len(tokens)
        return tokens


def _identity_of(block: bytes) -> Optional[dict]:
    """``id`` and ``created`` of the first data event in ``block``, or None if it has none."""
    start = block.find(_DATA)
    if start < 0:
        return None
    end = block.find(b"\n", start)
    try:
        payload = json.loads(block[start + len(_DATA):end if end >= 0 else None])
    except ValueError:
        return None
    if not isinstance(payload, dict):
        return None
    return {key: payload[key] for key in ("id", "created") if key in payload}

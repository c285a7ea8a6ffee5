"""Structured logs: JSON lines on stderr, or console output for people.

Guardian events go through structlog; mlx_lm's own ``logging`` records go
through the same processors (``ProcessorFormatter.foreign_pre_chain``), so
every line has one shape whichever library wrote it. So do Python's
warnings (``logging.captureWarnings``) and libraries that print through a
handler of their own (transformers). Lines that repeat at INFO while
nothing happens (probes, the supervisor's health checks) are written at
DEBUG, so an idle server at INFO writes nothing; so are stock's own INFO
lines for each request (unless ``[guardian] stock_request_logs``), so a
request writes one line at INFO, its ``http_access``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import select
import sys
import threading
import time
from typing import Optional

import structlog

# Fields every line of this process carries, whichever thread logs it: a rank
# of an mlx.launch group says which one it is (``bind_process(rank=1)``).
# Contextvars would not do: threads started later do not inherit them.
_PROCESS_FIELDS: dict = {}


def bind_process(**fields) -> None:
    """Add ``fields`` to every log line of this process from now on."""
    _PROCESS_FIELDS.update(fields)


def add_process_fields(logger, method_name, event_dict):
    """The fields ``bind_process`` set (the group's ranks interleave on one stderr)."""
    for key, value in _PROCESS_FIELDS.items():
        event_dict.setdefault(key, value)
    return event_dict


# Shared by structlog events and stdlib records alike.
SHARED_PROCESSORS = [
    # Request ids bound by guardian.request_context reach every line of that thread.
    structlog.contextvars.merge_contextvars,
    add_process_fields,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


class DropRawRequestBodies(logging.Filter):
    """Stock logs a malformed request's raw body at ERROR; a client's input is
    neither the server's error nor something to copy into logs. The guardian
    logs the refusal itself (``request_rejected``, WARNING, without the body)."""

    RAW_BODY_PREFIXES = ("JSONDecodeError:", "Invalid Request Body:")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.RAW_BODY_PREFIXES))


# Libraries whose INFO lines repeat, once per request, what the guardian logs
# itself: httpx's "HTTP Request: GET http://127.0.0.1:.../readyz" for each
# health check the supervisor makes of its child (every interval_s).
ROUTINE_LIBRARY_LOGGERS = ("httpx",)

# A query's values, wherever a request's target is logged: a client may put a
# key there (?key=, ?api_key=), and no secret may reach a log. A target has no
# space in it: its query is everything from "?" to the next one, a quote or a
# fragment's "#" included. Names that look like names stay.
_QUERY = re.compile(r"\?([^ \t\r\n]+)")  # (not \S: it stops at a NBSP, which a target may hold)
_QUERY_NAME = re.compile(r"[\w.\-\[\]]{1,64}")
HIDDEN = "***"


def _hidden_query(match: re.Match) -> str:
    parts = (part.partition("=") for part in match.group(1).split("&"))
    return "?" + "&".join(f"{name}={HIDDEN}" if equals and _QUERY_NAME.fullmatch(name) else HIDDEN
                          for name, equals, _ in parts)


def without_query_values(text: str) -> str:
    """``text`` (an access line, a URL) with each query value replaced by ``HIDDEN``
    (a part that is no ``name=value``, whole)."""
    return _QUERY.sub(_hidden_query, text) if "?" in text else text


# What of a client's request line (a target of up to [http] max_header_bytes, 64 KiB)
# one log line keeps: a client must not write 64 KiB to the log with every request.
LOGGED_LINE_CHARS = 2000


def loggable_line(text: str) -> str:
    """A request line, a URL or a message quoting one, as logged: its query values
    hidden, and cut past ``LOGGED_LINE_CHARS`` (saying how long it was)."""
    text = without_query_values(text)
    if len(text) <= LOGGED_LINE_CHARS:
        return text
    return f"{text[:LOGGED_LINE_CHARS]}... ({len(text)} characters)"


class QueryValuesHidden(logging.Filter):
    """``ROUTINE_LIBRARY_LOGGERS``' lines (httpx's "HTTP Request: POST http://...?x=y")
    as ``loggable_line`` writes them: query values hidden, long URLs cut."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".", 1)[0] in ROUTINE_LIBRARY_LOGGERS:
            record.msg, record.args = loggable_line(record.getMessage()), None
        return True


# Stock logs through the root logger (``logging.info(...)``): for each chat
# completion two "Prompt Cache" tables of two lines each and two "Prompt
# processing progress" lines, six lines beside the guardian's one access
# line. Written at DEBUG unless ``[guardian] stock_request_logs`` keeps them;
# its warnings and errors keep their level either way.
STOCK_LOGGERS = ("root", "mlx_lm")


class _StockRequestLines:
    """Whether stock's INFO lines stay at INFO (``keep_stock_request_lines``)."""

    kept = False


def keep_stock_request_lines(keep: bool) -> None:
    """Write stock's per-request INFO lines at INFO (True) or DEBUG (False), from now on."""
    _StockRequestLines.kept = keep


class _ProbesRunning:
    """How many synthetic probes are generating now (see ``probe_running``)."""

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()

    def change(self, by: int) -> None:
        with self.lock:
            self.count += by


_probes = _ProbesRunning()


@contextlib.contextmanager
def probe_running():
    """Around a synthetic probe: libraries' INFO lines meanwhile are written at DEBUG.

    Stock writes four "Prompt Cache: ..." lines at INFO for every request its
    loop takes, a probe's too: four lines every probe_interval_s on an idle
    server. Users' requests keep them where ``stock_request_logs`` does. The watchdog
    probes only while no user's request is in flight, so what libraries log
    during a probe is the probe's (a request arriving during one would have
    its lines at DEBUG too: a probe takes milliseconds).
    """
    _probes.change(+1)
    try:
        yield
    finally:
        _probes.change(-1)


class RoutineLibraryLinesAtDebug(logging.Filter):
    """Writes at DEBUG the INFO lines of libraries that only repeat routine work:
    during a probe (``probe_running``), ``ROUTINE_LIBRARY_LOGGERS``' always, and
    stock's (``STOCK_LOGGERS``) unless they are kept. The guardian's own events
    keep the level they were logged at."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or record.name.startswith("guardian"):
            return True
        library = record.name.split(".", 1)[0]
        routine = library in ROUTINE_LIBRARY_LOGGERS or (
            library in STOCK_LOGGERS and not _StockRequestLines.kept)
        if not (routine or _probes.count):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def route_library_output_to_root() -> None:
    """Libraries that installed a handler of their own, writing plain text to
    stderr or stdout, log through the root handler instead: transformers'
    warning that a prompt is longer than the tokenizer's model_max_length was
    the one non-JSON line ("[transformers] Token indices sequence length ...").

    mlx_lm imports transformers before the flags are parsed, so its handler
    exists by the time logging is configured."""
    standard_streams = {sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__}
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):
            continue  # a placeholder for a logger not created yet
        own = [h for h in logger.handlers if type(h) is logging.StreamHandler and h.stream in standard_streams]
        if own:
            for handler in own:
                logger.removeHandler(handler)
            logger.propagate = True


class AtMostEvery:
    """A line that a flood could repeat thousands of times a second (every connection
    refused as the handlers are busy): logged at most once per ``interval_s``, saying
    how many were left out since. Its metric counts every one.

        left_out = self.busy_lines.due()
        if left_out is not None:
            log.warning("http_handlers_busy", ..., left_out=left_out)
    """

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._next_at = 0.0
        self._left_out = 0
        self._lock = threading.Lock()

    def due(self) -> Optional[int]:
        """None: leave this one out; else log it, with the count left out since the last."""
        now = time.monotonic()
        with self._lock:
            if now < self._next_at:
                self._left_out += 1
                return None
            self._next_at = now + self.interval_s
            left_out, self._left_out = self._left_out, 0
            return left_out


# What a stream that polls writable takes without waiting: a pipe's atomic write (4096 on
# Linux, 512 on macOS).
PIPE_BUF = getattr(select, "PIPE_BUF", 512)
# How long a reader that stopped in the middle of a line has to take the rest of it, before
# the line is cut (the handler's lock, which every thread that logs waits for, is held meanwhile).
LINE_WAIT_S = 1.0


class NeverBlockingStreamHandler(logging.StreamHandler):
    """A stream handler that drops a line rather than wait for a reader that does not read.

    Every thread logs: the HTTP threads, the engine's loop, the watchdog. Writing to a pipe
    or a terminal nobody reads (a terminal paused with Ctrl-S, an ``mlx.launch`` stopped
    with SIGSTOP, a log collector that hangs) blocks once its buffer is full, and with it
    every thread that logs: the whole server, /health included, hung until the reader came
    back (measured: rank 0 under a stopped launcher, 41 s after the stop). Before each line
    it asks the kernel whether the stream takes a write now (``poll``); when it does not,
    the line is dropped and counted, and the next line written says how many went
    (``log_lines_dropped``). A file, or a reader that keeps up, always takes it: the
    order of lines and their timing are as with a plain handler.

    "Takes a write" promises room for ``PIPE_BUF`` bytes, not for a whole line: a
    traceback of 20 KB into a pipe with 6 KB free blocked its thread, and every thread
    that logged behind it (found by a review). A line is therefore written a piece of
    at most ``PIPE_BUF`` bytes at a time, each once the stream takes it; a reader that
    stops mid-line gets ``LINE_WAIT_S`` to take the rest, then the line is cut there,
    counted as dropped, and the next line written begins on a line of its own.
    """

    def __init__(self, stream=None):
        super().__init__(stream)
        self.dropped = 0  # since the last line written (emit runs under the handler's lock)
        self.cut = False  # the last line was cut: the next begins with the newline it lacks
        try:
            self._fd: Optional[int] = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # no descriptor (a test's StringIO): never full
            self._fd = None

    def takes_a_write(self, wait_s: float = 0.0) -> bool:
        """Whether a write of ``PIPE_BUF`` bytes would not wait, now or within ``wait_s``
        (select, not poll: macOS's poll refuses ttys)."""
        if self._fd is None:
            return True
        try:
            return bool(select.select([], [self._fd], [], wait_s)[1])
        except (OSError, ValueError):
            return True

    def emit(self, record: logging.LogRecord) -> None:
        if not self.takes_a_write():
            self.dropped += 1
            return
        dropped, self.dropped = self.dropped, 0
        if dropped:
            # In a context of its own: the thread that writes it may be serving a request,
            # whose fields (request_id, ...) are no part of this line.
            contextvars.Context().run(self._emit_whole, self._dropped_record(dropped))
        self._emit_whole(record)

    def _emit_whole(self, record: logging.LogRecord) -> None:
        if self._fd is None:
            super().emit(record)
            return
        try:
            line = self.format(record) + self.terminator
            data = line.encode(getattr(self.stream, "encoding", None) or "utf-8", "backslashreplace")
            self.stream.flush()  # whatever another writer left in the stream's buffer goes first
            if self.cut:
                data = b"\n" + data
            self.cut = not self._write_in_pieces(data)
            if self.cut:
                self.dropped += 1
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def _write_in_pieces(self, data: bytes) -> bool:
        """Write ``data`` a piece the stream takes at a time; False: cut, its reader
        took none of the rest within ``LINE_WAIT_S`` of its last piece. (Counted from the
        line's start, a reader that kept up on a loaded machine had a 300 KB line cut: a
        clean clone's CI run.)"""
        view = memoryview(data)
        deadline = time.monotonic() + LINE_WAIT_S
        while view:
            try:
                written = os.write(self._fd, view[:PIPE_BUF])
            except BlockingIOError:  # a non-blocking descriptor that was full after all
                written = 0
            if written:
                view = view[written:]
                deadline = time.monotonic() + LINE_WAIT_S  # it reads: the wait starts again
            if view and not self.takes_a_write(max(0.0, deadline - time.monotonic())):
                return False
        return True

    @staticmethod
    def _dropped_record(count: int) -> logging.LogRecord:
        record = logging.LogRecord("guardian.logs", logging.WARNING, __file__, 0, "log_lines_dropped", None, None)
        record.lines = count
        record.why = ("the log's reader did not read (a paused terminal or collector): "
                      "lines were dropped, not waited for")
        return record


# structlog's processors, as configure_logging sets them.
STRUCTLOG_PROCESSORS: list = []


def configure_logging(log_format: str = "json", level: str = "INFO") -> None:
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if log_format == "console"
        else structlog.processors.JSONRenderer()
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            *SHARED_PROCESSORS,
            # stdlib messages are sentences; keep them as the event text.
            structlog.stdlib.ExtraAdder(),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # Tracebacks become one "exception" string field, not raw lines.
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = NeverBlockingStreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(DropRawRequestBodies())
    handler.addFilter(RoutineLibraryLinesAtDebug())
    handler.addFilter(QueryValuesHidden())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # warnings.warn(...) becomes a WARNING record of "py.warnings", not raw text.
    logging.captureWarnings(True)
    route_library_output_to_root()
    # One list, its items replaced: a logger cached on its first use (every module's
    # ``log``) keeps the list it was made with, so a second configuration (the command
    # line's, then the file's) or structlog.testing.capture_logs, which edits the list in
    # place, reaches it too.
    STRUCTLOG_PROCESSORS[:] = [
        # Drop events below the level before any work is done on them
        # (a debug line per request costs nothing at INFO).
        structlog.stdlib.filter_by_level,
        *SHARED_PROCESSORS,
        structlog.processors.StackInfoRenderer(),
        structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
    ]
    structlog.configure(
        processors=STRUCTLOG_PROCESSORS,
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def set_log_level(level: str) -> None:
    """Change the level of every logger that has none of its own, now (a live setting)."""
    logging.getLogger().setLevel(getattr(logging, level.upper(), logging.INFO))

"""Structured logs: JSON lines on stderr, or console output for people.

Guardian events go through structlog; mlx_lm's own ``logging`` records go
through the same processors (``ProcessorFormatter.foreign_pre_chain``), so
every line has one shape whichever library wrote it.
"""

from __future__ import annotations

import logging
import sys

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
    # Request ids bound by guardian.context reach every line of that thread.
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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(DropRawRequestBodies())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    structlog.configure(
        processors=[
            # Drop events below the level before any work is done on them
            # (a debug line per request costs nothing at INFO).
            structlog.stdlib.filter_by_level,
            *SHARED_PROCESSORS,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def set_log_level(level: str) -> None:
    """Change the level of every logger that has none of its own, now (a live setting)."""
    logging.getLogger().setLevel(getattr(logging, level.upper(), logging.INFO))

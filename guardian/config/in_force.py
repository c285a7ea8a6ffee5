"""Under ``--supervise``: the version of the file in force, kept for the next child.

A live edit that does not parse changes nothing: both processes keep the
version in force and say why (guardian.config.live). But the file on disk
is the broken one, and a child started after a crash would read it, refuse
to start (exit 2), and take the supervisor down with it: a typo saved once
would stop an unattended server at its next crash. So each child writes the
version it runs to a private file of its supervisor's (``IN_FORCE_ENV``),
at start and at every version it applies, and a child whose file does not
parse starts from that one, logs ``config_invalid_kept_in_force``, and
watches the real file as before: the next good save applies.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Optional

import structlog

from guardian.config.loading import GuardianConfig

log = structlog.get_logger("guardian.config")

# The private file (in a folder only the supervisor's user reads) a supervised child keeps its version in.
IN_FORCE_ENV = "MLX_GUARDIAN_CONFIG_IN_FORCE"


def kept_path() -> Optional[Path]:
    """Where this child keeps its version for the next one; None outside a supervisor."""
    value = os.environ.get(IN_FORCE_ENV)
    return Path(value) if value else None


def kept_version() -> Optional[Path]:
    """The version the last child ran, if one was kept."""
    path = kept_path()
    return path if path is not None and path.is_file() else None


def keep(config: GuardianConfig) -> None:
    """Write ``config``'s bytes (a version just put in force) for the next child, whole or not
    at all (two reloads may keep at once: each writes a file of its own, then renames it)."""
    path = kept_path()
    if path is None or config.raw is None:
        return
    try:
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(config.raw)
            os.replace(partial, path)
        except BaseException:
            os.unlink(partial)
            raise
    except OSError as e:  # the supervisor's folder gone (it is exiting), a full disk
        log.warning("config_in_force_not_kept", error_message=str(e))
        # An older version kept would be a next child's, silently: none is better (the file's read).
        with contextlib.suppress(OSError):
            path.unlink()

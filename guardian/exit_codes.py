"""Exit codes, named so supervisors and the docs agree on them.

``EXIT_CODES`` is the one table: docs/reference/exit-codes.md is written
from it (tools/docs_reference.py), and the supervisor logs a child's exit with
its ``reason``. Any non-zero code makes systemd's ``Restart=on-failure`` and
launchd's ``KeepAlive`` with ``SuccessfulExit=false`` start the process again.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NamedTuple

EXIT_OK = 0
# Python's own code for an uncaught exception, and the HTTP reader's crash: never on purpose.
EXIT_UNCAUGHT = 1
# Bad flags, an unusable --guardian-config, or an address it cannot listen on (argparse uses 2 as well).
EXIT_USAGE = 2
# The model could not be loaded at start.
EXIT_BOOT_ERROR = 3
# The engine kept failing: more failures in the window than allowed.
EXIT_ENGINE_FAILED = 4
# The engine stopped making progress and could not be replaced in-process.
EXIT_ENGINE_STALLED = 5
# Subprocess mode (--supervise): the child kept dying, more restarts within
# --supervisor-window than --supervisor-max-restarts allows.
EXIT_SUPERVISOR_GAVE_UP = 6
# A rank of an mlx.launch group failed, stalled or was lost: ranks cannot
# restart apart (the others would wait in a collective), so every rank exits
# and the group is started again as a whole.
EXIT_GROUP_FAILED = 7


class ExitCode(NamedTuple):
    code: int
    # Short: how the supervisor logs a child that exited with it.
    reason: str
    # The docs' row (markdown).
    meaning: str


EXIT_CODES = (
    ExitCode(EXIT_OK, "the child stopped (SIGTERM or SIGINT)",
             "stopped by SIGTERM or SIGINT, after requests in flight had up to `exit_grace_s`; "
             "a second one a second or more later stops without waiting (before it serves, while "
             "the model loads, the process ends by that signal instead, as stock's does; a service "
             "manager counts both as a clean stop)"),
    ExitCode(EXIT_UNCAUGHT, "uncaught Python error",
             "an uncaught Python error, or a crash of the HTTP reader that accepts and reads every "
             "request (`http_reader_crashed`; deaf, the process would stay up): a bug, never on purpose; "
             "a `--engine stock` child's, a thread of stock's server that died of an error (mlx-lm 0.31's "
             "generation thread: the incident), which ends it for the supervisor to replace"),
    ExitCode(EXIT_USAGE, "bad flags or configuration",
             "bad flags or configuration (the message names the key), a `demo-model` path it "
             "cannot write, flags that can never "
             "work with this model (`flags_invalid`), or a `--host`/`--port` it cannot listen on "
             "(`http_bind_failed`, `supervisor_bind_failed`: the port taken, a host with no such address)"),
    ExitCode(EXIT_BOOT_ERROR, "the model could not be loaded",
             "the model could not be loaded at start; under `--supervise`, by `[supervisor] boot_attempts` "
             "children in a row (2)"),
    ExitCode(EXIT_ENGINE_FAILED, "the engine kept failing",
             "the engine kept failing without progress: more than `recovery.max_failures` failures "
             "within `recovery.window_s` with no token generated or request completed between them"),
    ExitCode(EXIT_ENGINE_STALLED, "the engine stalled and could not be replaced in-process",
             "the engine stalled and could not be replaced in-process"),
    ExitCode(EXIT_SUPERVISOR_GAVE_UP, "the supervisor gave up",
             "subprocess mode: more than `--supervisor-max-restarts` restarts within `--supervisor-window`, "
             "or no child could be started (the system refused a port, a descriptor or a process, or the "
             "interpreter is gone: `child_start_failed`)"),
    ExitCode(EXIT_GROUP_FAILED, "a rank of the group failed, stalled or was lost",
             "under `mlx.launch`: a rank failed, stalled or was lost (died, stopped answering on the "
             "group's control connection), or did not join within `[watchdog] join_timeout_s` "
             "(`group_join_failed`); every rank of the group exits with it"),
)


def reason(code: int) -> str:
    """Why a process that exited with ``code`` stopped, in a few words."""
    return next((e.reason for e in EXIT_CODES if e.code == code), "unexpected exit")


def markdown_table() -> str:
    """The docs' exit-code table (docs/reference/exit-codes.md)."""
    rows = [f"| {e.code} | {e.meaning} |" for e in EXIT_CODES]
    return "\n".join(["| code | meaning |", "|---|---|", *rows]) + "\n"


# Where the ranks of a supervised mlx.launch group leave their exit codes (this, then
# ".rank" and the rank): the launcher exits 0 whatever its ranks did, and the supervisor
# acts on the code (3: the model cannot load).
GROUP_EXIT_CODE_ENV = "MLX_GUARDIAN_GROUP_EXIT_CODE_FILE"


def leave_for_supervisor(code: int) -> None:
    """As this process exits with ``code``: where it is a rank of a supervised group, write
    the code where the supervisor reads it. Every rank does: the first to fail may be any
    of them, and the launcher may kill the others before they can."""
    path = os.environ.get(GROUP_EXIT_CODE_ENV)
    if not path:
        return
    try:
        with open(f"{path}.rank{int(os.environ.get('MLX_RANK', '0'))}", "w") as f:
            f.write(str(code))
    except (OSError, ValueError):
        pass  # the supervisor then knows only that the group ended


def exit_now(code: int) -> None:
    """Exit at once with ``code``, answering nothing: the logs are flushed, no
    thread is waited for. For a supervised child that gives up (its supervisor
    sends what it held again to the next child) and a group's failing ranks."""
    leave_for_supervisor(code)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)

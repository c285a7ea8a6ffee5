"""Exit codes, named so supervisors and the README agree on them.

Any non-zero code makes systemd's ``Restart=on-failure`` and launchd's
``KeepAlive`` with ``SuccessfulExit=false`` start the process again.
"""

EXIT_OK = 0
# Bad flags or an unusable --guardian-config (argparse uses 2 as well).
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

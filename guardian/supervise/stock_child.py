"""A stock child's process (``--engine stock``): stock's own ``mlx_lm server``, unchanged,
that ends when one of its threads dies of an error.

Stock mlx-lm 0.31 runs its generation loop on a thread whose errors nothing catches: the
incident's ``[metal::malloc] Resource limit (499000) exceeded.``, raised in a step, ends
that thread and the process serves on, its ``/health`` 200, every completion waiting for
ever; a ``--model`` that cannot be loaded (stock loads it on that thread) likewise. The
supervisor saw neither. Here Python's hook for a thread's uncaught error prints it as
Python does, then ends the process, so the supervisor sees what it sees of any crash:
exit 3 (``EXIT_BOOT_ERROR``) when the thread died loading the ``--model`` weights (in
stock's ``ModelProvider.load_default``, named in guardian.stock.contract), which ends the
supervisor at ``boot_attempts``; exit 1 (``EXIT_UNCAUGHT``) otherwise, and the next child
serves the requests in flight, crash suspects now. From 0.32 stock catches the error
itself, logs it and answers ``/health`` 503, which the supervisor reads instead.

Imports no mlx_lm itself (the supervisor's package imports none: tests/test_layout.py);
it runs ``mlx_lm``'s ``__main__`` as ``python -m mlx_lm server`` does.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import traceback

from guardian.exit_codes import EXIT_BOOT_ERROR, EXIT_UNCAUGHT

# Stock's method that loads the --model weights on its generation thread, at its start.
LOADING_THE_MODEL = "load_default"


def exit_code_for(error_traceback) -> int:
    """The code a process whose thread died of this error ends with."""
    frames = {frame.name for frame in traceback.extract_tb(error_traceback)}
    return EXIT_BOOT_ERROR if LOADING_THE_MODEL in frames else EXIT_UNCAUGHT


def end_the_process(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook``: print the error as Python does, then end the process."""
    threading.__excepthook__(args)  # the traceback, on stderr, as before
    if args.exc_type is SystemExit:
        return  # a thread that asked to end, as Python's own hook takes it
    code = exit_code_for(args.exc_traceback)
    thread = args.thread.name if args.thread is not None else "a thread"
    print(f"mlx-guardian: {thread} of stock's server died of {args.exc_type.__name__}; "
          f"the process ends with code {code} for the supervisor to replace it", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: on a thread that would end the thread alone


def main() -> None:
    threading.excepthook = end_the_process
    sys.argv = ["mlx_lm", *sys.argv[1:]]
    runpy.run_module("mlx_lm", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

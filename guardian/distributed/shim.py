"""The shim a supervisor's child runs through: ``python -m guardian.distributed.shim -- COMMAND``.

It asks the kernel for SIGTERM when its parent (the supervisor) dies, then becomes
COMMAND: mlx.launch for a group, stock's server for a stock child, neither of which
asks for that itself (``guardian.distributed.launch.dying_with_parent``). mlx.launch
from this Python's environment runs here, in this process, without its busy waits.
A module of its own: the supervisor never imports it (it imports no mlx; this does,
in the launcher's process).
"""

from __future__ import annotations

import os
import select
import sys
from pathlib import Path

from guardian.distributed.launch import LAUNCHER


def exec_dying_with_parent(argv: list[str]) -> None:
    """Become ``argv`` with the kernel's promise of SIGTERM when the parent dies
    (Linux: PR_SET_PDEATHSIG survives exec); elsewhere plainly exec it. mlx.launch
    from this Python's environment runs here instead, without its busy waits."""
    from guardian.health.parent_watch import ask_for_sigterm_when_parent_dies

    ask_for_sigterm_when_parent_dies()
    if argv[0] == str(Path(sys.executable).with_name(LAUNCHER)):
        run_launcher_without_busy_waits(argv)
    os.execv(argv[0], argv)


def run_launcher_without_busy_waits(argv: list[str]) -> None:
    """mlx.launch's own ``main()``, in this process, without its two busy waits; returns
    only where this mlx's launcher is not the one it knows (then exec it as it is).

    Its main thread reads its standard input to pass on to the ranks, waiting 0.1 s at a
    time; a supervisor's child has /dev/null there, always readable (at its end), so it
    spun. Here its input is a pipe nobody writes to (this process keeps the other end).
    Its thread for each local rank asks, at every turn, for its rank's output or its
    rank's input pipe being writable, and an idle pipe always is: ~50,000 turns a second
    a rank. Here that thread waits for its rank's output (or its 1 s) and is then told
    what is writable at once. It writes only what came on the launcher's input, which
    here never brings anything. Measured, two ranks idle: 6.05 s of the launcher's CPU in
    5 s before, 0.01 s after (docs/deploy.md). The names are mlx's private ones
    (tests/test_stock_contract.py checks them)."""
    try:
        from mlx._distributed_utils import launch as mlx_launch
    except ImportError:
        return
    if getattr(mlx_launch, "select", None) is not select.select or not callable(getattr(mlx_launch, "main", None)):
        return

    def select_without_busy_wait(rlist, wlist, xlist, timeout=None):
        if not wlist:
            return select.select(rlist, wlist, xlist, timeout)
        readable, _, exceptional = select.select(rlist, [], xlist, timeout)
        return readable, select.select([], wlist, [], 0)[1], exceptional

    # The pipe's writing end is never closed, and this function never returns: the
    # launcher's input stays open with nothing in it for the process's life.
    read_end, _ = os.pipe()
    os.dup2(read_end, 0)
    os.close(read_end)
    mlx_launch.select = select_without_busy_wait
    sys.argv = [argv[0], *argv[1:]]
    raise SystemExit(mlx_launch.main())


if __name__ == "__main__":
    # python -m guardian.distributed.shim -- mlx.launch ARGS...
    exec_dying_with_parent(sys.argv[2:] if sys.argv[1:2] == ["--"] else sys.argv[1:])

"""The supervisor's side of a group: mlx.launch's command line, and its process group.

``mlx-guardian --supervise --launch-args "--backend ring -n 2"`` runs
``mlx.launch --backend ring -n 2 --python PYTHON -- -m guardian ...`` as its
child. The launcher leads a process group of its own, which holds every
local rank (it starts them through ``bash -c ... exec``): stopping the child
signals the whole group, and what is left of it after the launcher exits is
killed before the next group starts. The launcher itself runs under
``dying_with_parent`` below (guardian.distributed.shim), so it goes when the supervisor goes, and its
ranks with it (guardian.health.parent_watch). macOS makes no such promise
(no prctl): there each rank on the supervisor's machine also watches the
supervisor, and ends when it is gone, and the launcher with its ranks.
Imports no mlx.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

from guardian.exit_codes import EXIT_GROUP_FAILED, EXIT_OK

LAUNCHER = "mlx.launch"


def launcher() -> str:
    """mlx.launch from this Python's environment, else from PATH."""
    beside = Path(sys.executable).with_name(LAUNCHER)
    if beside.exists():
        return str(beside)
    found = shutil.which(LAUNCHER)
    if found is None:
        raise FileNotFoundError(f"{LAUNCHER} is neither beside {sys.executable} nor on PATH")
    return found


def group_command(launch_args: str, server_command: list[str]) -> list[str]:
    """The child's command: ``server_command`` (python -m ...) as the program of every rank.

    mlx.launch puts ``--python`` before the program on every host; given in
    ``launch_args`` (another path on remote hosts), it replaces this one's.
    """
    args = shlex.split(launch_args)
    python, program = server_command[0], server_command[1:]
    if not any(a == "--python" or a.startswith("--python=") for a in args):
        args += ["--python", python]
    return dying_with_parent([launcher(), *args, "--", *program])


def dying_with_parent(command: list[str]) -> list[str]:
    """``command``, run through ``guardian.distributed.shim``: for a program that asks for
    no parent-death signal itself (mlx.launch, stock's server)."""
    return [sys.executable, "-m", "guardian.distributed.shim", "--", *command]


class LauncherProcess(subprocess.Popen):
    """mlx.launch as the supervisor's child: a signal reaches every local rank.

    The launcher leads a new session and process group, which holds the
    ranks it starts on this machine (``bash -c ... exec``). SIGTERM and
    SIGINT go to the launcher's children, the ranks (or the ssh carrying a
    remote one): each stops as one process would, rank 0 draining its
    requests, and the launcher exits once they did. Any other signal
    (SIGKILL, SIGCONT) goes to the whole process group. SIGHUP is not sent:
    the launcher would die of it.
    """

    def __init__(self, args, *, exit_code_file: Optional[str] = None, temp_folder: Optional[str] = None, **kwargs):
        # Where the ranks leave their exit codes (guardian.exit_codes.leave_for_supervisor):
        # once the launcher has exited 0, ``returncode`` is the group's (``ranks_code``),
        # which the supervisor acts on as on one child's.
        self.exit_code_file = exit_code_file
        self.ranks_code: Optional[tuple[int, int]] = None  # (rank, its exit code)
        # Asked to stop (SIGTERM, SIGINT passed to the ranks): a group that ends with no
        # rank's code then ended as asked.
        self.stop_sent = False
        # The launcher exited 0, unasked, and no rank left a code: a rank crashed or was
        # killed before it could (``returncode`` is then EXIT_GROUP_FAILED, not the launcher's 0).
        self.codes_missing = False
        # The ranks' files are taken once, and removed (a group restarted for weeks leaves
        # none behind), by whichever thread sees the exit first: the main loop, a handler
        # and a metrics scrape all poll; the others wait here for the group's code.
        self.codes_taken = False
        self._taking = threading.Lock()
        # The group's TMPDIR, gone with the group (``own_temp_folder``); None: the inherited one.
        self.temp_folder = own_temp_folder(temp_folder) if temp_folder else None
        if self.temp_folder is not None:
            kwargs["env"] = {**(kwargs.get("env") or os.environ), "TMPDIR": self.temp_folder}
        try:
            super().__init__(args, start_new_session=True, **kwargs)
        except BaseException:
            self.remove_temp_folder()
            raise

    def remove_temp_folder(self) -> None:
        if self.temp_folder is not None:
            shutil.rmtree(self.temp_folder, ignore_errors=True)

    def poll(self):
        return self._as_the_groups(super().poll())

    def wait(self, timeout=None):
        return self._as_the_groups(super().wait(timeout))

    def _as_the_groups(self, code: Optional[int]) -> Optional[int]:
        if code is None or not self.exit_code_file:
            return code
        with self._taking:
            if self.codes_taken:
                return self.returncode  # Popen keeps it: the group's, as set below
            ranks_code = take_group_exit_code(self.exit_code_file)
            if code == 0 and ranks_code is not None:
                self.ranks_code = ranks_code
                self.returncode = ranks_code[1]
            elif code == 0 and not self.stop_sent:
                # mlx.launch exits 0 whatever its ranks did: a group that ended unasked with
                # no rank's word is a failure (it read as a clean stop, exit_0 in the metrics).
                self.codes_missing = True
                self.returncode = EXIT_GROUP_FAILED
            self.codes_taken = True
            return self.returncode

    def send_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            return
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.stop_sent = True
        ranks = children(self.pid) if signum in (signal.SIGTERM, signal.SIGINT) else []
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if ranks:
            return
        # Even after the launcher exited: what is left of its group goes too.
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def starts_its_ranks(launch_args: str) -> bool:
    """Whether mlx.launch starts the local ranks itself (ring, JACCL, NCCL: through its
    launch script, whose ``mktemp`` files ``own_temp_folder`` is for), not through mpirun.
    Open MPI keeps its session folder and Unix sockets in TMPDIR, and their paths have a
    length limit (104 bytes on macOS, whose TMPDIR is long already) that a folder deeper
    in it could pass: an MPI group keeps the TMPDIR it inherits. Its backend is
    ``--backend``'s, else its hostfile's ``"backend"``, as mlx.launch reads them."""
    backend = launch_flag(launch_args, "--backend")
    hostfile = launch_flag(launch_args, "--hostfile")
    if backend is None and hostfile is not None:
        try:
            named = json.loads(Path(hostfile).read_text())
        except (OSError, ValueError):
            named = None  # mlx.launch will say what is wrong with it
        if isinstance(named, dict) and isinstance(named.get("backend"), str):
            backend = named["backend"]
    return backend != "mpi"


def launch_flag(launch_args: str, flag: str) -> Optional[str]:
    """The value of ``flag`` in mlx.launch's flags (``--flag X`` or ``--flag=X``); None if not given."""
    args = shlex.split(launch_args)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
    return None


def own_temp_folder(path: str) -> Optional[str]:
    """``path``, made to be a group's TMPDIR; None where it cannot be made.

    mlx.launch writes each local rank's pid file and host file with ``mktemp`` and never
    removes them: four files left in TMPDIR each time a two-rank group starts, for as
    long as a supervisor replaces its groups. In a folder of the group's own they go
    with it (``LauncherProcess.remove_temp_folder``). mlx compiles its CPU (and CUDA)
    kernels into TMPDIR/mlx, once per machine; an empty one would cost every group start
    their compilation (a first generation 2.9 s against 0.03 s, on the demo model), so
    the folder's ``mlx`` is the shared one."""
    shared_kernels = Path(tempfile.gettempdir()) / "mlx"
    try:
        os.mkdir(path, 0o700)
    except OSError:
        return None
    try:
        shared_kernels.mkdir(exist_ok=True)
        (Path(path) / "mlx").symlink_to(shared_kernels, target_is_directory=True)
    except OSError:
        pass  # the kernels are compiled again, in the group's folder: slower, not wrong
    return path


def take_group_exit_code(path: str) -> Optional[tuple[int, int]]:
    """(rank, exit code) of the group: a rank's that failed of its own (3: its model would
    not load), before one that left because another failed (7), before a clean stop (0);
    among equals, the lowest rank's. None when no rank left one (killed, or on another host).
    The ranks' files are removed as they are read."""
    codes = {}
    for written in Path(path).parent.glob(Path(path).name + ".rank*"):
        try:
            codes[int(written.name.rpartition(".rank")[2])] = int(written.read_text().strip())
        except (OSError, ValueError):
            pass
        with contextlib.suppress(OSError):
            written.unlink()
    if not codes:
        return None
    return min(codes.items(), key=lambda item: (item[1] == EXIT_OK, item[1] == EXIT_GROUP_FAILED, item[0]))


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (pgrep: Linux and macOS alike; without
    it, none: the caller signals the whole process group instead)."""
    try:
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(line) for line in found.stdout.split()]


def kill_leftovers(proc: subprocess.Popen) -> None:
    """After a group's launcher exited: SIGKILL any rank left in its process
    group, before the next group starts (its memory, its ports), and remove the
    group's TMPDIR."""
    if isinstance(proc, LauncherProcess):
        proc.send_signal(signal.SIGKILL)
        proc.remove_temp_folder()

"""A server no MPI launcher started loads no MPI, so its crashes stay its own.

``mx.distributed.init()`` runs ``MPI_Init`` wherever an MPI library loads, and
Open MPI then installs handlers for SIGSEGV, SIGBUS, SIGFPE and SIGABRT. On the
lent CUDA machine (Open MPI installed) a supervised child sent SIGSEGV stayed
alive in that handler for minutes. Here, Debian's Open MPI (``make test``
installs openmpi-bin) and ``MLX_MPI_LIBNAME`` naming its library, as a user
with Homebrew's Open MPI sets it, make the same machine: stock's server takes
Open MPI's handlers, the guardian does not, and dies of a SIGSEGV at once.
"""

from __future__ import annotations

import ctypes.util
import os
import signal
import subprocess
import sys

import pytest

from conftest import Server, free_port, poll, spawn_guardian, system_tool
from guardian.demo_model import ensure_demo_model
from guardian.distributed.group import NO_MPI_LIBRARY, keep_mpi_out

pytestmark = [pytest.mark.one_version]

LIBMPI = ctypes.util.find_library("mpi")
MPIRUN, WITHOUT_MPIRUN = system_tool("mpirun", "make system-packages: apt-get install openmpi-bin, or brew install open-mpi")

def needs_open_mpi(test):
    """Open MPI installed, and /proc to read a process's signal handlers and libraries."""
    test = pytest.mark.skipif(LIBMPI is None or MPIRUN is None,
                              reason=WITHOUT_MPIRUN if MPIRUN is None else "Open MPI's libmpi is not installed")(test)
    return pytest.mark.linux("reads /proc/PID/status and /proc/PID/maps")(test)
SIGNALS_OPEN_MPI_CATCHES = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT)


def caught_signals(pid: int) -> set[int]:
    """The signals ``pid`` has handlers for (SigCgt of /proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {signum for signum in range(1, 65) if mask & (1 << (signum - 1))}
    raise AssertionError(f"no SigCgt for {pid}")


def loads_mpi(pid: int) -> bool:
    return any("libmpi" in line for line in open(f"/proc/{pid}/maps"))


@pytest.fixture
def with_open_mpi_named():
    """The environment of a user whose MLX_MPI_LIBNAME names Open MPI's library."""
    return {"MLX_MPI_LIBNAME": LIBMPI, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@needs_open_mpi
def test_stock_takes_open_mpis_crash_handlers(tmp_path, model_cache, with_open_mpi_named):
    """The hazard, on this machine: stock's server, started by no launcher, runs MPI_Init."""
    port = free_port()
    log_path = tmp_path / "stock.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", str(ensure_demo_model(model_cache)),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **with_open_mpi_named})
    stock = Server(proc, port, log_path)
    try:
        poll(lambda: stock.health() == 200, 60, interval=0.05, what="stock's /health")
        assert loads_mpi(proc.pid)
        assert set(SIGNALS_OPEN_MPI_CATCHES) <= caught_signals(proc.pid)
    finally:
        stock.stop()


@needs_open_mpi
def test_the_guardian_loads_no_mpi_and_dies_of_a_sigsegv(tmp_path, model_cache, with_open_mpi_named):
    port = free_port()
    log_path = tmp_path / "guardian.log"
    proc = spawn_guardian(["--port", str(port)], log_path, model_cache, env=with_open_mpi_named)
    guardian = Server(proc, port, log_path)
    try:
        guardian.wait_healthy()
        assert not loads_mpi(proc.pid)
        assert not set(SIGNALS_OPEN_MPI_CATCHES) & caught_signals(proc.pid)
        os.kill(proc.pid, signal.SIGSEGV)
        assert proc.wait(timeout=10) == -signal.SIGSEGV
    finally:
        guardian.stop()


def test_mpi_is_kept_out_only_where_no_mpi_launcher_started_the_process():
    alone = {"MLX_MPI_LIBNAME": "/opt/homebrew/lib/libmpi.dylib"}
    assert keep_mpi_out(alone) and alone["MLX_MPI_LIBNAME"] == NO_MPI_LIBRARY
    for launcher_variable in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"):
        launched = {launcher_variable: "2", "MLX_MPI_LIBNAME": "/opt/homebrew/lib/libmpi.dylib"}
        assert not keep_mpi_out(launched)
        assert launched["MLX_MPI_LIBNAME"] == "/opt/homebrew/lib/libmpi.dylib"
    # mlx.launch's ring backend: no MPI launcher, and ring needs no MPI.
    ring_rank = {"MLX_RANK": "1", "MLX_HOSTFILE": "/tmp/hosts.json"}
    assert keep_mpi_out(ring_rank) and ring_rank["MLX_HOSTFILE"] == "/tmp/hosts.json"

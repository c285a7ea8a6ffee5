"""Which rank of which ``mlx.launch`` group this process is."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import MutableMapping, Optional

# What MPI launchers give every process they start: Open MPI's mpirun (which
# ``mlx.launch --backend mpi`` runs), PMIx-based launchers, MPICH's hydra.
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")
# mlx dlopens the library MLX_MPI_LIBNAME names; this name loads nothing.
NO_MPI_LIBRARY = "mlx-guardian-no-mpi.so"


@dataclass(frozen=True)
class Group:
    """This process's place in an ``mx.distributed`` group of ``size`` ranks."""

    rank: int
    size: int

    @property
    def leader(self) -> bool:
        """Rank 0: the one that serves HTTP and feeds the others requests (as in stock)."""
        return self.rank == 0


def current_group() -> Optional[Group]:
    """The group ``mlx.launch`` started this process in, or None when it runs alone.

    ``mx.distributed.init()`` is what stock's ModelProvider calls as well: the
    same group (it is made once per process), so both agree on the ranks.
    """
    import mlx.core as mx

    keep_mpi_out()
    group = mx.distributed.init()
    if group.size() <= 1:
        return None
    return Group(rank=group.rank(), size=group.size())


def keep_mpi_out(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Keep mlx from loading MPI into a process that no MPI launcher started.

    ``mx.distributed.init()`` (stock's ModelProvider calls it too) runs
    ``MPI_Init`` whenever an MPI library can be loaded, launcher or not, and
    gets a group of one either way. On the way, Open MPI installs its own
    handlers for SIGSEGV, SIGBUS, SIGFPE and SIGABRT: on a CUDA machine a
    child sent SIGSEGV then stayed alive, its handler waiting on a lock, so
    the supervisor never saw it die. Where Open MPI's library is there
    without its launcher, ``MPI_Init`` aborts the process, and mlx aborts on
    MPICH's. So outside a launcher mlx is pointed at a library that does not
    exist (mlx reads MLX_MPI_LIBNAME when the first group is made), even
    over a user's MLX_MPI_LIBNAME, which only helps under mpirun. True if it
    was (nothing is logged: this runs before logging is set up). Ring, JACCL
    and NCCL groups (``mlx.launch``'s own) are untouched.
    """
    if any(name in environ for name in MPI_LAUNCHER_VARIABLES):
        return False
    environ["MLX_MPI_LIBNAME"] = NO_MPI_LIBRARY
    return True

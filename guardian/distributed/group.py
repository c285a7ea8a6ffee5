"""Which rank of which ``mlx.launch`` group this process is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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

    group = mx.distributed.init()
    if group.size() <= 1:
        return None
    return Group(rank=group.rank(), size=group.size())

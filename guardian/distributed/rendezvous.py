"""Tell every rank where rank 0's control connection listens, over ``mx.distributed``.

One collective, made by every rank at the same point of its start (before
the model loads, which makes its own): rank 0 contributes its address and a
token that only the group's members learn (its listener is on the network),
the others zeros, and the sum is both, as stock's ``_share_object`` sums a
pickled request. After this, nothing of the guardian's own goes over the
group's collectives: they belong to stock's loop, in its order.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Optional

# "host|port|token" fits with room to spare (an IPv6 address is at most 45 characters).
ADDRESS_BYTES = 256


def leader_host() -> str:
    """An address of rank 0's machine that the other ranks reach, from what
    the launcher told the backend: the ring's hostfile, JACCL's coordinator,
    NCCL's host; the host name otherwise (MPI)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            with open(hostfile) as f:
                first = json.load(f)[0]
            # The ring's hostfile: one list of "ip:port" per rank.
            return (first[0] if isinstance(first, list) else first).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError):
            pass  # not the ring's hostfile as we know it: the other backends' variables, below
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    if os.environ.get("NCCL_HOST_IP"):
        return os.environ["NCCL_HOST_IP"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # a Mac whose "Name.local" does not resolve: the ranks of one machine
        return "127.0.0.1"


def share_address(rank: int, address: Optional[tuple[str, int]],
                  token: Optional[str] = None) -> tuple[tuple[str, int], str]:
    """Rank 0 passes its (host, port) and its group's token; every rank gets both back."""
    import mlx.core as mx

    data = bytearray(ADDRESS_BYTES)
    if rank == 0:
        encoded = f"{address[0]}|{address[1]}|{token}".encode()
        data[: len(encoded)] = encoded
    summed = mx.distributed.all_sum(mx.array(list(data), dtype=mx.uint8), stream=mx.cpu)
    rest, _, token = bytes(summed.tolist()).rstrip(b"\0").decode().rpartition("|")
    host, _, port = rest.rpartition("|")
    return (host, int(port)), token

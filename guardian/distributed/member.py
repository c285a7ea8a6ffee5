"""This process as a rank of a group: joined, watched, and gone with the group.

``join`` (before the model loads, on every rank at the same point) registers
the group's failure policy, asks to die with the launcher, shares rank 0's
control address over ``mx.distributed`` and connects the control links. From
then on a lost rank (``ControlLinks``) makes this rank's engine give up, and
the process exits with code 7: rank 0 first answers every client 503 +
Retry-After, or, started by ``--supervise``, leaves them to the supervisor,
which sends them again to the next group. ``serve_follower`` is what a rank
other than 0 runs instead of the HTTP server.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Optional

import structlog

from guardian.distributed.control import JOIN_TIMEOUT_S, ControlLinks
from guardian.distributed.engine import GroupEngine, GroupPolicy
from guardian.distributed.group import Group
from guardian.health.parent_watch import (die_with_parent, die_with_process, is_ancestor, launcher_pid,
                                          supervisor_pid)
from guardian.distributed.rendezvous import leader_host, share_address
from guardian.exit_codes import EXIT_GROUP_FAILED, EXIT_OK, exit_now
from guardian.relay_protocol import started_by_supervisor


log = structlog.get_logger("guardian.group")

# Beats per peer timeout: a few lost to a busy interpreter are no loss.
BEATS_PER_TIMEOUT = 10


# A rank told the group failed ends within milliseconds; one still running
# after this long cannot (stopped, wedged).
STUCK_AFTER_S = 1.0


class GroupMember:
    """This rank's membership: its control links, its engine, how it leaves."""

    # The engine every rank of a group runs.
    engine_class = GroupEngine

    def __init__(self, group: Group, peer_timeout_s: float, on_exit, join_timeout_s: float = JOIN_TIMEOUT_S):
        self.group = group
        # The process's guardian.serving.exit_request.ExitRequest.
        self.on_exit = on_exit
        # Rank 0 said the group stops: a collective cut by its exit is no failure.
        self.stopping = False
        # A rank other than 0, signalled, asked rank 0 to stop the group (``ask_group_to_stop``).
        self.asked_to_stop = False
        # This rank gave up and told the others: their leaving is its own doing.
        self.failed = False
        # The first peer lost, and why ("rank 1 failed: ...").
        self._peer_lost = threading.Event()
        self._peer_lost_why: Optional[str] = None
        # Started by mlx-guardian --supervise, which sends again what a dead child
        # left unanswered (and continues its streams) on the next group.
        self.supervised = started_by_supervisor()
        self.engine: Optional[GroupEngine] = None
        self.links = ControlLinks(group.rank, group.size, beat_s=peer_timeout_s / BEATS_PER_TIMEOUT,
                                  peer_timeout_s=peer_timeout_s, on_lost=self._lost,
                                  on_stopping=self._stopping, join_timeout_s=join_timeout_s)

    def join(self, pm) -> None:
        """Every rank, before the model loads: policy, launcher watch, control links."""
        pm.register(GroupPolicy(), name=GroupPolicy.name)
        die_with_parent(lambda: self._lost(-1, "the launcher (this rank's parent) is gone"),
                        parent=launcher_pid())
        supervisor = supervisor_pid()
        if supervisor is not None and is_ancestor(supervisor):  # under --supervise, on its machine
            die_with_process(supervisor, lambda: self._lost(-1, "the supervisor is gone"))
        if self.group.leader:
            address, _ = share_address(0, self.links.listen(leader_host()), self.links.token)
            joined = self.links.accept_all
        else:
            address, token = share_address(self.group.rank, None)
            joined = functools.partial(self.links.connect, address, token)
        try:
            joined()
        except OSError as e:  # TimeoutError among them: a rank that cannot reach rank 0's address
            # The ranks that joined see this one's end close, and leave too.
            log.critical("group_join_failed", reason=str(e) or type(e).__name__,
                         control_address=f"{address[0]}:{address[1]}",
                         join_timeout_s=self.links.join_timeout_s, exit_code=EXIT_GROUP_FAILED)
            self.links.close()
            exit_now(EXIT_GROUP_FAILED)
        self.links.start_beats()
        log.info("group_joined", size=self.group.size, control_address=f"{address[0]}:{address[1]}",
                 peer_timeout_s=self.links.peer_timeout_s, pid=os.getpid())

    def watch(self, engine: GroupEngine) -> None:
        """From now on a lost rank makes ``engine`` give up (and this process exit)."""
        self.engine = engine
        engine.group_member = self

    def failing(self, reason: str) -> None:
        """This rank gives up: the others must not wait for it in a collective."""
        self.failed = True
        self.links.tell("failing", reason=reason)

    def exit_unanswered(self, reason: str, in_flight: int) -> None:
        """Under --supervise: exit at once, every request unanswered, as a child that
        crashed; the supervisor holds them and sends each again to the next group
        (a stream that had begun is continued there), so the group's clients see
        no failure. Alone under mlx.launch, rank 0 answers 503 + Retry-After instead."""
        log.critical("group_failed", reason=reason, exit_code=EXIT_GROUP_FAILED, in_flight=in_flight,
                     left_to="the supervisor, which sends them again to the next group")
        self.kill_stuck_ranks(STUCK_AFTER_S)
        exit_now(EXIT_GROUP_FAILED)

    def kill_stuck_ranks(self, wait_s: float) -> None:
        """Rank 0, as the group fails: SIGKILL the ranks on this machine that did not
        end within ``wait_s`` of being told (stopped, or wedged in native code with
        the interpreter held: SIGTERM's handler would never run). Their launcher
        waits for every rank, so one left would keep the group from ending."""
        if not self.group.leader:
            return
        for connection in self.links.stuck_local_peers(wait_s):
            log.error("rank_killed", killed_rank=connection.peer, pid=connection.peer_pid,
                      reason=f"still running {wait_s:g} s after the group failed")
            try:
                os.kill(connection.peer_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def ask_group_to_stop(self) -> None:
        """A rank other than 0, signalled: rank 0 drains its clients and then tells every rank to stop."""
        log.info("rank_signalled", asked="rank 0 to stop the group")
        self.asked_to_stop = True
        self.links.tell("stopping")

    def leave(self, exit_code: int) -> None:
        """At exit: a clean stop tells the others to stop too; then the links close."""
        if exit_code == EXIT_OK:
            # Its word: the others leave now, and their going (a connection closed before
            # these links are) is no loss.
            self.stopping = True
            self.links.tell("stopping")
        else:
            self.kill_stuck_ranks(STUCK_AFTER_S)
        self.links.close()

    def status(self) -> dict:
        """The group as this rank sees it (rank 0's ``/guardian/status``, ``group``)."""
        return {"rank": self.group.rank, "size": self.group.size,
                "peer_timeout_s": self.links.peer_timeout_s, "peers": self.links.status(),
                "stopping": self.stopping, "lost": self._peer_lost_why}

    def peer_lost(self, wait_s: float) -> Optional[str]:
        """Who was lost first and why, once a peer is lost (within ``wait_s``); else None."""
        return self._peer_lost_why if self._peer_lost.wait(wait_s) else None

    def _lost(self, rank: int, why: str) -> None:
        if rank >= 0 and not self._peer_lost.is_set():
            self._peer_lost_why = f"rank {rank} {why}"
            self._peer_lost.set()
        # The launcher gone while this rank stops already by a signal of its own (a service
        # manager's stop, or the launcher's death, signals every process at once): the
        # group drains as asked; only a rank's loss or failure ends that.
        stopping_by_signal = rank < 0 and (self.asked_to_stop or self.on_exit.code == EXIT_OK)
        if self.stopping or self.failed or stopping_by_signal:
            log.debug("group_rank_left", lost_rank=rank, reason=why)
            return
        who = "the launcher" if rank < 0 else f"rank {rank}"
        log.error("group_rank_lost", lost_rank=rank, reason=why)
        if self.engine is None:
            # Still loading, maybe inside a collective that never returns:
            # no client to answer yet, so nothing to wait for.
            exit_now(EXIT_GROUP_FAILED)
        # GroupEngine.give_up also fails the exit request with code 7.
        self.engine.give_up(f"{who} {why}" if rank >= 0 else why)

    def _stopping(self, rank: int) -> None:
        """Rank 0 stops the group (a rank other than 0 hears it leave), or a signalled rank
        asks rank 0 to (rank 0 hears it: it drains, then tells every rank)."""
        log.info("group_stopping", by_rank=rank)
        if rank == 0:  # its word: the others leaving now is no failure (a rank's ask is not)
            self.stopping = True
        self.on_exit(EXIT_OK)

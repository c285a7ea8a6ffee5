"""A rank's engine: stock's loop guarded, but never restarted alone.

Each rank runs stock's loop, and the loops meet in a collective at every
step and every look at the queue. A rank that restarted its loop by itself
would meet the others at a different collective (stock's loop begins with
one for the random seed): wrong sums or a wait for ever. So on a failure or
a stall the engine gives up (every request answered 503 + Retry-After), the
other ranks are told, and the whole group exits with code 7.
"""

from __future__ import annotations

import mlx.core as mx
import structlog

import guardian
from guardian.engine.generator import GuardianEngine
from guardian.engine.memory import EngineMemory
from guardian.exit_codes import EXIT_GROUP_FAILED
from guardian.config.registry import EXIT

log = structlog.get_logger("guardian.group")


# How mlx's distributed backends begin their errors.
COLLECTIVE_ERRORS = ("[ring]", "[jaccl]", "[nccl]", "[mpi]", "[distributed]")
# How long a rank whose collective broke waits for a peer's own report.
PEER_REPORT_WAIT_S = 1.0


class GroupMemory(EngineMemory):
    """A rank's engine memory: trims never touch the prompt cache."""

    _trim_refused = False

    def trim_prompt_cache(self, target_bytes: int, reason: str) -> None:
        """Only mlx's buffer cache, never prompt-cache entries: each rank looks a
        prompt up in its own prompt cache, and a hit on one rank with a miss on
        another would have them prefill different tokens between collectives.
        The ranks' caches stay identical only while every rank inserts and
        evicts the same entries, which a trim decided on one rank would break."""
        mx.clear_cache()
        if not self._trim_refused:
            self._trim_refused = True
            log.warning("prompt_cache_trim_skipped", reason=reason, target_bytes=target_bytes,
                        why="the ranks of a group must keep identical prompt caches")


class GroupEngine(GuardianEngine):
    """GuardianEngine for a rank of a group: failures and stalls end the group."""

    # The rank's membership (guardian.distributed.member), set once it watches this engine.
    group_member = None
    memory_class = GroupMemory
    # Waiting in a collective for a stuck rank, rank 0's threads used ~70 % of a core (the
    # ring backend, measured on the CPU): a stuck group looked like a long step computing.
    steps_wait_busily = True

    def status(self) -> dict:
        member = self.group_member
        return {**super().status(), **({"group": member.status()} if member is not None else {})}

    def give_up(self, reason: str, exit_code: int = EXIT_GROUP_FAILED, records=()) -> None:
        """Tell the other ranks first (they are waiting in a collective), then give up with code 7."""
        member = self.group_member
        error = self.failures.last_error  # set by a failure of this loop: the first is the last in a group
        first_give_up = self.generation_available()
        if error is not None and first_give_up:
            reason = f"the engine failed: {error['type']}: {error['message']}"
            if member is not None and error["message"].startswith(COLLECTIVE_ERRORS):
                # A collective broke: a peer that failed first says why on its
                # control link, which on a fast GPU arrives just after this.
                peer = member.peer_lost(PEER_REPORT_WAIT_S)
                if peer is not None:
                    reason = f"{peer} (here: {error['type']}: {error['message']})"
        if member is not None and first_give_up:
            member.failing(reason)
            if member.supervised:
                member.exit_unanswered(reason, in_flight=len(self.ledger.in_flight()) + len(records))
        super().give_up(reason, EXIT_GROUP_FAILED, records)
        if member is not None and not member.stopping:
            # Over a clean stop asked for meanwhile (mlx.launch's SIGTERM as a rank dies).
            member.on_exit.fail(EXIT_GROUP_FAILED)

    def judge_stall(self, rung: str, may_stay: bool = True) -> tuple[str, list, list]:
        """No rung but exit: a replacement loop would start at a collective the others are not in."""
        return EXIT, [], []

    def recover_from_stall(self, reason: str, action: str, decided: list) -> None:
        self.give_up(f"the engine stalled: {reason}")


class GroupPolicy:
    """Registered in a rank of a group only: every engine failure ends the group
    (the built-in recovery would restart this rank's loop alone)."""

    name = "group"

    @guardian.hookimpl(tryfirst=True)
    def on_engine_error(self):
        return EXIT

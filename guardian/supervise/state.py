"""What the supervisor is doing: its states, and which of them serve or hold requests."""

from __future__ import annotations


class State:
    """What the supervisor is doing; /guardian/supervisor reports it."""

    STARTING = "starting"  # the first child has not answered healthy yet
    READY = "ready"  # the child answers healthy: requests go to it
    UNHEALTHY = "unhealthy"  # checks fail, not yet for --supervisor-unhealthy-after
    RESTARTING = "restarting"  # a child is being stopped, or its successor is not ready yet
    STOPPING = "stopping"  # SIGTERM/SIGINT: the child is being stopped for good
    FAILED = "failed"  # gave up: crash loop, or flags the child refuses
    IDLE = "idle"  # no child, by [supervisor] idle_stop_s: the next request starts one


# Requests go to the child in these states; a briefly unhealthy child still
# knows best (a guardian child answers 503 itself while it recovers), unless its
# checks get no answer at all: then requests wait as while one starts
# (``Supervisor.holds``).
SERVING = (State.READY, State.UNHEALTHY)
# No child can take requests now, but one is coming: requests wait for it (bounded).
HOLDING = (State.STARTING, State.RESTARTING)
# What ``Supervisor.wait_for_child`` answers a request whose client has its [access]
# client_max_concurrent held already (the caller answers 429).
OVER_CLIENT_SHARE = "over_client_share"

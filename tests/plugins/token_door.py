"""A check_access plugin of an operator's: requests without ``X-Token: ok`` are refused.

It logs the names of the headers each of its hooks saw (``token_door_saw``): a supervised
child's plugins must not see the supervisor's relay key.
"""

from __future__ import annotations

import structlog

import guardian
from guardian import GuardianError

log = structlog.get_logger("tests.token_door")


class TokenDoor:
    name = "token_door"

    @guardian.hookimpl
    def check_access(self, request, door):
        log.info("token_door_saw", hook="check_access", headers=sorted(request.headers.keys()))
        if request.headers.get("X-Token") == "ok":
            return None  # the built-in door decides the rest
        from guardian.access.policy import AccessDecision

        return AccessDecision(request.client_address, GuardianError(
            "An X-Token is needed.", status=403, type="invalid_request_error", code="token_needed"))

    @guardian.hookimpl
    def on_access_decision(self, request, decision):
        log.info("token_door_saw", hook="on_access_decision", headers=sorted(request.headers.keys()))

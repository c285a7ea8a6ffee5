"""A check_access plugin of an operator's: requests without ``X-Token: ok`` are refused."""

from __future__ import annotations

import guardian
from guardian import GuardianError


class TokenDoor:
    name = "token_door"

    @guardian.hookimpl
    def check_access(self, request, door):
        if request.headers.get("X-Token") == "ok":
            return None  # the built-in door decides the rest
        from guardian.access.policy import AccessDecision

        return AccessDecision(request.client_address, GuardianError(
            "An X-Token is needed.", status=403, type="invalid_request_error", code="token_needed"))

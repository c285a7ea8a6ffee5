"""An admit_request hook with a bug: it returns a string where a GuardianError (or None) belongs."""

from __future__ import annotations

import guardian


class OddAdmission:
    name = "odd_admission"

    @guardian.hookimpl
    def admit_request(self, admission, engine, door):
        return "no thanks"

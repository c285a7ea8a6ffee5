"""Test plugins with the mistakes a plugin's author makes, each of which the guardian must
contain, naming the plugin: ``[guardian] plugins = ["tests.plugins.careless_plugins:Name"]``.

- ``TypoRecovery``: ``on_engine_error`` answers ``"restart "`` (a typo), and
  ``classify_engine_error`` raises.
- ``WrongDoor``: ``check_access`` answers a ``GuardianError`` (``admit_request``'s way)
  on ``/ge``, ``True`` on ``/true``; no opinion elsewhere.
"""

from __future__ import annotations

import guardian
from guardian.errors import GuardianError


class TypoRecovery:
    name = "typo_recovery"

    @guardian.hookimpl(tryfirst=True)
    def classify_engine_error(self, error):
        raise KeyError("a plugin's bug")

    @guardian.hookimpl(tryfirst=True)
    def on_engine_error(self, error, classification):
        return "restart "


class WrongDoor:
    name = "wrong_door"

    @guardian.hookimpl
    def check_access(self, request):
        if request.path == "/ge":
            return GuardianError("go away", status=401, code="invalid_api_key")
        if request.path == "/true":
            return True
        return None

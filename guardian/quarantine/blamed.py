"""Requests blamed for engine failures, refused at the door for a while.

A request that fails the engine when it runs alone is the cause of the
failure, and an identical request would fail it the same way: its
fingerprint is quarantined, and the recovery plugin's ``admit_request``
answers identical requests with a 500 before they reach the engine.

Identical means the same fingerprint: the prompt tokens and every field
of stock's GenerationArguments (model, sampling and logits parameters,
stop words, max_tokens, seed, logprobs...), as the request arrived at the
door, before a hook clamped ``max_tokens`` or dropped messages. Whether
the client streams is not part of it: it changes how tokens reach the
client, not what the engine computes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import structlog

from guardian.quarantine.table import Entry, ExpiringTable

log = structlog.get_logger("guardian.quarantine")


def request_fingerprint(prompt_tokens, args) -> str:
    """A hash of what a request asks the engine for (sha256, hex)."""
    digest = hashlib.sha256()
    digest.update(repr(_canonical(dataclasses.asdict(args))).encode())
    digest.update(b"\ntokens:")
    digest.update(",".join(map(str, prompt_tokens)).encode())
    return digest.hexdigest()


def _canonical(value):
    """Dicts as sorted item tuples, so key order does not change the hash."""
    if isinstance(value, dict):
        return tuple(sorted(((repr(k), _canonical(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    return value


class Quarantine(ExpiringTable):
    """The engine's table: fingerprints of requests blamed for an engine failure (any thread)."""

    def __init__(self, quarantine_s: float = 0.0):
        super().__init__(quarantine_s, log)

    def blame(self, fingerprint: str, *, request_id: str, reason: str) -> Optional[Entry]:
        """Refuse ``fingerprint`` for quarantine_s from now; None when switched off
        (blame still answers the request)."""
        return self.add(fingerprint, why=f"An identical request failed the engine on its own ({reason})",
                        shown={"blamed_request_id": request_id}, reason=reason)

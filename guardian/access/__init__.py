"""Who may come in: API keys, protected mode, origins and hosts, per-client limits, TLS.

Imports no mlx: the supervisor's public port runs the same door as the
server (``policy.AccessPolicy``). ``make_door`` builds one from the [access]
settings and the address the server listens on.
"""

from __future__ import annotations

import os
from typing import Optional

import structlog

from guardian.access.keys import KeyRing
from guardian.access.policy import AccessPolicy, Origins
from guardian.relay_protocol import RELAY_KEY_ENV


def make_door(settings, *, bound_host: str, allowed_origins: Optional[list[str]],
              supervised_child: bool = False, keys: Optional[KeyRing] = None) -> AccessPolicy:
    """The door of a server bound to ``bound_host``. ``settings``: the (live) [access]
    table; ``allowed_origins``: stock's --allowed-origins when given, else None;
    ``keys``: the key file as read at start (else read now). A supervised child's door
    lets in only its supervisor (the relay key)."""
    relay_key = os.environ.get(RELAY_KEY_ENV) if supervised_child else None
    if relay_key or keys is None:
        keys = KeyRing(None if relay_key else settings.api_key_file or None)
    return AccessPolicy(settings, keys, bound_host=bound_host, origins=Origins(allowed_origins),
                        relay_key=relay_key)


def announce(door: AccessPolicy, log=None) -> None:
    """Say how the door stands when that needs a person's attention: at start, and when
    a save changes [access] protected_mode or public_paths."""
    log = log or structlog.get_logger("guardian.access")
    generating = [path for path in door.settings.public_paths if path.rstrip("/").endswith("completions")]
    if generating and door.mode in ("api_keys", "protected"):  # open and loopback serve it all anyway
        log.warning("access_public_completions", paths=generating,
                    why="[access] public_paths lists a path that generates: anyone who can reach this "
                        "port may use the model on it without a key, from any address")
    if door.origins.any and door.mode not in ("api_keys", "supervised_child"):
        log.warning("access_any_origin", bound_host=door.bound_host,
                    why="--allowed-origins '*' with no API key: any web page the user's browser opens "
                        "may use the model here and read its answers")
    if door.mode == "open":
        log.warning("access_open", bound_host=door.bound_host,
                    why="bound beyond loopback with no API key and [access] protected_mode = false: "
                        "anyone who can reach this address may use the model")
    elif door.mode == "protected":
        log.info("access_protected_mode", bound_host=door.bound_host,
                 why="bound beyond loopback with no API key: only clients on this machine are served; "
                     "give --api-key-file, or set [access] protected_mode = false")

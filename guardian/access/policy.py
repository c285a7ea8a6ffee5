"""Who may come in: one decision per HTTP request, before it is routed.

The same code decides at every door: the one-process server (through the
built-in ``access`` plugin's ``check_access`` hook), the supervisor's public
port, and rank 0 of an mlx.launch group. It imports no mlx.

In order, a request is refused when:

1. its ``Host`` is not a name this server answers to (403 ``host_not_allowed``):
   a web page cannot reach the server through a DNS name it controls (DNS
   rebinding, CVE-2024-28224 in Ollama);
2. it comes from a web page of an origin not allowed (403
   ``origin_not_allowed``): without an explicit ``--allowed-origins``, only
   pages on this machine (``http://localhost:*`` and the like) and local apps
   (``app://``, ``tauri://``, ``vscode-webview://``);
3. its path is not public and keys exist, and it presents none of them
   (401 ``invalid_api_key``);
4. there are no keys, the server listens beyond loopback, protected mode is
   on, and the client is not on loopback (403 ``protected_mode``).

A supervised child (started with the supervisor's relay key) serves only
requests that carry that key: the supervisor decided at the public door, and
tells the child who the client is.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import sys
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

from guardian.access.keys import KeyRing, presented_key
from guardian.access.limits import ClientLimits
from guardian.errors import GuardianError
from guardian.relay_protocol import relayed_by_supervisor

# Names a client's Host or Origin uses for this machine (RFC 6761: *.localhost too). A server
# bound to one is loopback only where it resolves there (``bound_to_loopback``).
LOOPBACK_NAMES = ("localhost", "localhost.localdomain")
# Origins of apps on this machine that are no web page (Ollama's defaults): an Electron
# app (``app://obsidian.md``), a Tauri app, a VS Code webview. No web page can send them;
# granting them trusts what is installed here, as a local process is trusted already.
APP_ORIGIN_SCHEMES = ("app", "tauri", "vscode-webview", "vscode-file", "capacitor")
# An Electron app's page loaded from a file says ``file://`` (a browser's says "null").
# An authority as a Host header or an Origin carries one (lower-cased): a name or an IPv4
# address, or an IPv6 address in brackets; then perhaps a port. urlsplit alone reads
# ``[::1]evil.example`` as ::1 and ``localhost:3000?x`` as localhost.
AUTHORITY = re.compile(r"(?:\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(?::[0-9]{1,5})?")
# The supervisor tells its child who the client is; only a request with the
# relay key may say so.
CLIENT_HEADER = "X-Guardian-Client"
# And the name of the API key the client gave (its per-key counts, its access line).
KEY_NAME_HEADER = "X-Guardian-Key-Name"
# Refusals, by code: the metric's reason label, and the log's.
HOST_NOT_ALLOWED = "host_not_allowed"
ORIGIN_NOT_ALLOWED = "origin_not_allowed"
INVALID_API_KEY = "invalid_api_key"
PROTECTED_MODE = "protected_mode"
NOT_FROM_SUPERVISOR = "not_from_supervisor"
REFUSALS = (INVALID_API_KEY, PROTECTED_MODE, HOST_NOT_ALLOWED, ORIGIN_NOT_ALLOWED, NOT_FROM_SUPERVISOR)


@dataclass
class AccessRequest:
    """What the door sees of a request: ``check_access``'s argument."""

    method: str
    path: str  # without the query string
    headers: object  # email.message.Message, as http.server parses them
    client_address: str  # the peer's IP address
    # Set by the decision: who the client is (a key's name, or its address).
    client: Optional[str] = None
    # A supervised child's request whose relay key the door checked before the plugins'
    # turn; the headers they see no longer hold it (guardian.serving.handler.for_plugins).
    relay_key_checked: bool = False


@dataclass
class AccessDecision:
    """Let in as ``client``, or refused with ``error``."""

    client: str
    error: Optional[GuardianError] = None
    # Which key let it in (None: no key needed or none configured).
    key_name: Optional[str] = None
    fields: dict = field(default_factory=dict)

    @property
    def allowed(self) -> bool:
        return self.error is None


# Pure functions of what a request says, asked for every request: cached (bounded).
@functools.lru_cache(maxsize=1024)
def is_loopback_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def host_name_of(host_header: str) -> Optional[str]:
    """The name in a Host header, without its port; None when it is not one."""
    value = host_header.strip().lower()
    if not AUTHORITY.fullmatch(value):
        return None
    try:
        parts = urlsplit("//" + value)
        parts.port  # raises for a port out of range
    except ValueError:
        return None
    name = parts.hostname
    # A fully qualified name's final dot (``localhost.``) names the same host.
    return name[:-1] if name and name.endswith(".") and len(name) > 1 else name


# An Origin as a refusal's message quotes it: a scheme and an authority, or "null".
PLAIN_ORIGIN = re.compile(r"null|[a-z][a-z0-9+.-]{0,30}://(?:" + AUTHORITY.pattern + ")?")


def shown_origin(origin: str) -> str:
    """``origin`` as a logged message quotes it: whole where it is one, else by its size only
    (a value with a user and password in it, ``http://user:pw@x``, is no origin)."""
    value = origin.strip().lower()
    return repr(value[:100]) if PLAIN_ORIGIN.fullmatch(value) else f"of {len(origin)} characters"


def is_loopback_name(name: str) -> bool:
    """A Host's or an Origin's name for this machine. The unspecified address too
    (``0.0.0.0``, ``[::]``): a client's connect() takes it for this machine (a tutorial's
    ``http://0.0.0.0:8080``), and no page of another origin is same-origin with it, so it
    rebinds nothing. (Binding to it is no loopback: ``bound_to_loopback``.)"""
    return (name in LOOPBACK_NAMES or name.endswith(".localhost") or is_loopback_address(name)
            or is_unspecified_address(name))


@functools.lru_cache(maxsize=1024)
def is_unspecified_address(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False


def bound_to_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` can be reached only from this machine."""
    if is_ip_literal(host):
        return is_loopback_address(host)
    # A name, ``localhost`` too: loopback only when every address it resolves to is. Binding
    # resolves it the same way, and a hosts file may map ``localhost`` to a LAN address.
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(is_loopback_address(a) for a in addresses)


def machine_names() -> set[str]:
    """The names other machines may use for this one: its host name, and NAME.local (Bonjour)."""
    names = set()
    # The fully qualified name is a reverse lookup, which on a Mac whose name no DNS knows
    # waits seconds at every start; a Mac's host name is its Bonjour name already.
    fqdn = socket.getfqdn() if sys.platform != "darwin" else ""
    for name in (socket.gethostname(), fqdn):
        name = name.lower().rstrip(".")
        if name:
            names |= {name, name.split(".")[0], name.split(".")[0] + ".local"}
    return names


class Origins:
    """Which web pages' origins may use the server (CORS, and the Origin check)."""

    # Without --allowed-origins: pages served from this machine, on any port, by http or
    # https (``allows``), said as the http ones; and the apps of ``APP_ORIGIN_SCHEMES``.
    DEFAULT = ("http://localhost:*, http://127.0.0.1:*, http://[::1]:*, http://0.0.0.0:*, "
               + ", ".join(f"{scheme}://*" for scheme in APP_ORIGIN_SCHEMES) + ", file://")

    def __init__(self, explicit: Optional[list[str]]):
        # Stock's --allowed-origins, when given; None: pages on this machine only.
        self.explicit = None if explicit is None else [o.strip() for o in explicit if o.strip()]

    @property
    def any(self) -> bool:
        return self.explicit is not None and "*" in self.explicit

    def allows(self, origin: str) -> bool:
        if self.explicit is not None:
            return "*" in self.explicit or origin in self.explicit
        value = origin.strip().lower()
        scheme, separator, authority = value.partition("://")
        if not separator:
            return False  # an Origin is scheme://host[:port], no more (RFC 6454)
        if scheme == "file":
            return not authority
        name = host_name_of(authority)
        if scheme in APP_ORIGIN_SCHEMES:
            return name is not None
        return scheme in ("http", "https") and name is not None and is_loopback_name(name)

    def describe(self) -> str:
        if self.explicit is None:
            return f"{self.DEFAULT} (the default)"
        return ", ".join(self.explicit) or "none"


# What a page let in may read of an answer's headers beyond the few a browser shows it
# (Content-Type...): a 429's or 503's Retry-After, x-should-retry (the openai SDK retries by
# it), X-Request-ID (to report an answer by), the prompt guard's. "*" for every other,
# where the request carries no credentials a browser adds itself (a page's Authorization
# header is none of those); the names where it does.
EXPOSED_HEADERS = ("*, Retry-After, x-should-retry, X-Request-ID, X-Guardian-Clamped-Max-Tokens, "
                   "X-Guardian-Truncated-Messages")


class AccessPolicy:
    """The door's decision for each request. ``settings``: the live [access] table."""

    def __init__(self, settings, keys: KeyRing, *, bound_host: str, origins: Origins,
                 relay_key: Optional[str] = None):
        self.settings = settings
        self.keys = keys
        self.bound_host = bound_host
        self.loopback_only = bound_to_loopback(bound_host)
        self.origins = origins
        # A supervised child: only the supervisor (who holds this key) may come in.
        self.relay_key = relay_key
        self._machine_names = machine_names()
        # Per-client limits, applied at admission (the access plugin's admit_request).
        self.limits = ClientLimits(settings)

    def use_settings(self, settings) -> None:
        """Put a new [access] table in force (the supervisor's reload; one process reads a live view)."""
        self.settings = self.limits.settings = settings

    @property
    def mode(self) -> str:
        """How the door is closed, for the start-up log and /guardian/status."""
        if self.relay_key is not None:
            return "supervised_child"
        if self.keys.configured:
            return "api_keys"
        if self.loopback_only:
            return "loopback"
        return "protected" if self.settings.protected_mode else "open"

    def check(self, request: AccessRequest) -> AccessDecision:
        if self.relay_key is not None:
            return self.check_relayed(request)
        address = request.client_address
        error = (self.check_host(request.headers.get("Host"), address)
                 or self.check_origin(request.headers.get("Origin")))
        if error is not None:
            return AccessDecision(address, error)
        public = request.path in self.settings.public_paths or request.method == "OPTIONS"
        if self.keys.configured:
            key, problem = presented_key(request.headers)
            name = self.keys.identify(key) if key is not None else None
            if name is not None:
                return AccessDecision(name, key_name=name)
            if public:
                return AccessDecision(address)
            return AccessDecision(address, invalid_api_key(problem if key is None else None))
        if public or self.loopback_only or not self.settings.protected_mode or is_loopback_address(address):
            return AccessDecision(address)
        return AccessDecision(address, protected_mode_error(self.bound_host))

    def decided_by_relay_key(self, request: AccessRequest) -> Optional[AccessDecision]:
        """A supervised child's decision before any plugin's: a request the supervisor did
        not send refused (a plugin's check_access let local processes past the relay key),
        and the supervisor's own (its health checks, naming no client) let in (a plugin
        refused them: the child was never ready). None: a client's request the supervisor
        relayed, or no supervisor: the check_access hooks decide."""
        if self.relay_key is None:
            return None
        decision = self.check_relayed(request)
        if not decision.allowed or request.headers.get(CLIENT_HEADER) is None:
            return decision
        return None

    def check_relayed(self, request: AccessRequest) -> AccessDecision:
        """A supervised child: the relay key, then the client the supervisor names.
        Health checks stay open to anyone on this machine, as at the public port."""
        relayed = request.relay_key_checked or relayed_by_supervisor(request.headers)
        if request.path in self.settings.public_paths and not relayed:
            return AccessDecision(request.client_address)
        if not relayed:
            return AccessDecision(request.client_address, GuardianError(
                "This server is a supervised child: send requests to the supervisor's port.",
                status=403, type="invalid_request_error", code=NOT_FROM_SUPERVISOR, retry=False))
        return AccessDecision(request.headers.get(CLIENT_HEADER) or request.client_address,
                              key_name=request.headers.get(KEY_NAME_HEADER) or None)

    def check_host(self, host_header: Optional[str], client_address: str = "") -> Optional[GuardianError]:
        if host_header is None:
            return None  # HTTP/1.0 without Host: no browser sends that
        name = host_name_of(host_header)
        if name is not None and self.host_allowed(name, client_address):
            return None
        # Quoted only where it is a name (and a port): the message is logged, and what is
        # not a name may be anything, a user and password included (Host: user:pw@x).
        shown = repr(host_header[:100]) if name is not None else f"of {len(host_header)} characters"
        return GuardianError(
            f"The Host header {shown} is not a name this server answers to. "
            "Add it to [access] allowed_hosts in --guardian-config.",
            status=403, type="invalid_request_error", code=HOST_NOT_ALLOWED, retry=False)

    def host_allowed(self, name: str, client_address: str = "") -> bool:
        """Loopback names, the names ``allowed_hosts`` lists (a proxy in front of a server
        bound to loopback forwards its clients' Host; ``host.docker.internal`` for a web UI
        in a container), and, bound beyond loopback, addresses and this machine's own names.
        Bound to loopback, this machine's names are not taken: what they resolve to, a
        search domain's resolver, mDNS (``NAME.local``) or a DHCP-given one (a
        ``.internal`` name) can answer for, and so rebind to 127.0.0.1 (a review showed a
        page's reads of /v1/models and /metrics let through). Nor in protected mode from
        a loopback client, for the same reason: it serves this machine's own clients
        whole, and a page whose name is rebound to 127.0.0.1 is one (they have loopback
        names); other machines' health checks may name it (their public paths)."""
        if is_loopback_name(name):
            return True
        for allowed in self.settings.allowed_hosts:
            allowed = allowed.lower()
            if allowed == "*" or name == allowed or (
                    allowed.startswith(".") and (name.endswith(allowed) or name == allowed[1:])):
                return True
        if self.loopback_only:
            return False
        if is_ip_literal(name):
            return True
        return name in self._machine_names and not (self.mode == "protected" and is_loopback_address(client_address))

    def check_origin(self, origin: Optional[str]) -> Optional[GuardianError]:
        # "null": a sandboxed frame or a file:// page; refused unless "*" was asked for.
        if origin is None or self.origins.allows(origin):
            return None
        return GuardianError(
            f"Requests from web pages of origin {shown_origin(origin)} are not allowed. Start the server "
            "with --allowed-origins listing it to let that page in.",
            status=403, type="invalid_request_error", code=ORIGIN_NOT_ALLOWED, retry=False)

    def cors_origin(self, origin: Optional[str]) -> Optional[str]:
        """The Access-Control-Allow-Origin value for a request's Origin, or None: no grant."""
        if self.origins.any:
            return "*"
        if origin is not None and self.origins.allows(origin):
            return origin
        return None

    def cors_headers(self, origin: Optional[str]) -> dict:
        """Every answer's CORS headers, whoever writes it (stock's handler, or the
        supervisor): the grant for ``origin``, and stock's other two, plus Authorization,
        which a browser never covers by "*". A page let in reads the answer, a refusal or
        an error of the server's too."""
        headers = {}
        granted = self.cors_origin(origin)
        if granted is not None:
            headers["Access-Control-Allow-Origin"] = granted
            if granted != "*":
                headers["Vary"] = "Origin"
            headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        headers["Access-Control-Allow-Methods"] = "*"
        headers["Access-Control-Allow-Headers"] = "*, Authorization"
        return headers

    def status(self) -> dict:
        return {"mode": self.mode, "bound_host": self.bound_host, "allowed_origins": self.origins.describe(),
                "public_paths": list(self.settings.public_paths), **self.keys.status(),
                "clients": self.limits.status()}


def invalid_api_key(problem: Optional[str]) -> GuardianError:
    """401 as OpenAI answers it; the openai SDK raises AuthenticationError and does not retry."""
    message = problem or "Incorrect or missing API key. Send it as 'Authorization: Bearer <API key>'."
    return GuardianError(message, status=401, type="invalid_request_error", code=INVALID_API_KEY,
                         retry=False, headers={"WWW-Authenticate": "Bearer"})


def protected_mode_error(bound_host: str) -> GuardianError:
    """Redis's answer to the same problem: say exactly how to open the door."""
    return GuardianError(
        f"mlx-guardian is in protected mode: it listens on {bound_host}, beyond this machine, and no API "
        "key is configured, so only clients on this machine are served. To serve this client, either "
        "1) give the server API keys: --api-key-file FILE (or [access] api_key_file), one key a line, "
        "and send one as 'Authorization: Bearer <key>'; or 2) on a network you trust, turn protected "
        "mode off: [access] protected_mode = false in --guardian-config; or 3) bind to 127.0.0.1 and "
        "put a proxy that checks clients in front (its public name in [access] allowed_hosts).",
        status=403, type="invalid_request_error", code=PROTECTED_MODE, retry=False)

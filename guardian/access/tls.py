"""TLS at the door: ``--ssl-certfile`` / ``--ssl-keyfile`` (vLLM's names), read again on SIGHUP.

Imports no mlx: the one-process server and the supervisor's public port
serve HTTPS the same way, through the connection layer (guardian.connection),
whose reader runs each handshake non-blocking beside every other
connection's reads, under the same deadlines: a slow or silent client holds
up no one. A new connection takes the newest context: a reload swaps one
attribute, and connections already open keep the one they began with.
"""

from __future__ import annotations

import json
import socket
import ssl
from typing import Optional

import structlog

from guardian.config import ConfigError
from guardian.connection import linger_close
from guardian.errors import GuardianError

log = structlog.get_logger("guardian.access")

# A TLS connection's first byte: a handshake record (RFC 8446 §5.1). A plain
# HTTP request starts with a method's letters.
TLS_HANDSHAKE_RECORD = b"\x16"
# What a client that sent plain HTTP to the TLS port gets, as nginx answers it.
PLAIN_HTTP_TO_TLS_PORT = GuardianError(
    "This port serves HTTPS: send the request to https:// instead of http://.",
    status=400, type="invalid_request_error", code="https_required")


class ServerCertificate:
    """The server's certificate and key, as the SSL context new connections use."""

    def __init__(self, certfile: str, keyfile: str = ""):
        self.certfile = certfile
        self.keyfile = keyfile or None  # None: the key is in certfile
        self.context = self.load()

    def load(self) -> ssl.SSLContext:
        """A server-side context (TLS 1.2 or newer) from the files as they are now."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.certfile, self.keyfile)
        return context

    def reload(self, reason: str = "sighup") -> bool:
        """Read the files again; new connections present what they hold. Files
        that do not load (half written, a key that does not match) change nothing."""
        try:
            context = self.load()
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            log.error("tls_reload_failed", reason=reason, certfile=self.certfile, keyfile=self.keyfile,
                      error_message=str(e) or type(e).__name__)
            return False
        self.context = context
        log.info("tls_reloaded", reason=reason, certfile=self.certfile, keyfile=self.keyfile)
        return True


def answer_plain_http(sock: socket.socket) -> None:
    """Tell a plain HTTP client why it gets no answer here (it sent a request to the TLS port)."""
    body = json.dumps(PLAIN_HTTP_TO_TLS_PORT.body()).encode()
    head = (f"HTTP/1.0 400 Bad Request\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nx-should-retry: false\r\nConnection: close\r\n\r\n")
    sock.sendall(head.encode() + body)
    # The request is still unread: closing now could reset the answer away.
    linger_close(sock)


def send_close_notify(tls: ssl.SSLSocket) -> None:
    """End the TLS session before the socket closes, without waiting for the
    client's reply. A response that ends with the connection (stock's streams)
    can only be told from a cut one by this (RFC 8446 §6.1); a strict client
    (Python's ssl with suppress_ragged_eofs=False) reports an error without it."""
    try:
        tls.setblocking(False)
        tls.unwrap()
    except (OSError, ValueError):  # SSLWantReadError: ours is sent, the client's not awaited
        pass


def load_certificate(settings) -> Optional[ServerCertificate]:
    """The certificate the [access] table names, or None for plain HTTP; a
    ConfigError naming the key when the files do not load."""
    if not settings.ssl_certfile:
        if settings.ssl_keyfile:
            raise ConfigError("access.ssl_keyfile is set but access.ssl_certfile is not "
                              "(--ssl-keyfile needs --ssl-certfile)")
        return None
    try:
        return ServerCertificate(settings.ssl_certfile, settings.ssl_keyfile)
    except (OSError, ValueError) as e:
        raise ConfigError(f"access.ssl_certfile: cannot load {settings.ssl_certfile}"
                          + (f" with the key {settings.ssl_keyfile}" if settings.ssl_keyfile else "")
                          + f": {str(e) or type(e).__name__}") from None

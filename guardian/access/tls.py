"""TLS at the door: ``--ssl-certfile`` / ``--ssl-keyfile`` (vLLM's names), read again on SIGHUP.

Imports no mlx: the one-process server and the supervisor's public port
serve HTTPS the same way, through the connection layer (guardian.serving.connection),
whose reader runs each handshake non-blocking beside every other
connection's reads, under the same deadlines: a slow or silent client holds
up no one. A new connection takes the newest context: a reload swaps one
attribute, and connections already open keep the one they began with.
"""

from __future__ import annotations

import ssl
from typing import Optional

import structlog

from guardian.config.registry import ConfigError

log = structlog.get_logger("guardian.access")


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
        # A key that needs a passphrase fails to load (said, as any file that does not
        # load), where OpenSSL would ask for one on the terminal and wait there: the
        # supervisor's main loop, which reloads on SIGHUP, with it.
        context.load_cert_chain(self.certfile, self.keyfile, password=no_passphrase)
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


def no_passphrase() -> bytes:
    raise ValueError("the key file needs a passphrase; give a key without one (openssl pkey -in KEY -out KEY2)")


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

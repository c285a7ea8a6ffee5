"""systemd's notify protocol, written to ``$NOTIFY_SOCKET`` directly.

One datagram per message on an AF_UNIX socket; a leading ``@`` names an
abstract socket. Without ``$NOTIFY_SOCKET`` (not under systemd) every call
is a no-op, so callers need not check.
"""

from __future__ import annotations

import os
import socket
from typing import Optional


class SystemdNotifier:
    def __init__(self, address: Optional[str] = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        if address and address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        self._socket = None
        if self.address:
            # Not inherited by children (Python's sockets never are, PEP 446);
            # SOCK_CLOEXEC itself is Linux's, absent on macOS.
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, message: str) -> bool:
        """Send one message (``READY=1``, ``WATCHDOG=1``, ...); False if it could not."""
        if self._socket is None:
            return False
        try:
            self._socket.sendto(message.encode(), self.address)
            return True
        except OSError:
            return False

    def watchdog_interval_s(self) -> Optional[float]:
        """Half of systemd's WatchdogSec, as systemd recommends; None if unset."""
        usec = os.environ.get("WATCHDOG_USEC")
        return int(usec) / 2e6 if usec and usec.isdigit() else None

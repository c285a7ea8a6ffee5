"""One notice, and how it reads on each channel: a webhook's JSON, an ntfy POST."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

# ntfy's priorities (https://docs.ntfy.sh/publish/#message-priority).
URGENT, HIGH, DEFAULT = 5, 4, 3


@dataclass(frozen=True)
class Notice:
    """Something a person should know about, built on a hook's thread."""

    kind: str  # one of plugin.EVENTS
    title: str
    message: str
    priority: int  # ntfy's 1..5
    tags: tuple[str, ...]  # ntfy tags: emoji short codes show as icons
    details: dict = field(default_factory=dict)
    # Notices of this kind the dedup window held back since the last one sent.
    suppressed: int = 0
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def with_suppressed(self, count: int) -> Notice:
        return replace(self, suppressed=count)

    def text(self) -> str:
        """The message as a person reads it (ntfy's body, the webhook's ``message``)."""
        if not self.suppressed:
            return self.message
        return f"{self.message} ({self.suppressed} more like it since the last notice were not sent.)"

    def full_title(self) -> str:
        return f"mlx-guardian on {self.host}: {self.title}"

    def webhook_json(self) -> dict:
        """The body POSTed to each webhook URL; ``event`` is what a receiver routes on."""
        return {
            "source": "mlx-guardian",
            "event": self.kind,
            "title": self.full_title(),
            "message": self.text(),
            "priority": self.priority,
            "host": self.host,
            "pid": self.pid,
            "time": self.at,
            "suppressed": self.suppressed,
            "details": self.details,
        }

    def ntfy_headers(self, token: str = "") -> dict:
        """ntfy takes the title, priority and tags as headers; the body is the text.

        HTTP headers are Latin-1: a host name or detail outside it would make
        httpx refuse the request, so anything else becomes "?".
        """
        headers = {
            "Title": latin1(self.full_title()),
            "Priority": str(self.priority),
            "Tags": ",".join(self.tags),
        }
        if token:
            # ntfy's access tokens (tk_...) go in as a bearer token. Never logged.
            headers["Authorization"] = f"Bearer {token}"
        return headers


def latin1(text: str) -> str:
    return text.encode("latin-1", errors="replace").decode("latin-1")

"""An example mlx-guardian plugin: refuse requests that contain a blocked word.

The whole of a plugin, in one file: a class with a ``name``, a ``Settings``
dataclass (its TOML table, ``[blocked_words]``), and one hook. The entry
point in pyproject.toml is what gets it loaded; nothing imports it by hand.

    [blocked_words]
    words = ["forbidden", "secret project"]

A request whose prompt contains one of the words (whole words, any case) is
answered 400 before it reaches the engine; every other request is let in and
its response carries an ``x-blocked-words: checked`` header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import guardian


@dataclass
class BlockedWordsSettings:
    # ``live``: the plugin reads the list at each request, so saving the TOML
    # file changes it without a restart. Empty (the default): the plugin does nothing.
    words: list = field(default_factory=list, metadata={"live": True})


class BlockedWords:
    name = "blocked_words"
    Settings = BlockedWordsSettings

    def __init__(self, settings: BlockedWordsSettings):
        # Keep the settings object, not its values: it reads the version in force.
        self.settings = settings

    @guardian.hookimpl
    def admit_request(self, admission) -> guardian.GuardianError | None:
        """HTTP thread, before the request is queued: None lets it in."""
        words = self.settings.words
        if not words:
            return None
        found = first_blocked_word(prompt_text(admission.request), words)
        if found is None:
            admission.response_headers["x-blocked-words"] = "checked"
            return None
        # Returned, not raised: firstresult, so no later hook runs, and the
        # client gets this status and OpenAI-shaped body.
        return guardian.GuardianError(
            f"This server does not accept requests that mention {found!r}.",
            status=400,
            type="invalid_request_error",
            code="blocked_word",
            param="messages" if admission.is_chat else "prompt",
            retry=False,  # tells the openai SDK not to send it again
        )


def prompt_text(request) -> str:
    """The text a client sent: a chat's message contents, or a completion's prompt."""
    if request.request_type != "chat":
        return request.prompt or ""
    parts = []
    for message in request.messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # OpenAI's content parts: keep the text ones
            parts.extend(part.get("text", "") for part in content if isinstance(part, dict))
    return "\n".join(parts)


def first_blocked_word(text: str, words: list) -> str | None:
    for word in words:
        if re.search(rf"\b{re.escape(word)}\b", text, flags=re.IGNORECASE):
            return word
    return None

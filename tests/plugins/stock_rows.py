"""What the test plugins planted in stock's ``BatchGenerator`` read of a request and of a row."""

from __future__ import annotations


def prompt_text(request) -> str:
    """A request's prompt as text to look for a marker in: a chat's messages, or a text prompt."""
    return str(getattr(request, "messages", None) or "") + str(getattr(request, "prompt", None) or "")


def whole_prompts(segments, all_tokens) -> list[list[int]]:
    """Each inserted row's whole prompt: the tokens it starts from (a prompt cache
    entry's, or a failed batch's kept KV), then its segments."""
    before = all_tokens or [[] for _ in segments]
    return [list(cached) + [t for segment in row for t in segment] for cached, row in zip(before, segments)]

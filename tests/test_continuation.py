"""Stream continuation: a request that had generated tokens when the engine
failed goes on, on the restarted engine, where it stopped.

Each test compares a request cut by a planted failure with the same request
served without one, at temperature 0 (greedy): the demo model's weights are
random but its argmax is deterministic, so the continued completion must be
the unfailed one, token for token, with the same finish_reason and usage.
"""

from __future__ import annotations

import json
import math

import httpx
import openai

from conftest import chat_body, read_stream

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def faults(**settings) -> str:
    return "[fault_injection]\nenabled = true\n" + "".join(
        f"{key} = {json.dumps(value)}\n" for key, value in settings.items()
    )


def recovery(**settings) -> str:
    return "[recovery]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())


def greedy(**body) -> dict:
    return chat_body(temperature=0.0, **body)


def streamed(result: dict) -> dict:
    """The text, finish_reason and usage a streaming client put together."""
    text, finish, usage, logprobs = "", None, None, []
    for event in result["events"]:
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            text += delta.get("content") or choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
            if choice.get("logprobs"):
                logprobs += choice["logprobs"].get("content") or []
    return {"text": text, "finish_reason": finish, "usage": usage, "logprobs": logprobs}


def unfailed(server, path: str, body: dict) -> dict:
    """The same request on the same server, with no failure planted in it
    (the fault injection fires once, and has fired)."""
    with httpx.Client(timeout=60) as client:
        if body.get("stream"):
            return streamed(read_stream(client, server.url + path, body))
        response = client.post(server.url + path, json=body)
        assert response.status_code == 200, response.text
        return response.json()


def continued_events(server) -> list[dict]:
    return [e for e in server.events("request_rerun") if e.get("continued")]


def test_stream_cut_mid_way_is_continued(start_server):
    server = start_server(faults(at_step=20, max_faults=1))
    body = greedy(max_tokens=60, stream=True, stream_options={"include_usage": True})
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + CHAT, body)
    assert result["done"] and not result["errors"], result
    [error] = server.events("engine_error")
    [event] = continued_events(server)
    assert 0 < event["generated"] < 60
    got = streamed(result)
    expected = unfailed(server, CHAT, body)
    assert got["text"] == expected["text"]
    assert got["finish_reason"] == expected["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 60
    assert got["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]

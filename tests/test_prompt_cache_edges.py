"""Stock's prompt cache at its edge: an entry of exactly a request's prompt.

Stock's ``LRUPromptCache`` answers a lookup that finds an entry of exactly the
prompt with nothing left to prefill, and its loop then inserts an empty
sequence: "Sequence N has an empty prompt" on 0.32, an IndexError on 0.31.3.
Stock's generation thread dies of it; the guardian restarted, ran the request
again into the same entry, and blamed and quarantined an innocent request. Such
an entry is left by a stream its client cancelled (stock caches the prompt less
its last token, and only a finished request's own insert drops that entry), so
the prompt one token shorter than a cancelled stream's hit it (a review found it).
The guardian now leaves the prompt's last token to prefill, as stock does for a
longer entry (guardian.stock.continuation.with_a_token_to_prefill).
"""

from __future__ import annotations

import json
import socket
import uuid

import httpx
from tokenizers import Tokenizer

from conftest import poll

TEXT_COMPLETIONS = "/v1/completions"


def tokens_of(model_cache, text: str) -> list[int]:
    from guardian.demo_model import DEMO_MODEL_NAME

    return Tokenizer.from_file(str(model_cache / DEMO_MODEL_NAME / "tokenizer.json")).encode(text).ids


def cancel_after_events(server, body: dict, events: int) -> None:
    """Send a stream and leave once ``events`` of its events came (a close, mid-stream)."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (TEXT_COMPLETIONS.encode(), len(payload)) + payload)
        got = b""
        while got.count(b"data: ") < events:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk


def test_the_prompt_a_cancelled_stream_cached_is_served(start_server, model_cache):
    server = start_server()
    # A prompt no other request made, and the same with one token more.
    short = f"Quartz lanterns drift {uuid.uuid4().int % 10**6}"
    assert tokens_of(model_cache, short + " there") == tokens_of(model_cache, short) + tokens_of(model_cache, " there")
    cancel_after_events(server, {"prompt": short + " there", "max_tokens": 2000, "stream": True}, events=3)
    poll(lambda: server.events("client_disconnected") or server.events("request_cancelled"), 30,
         what="the stream cancelled")

    response = httpx.post(server.url + TEXT_COMPLETIONS, json={"prompt": short, "max_tokens": 8}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    # Its prompt came from the cache, but for the token left to prefill (where stock says).
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        assert details["cached_tokens"] == len(tokens_of(model_cache, short)) - 1, details
    assert not server.events("engine_error")
    assert not server.events("request_blamed")

"""One client's logits processors act on its own row of the batch, and on no one else's.

Stock mlx-lm 0.31.3 keeps a list of logits processors per batch row and
filters it as rows finish, but only while some row has a processor: after a
request without processors finishes, the list is left longer than the batch,
and a request that joins later gets another row's processors (none), while
its own (its ``logit_bias``) land past the end or on another client's row.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from conftest import chat_body, poll

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def forced_token(model_cache):
    """A token id and its text: the one a logit_bias of 100 forces."""
    from mlx_lm.utils import load_tokenizer

    from guardian.demo_model import ensure_demo_model

    tokenizer = load_tokenizer(ensure_demo_model(model_cache))
    [token] = tokenizer.encode(" the", add_special_tokens=False)[-1:]
    return token, tokenizer.decode([token] * 6)


def completion_text(client, server, body) -> str:
    response = client.post(server.url + CHAT, json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_a_logit_bias_acts_on_its_own_row_after_another_row_finished(start_server, forced_token):
    token, forced_text = forced_token
    server = start_server()
    long_body = chat_body("Tell me about boats.", max_tokens=300, temperature=0.0)
    with httpx.Client(timeout=120) as client:
        alone = completion_text(client, server, long_body)
        results = {}

        def long_request():
            with httpx.Client(timeout=120) as own:
                results["long"] = completion_text(own, server, long_body)

        thread = threading.Thread(target=long_request)
        thread.start()
        poll(lambda: httpx.get(server.url + "/guardian/status").json()["in_flight"] >= 1, 30,
             what="the long request in flight")
        # A short request without processors joins the batch and finishes in it ...
        completion_text(client, server, chat_body("Hi.", max_tokens=2, temperature=0.0))
        # ... then one whose logit_bias forces a token joins.
        biased = completion_text(client, server, chat_body(
            "Hello.", max_tokens=6, temperature=0.0, logit_bias={str(token): 100}))
        thread.join(120)
    assert biased.strip() == forced_text.strip(), "the logit_bias did not act on its own request"
    assert results["long"] == alone, "another client's logit_bias changed this completion"

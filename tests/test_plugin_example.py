"""The example plugin (plugins/example, `blocked_words`), tested as a third party's plugin.

Installed as its own distribution (`make test` runs `pip install -e
plugins/example`), it reaches the server through its `mlx_guardian` entry
point; nothing here imports it. One real server answers every request.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import chat_body, run_guardian

# What it checks does not depend on mlx-lm's version (the plugin works through the guardian's admit_request hook, above stock):
# `make test` runs it against the newest mlx-lm only.
pytestmark = [pytest.mark.one_version]

BLOCKED = '[blocked_words]\nwords = ["forbidden", "secret project"]\n'


def test_the_example_is_loaded_through_its_entry_point():
    listed = run_guardian(["plugins"])
    plugins = {p["name"]: p["hooks"] for p in json.loads(listed.stdout)}
    assert plugins.get("blocked_words") == ["admit_request"], \
        "the example plugin is not installed: pip install -e plugins/example (make test does)"


@pytest.fixture
def server(start_server):
    return start_server(BLOCKED)


def test_a_request_with_a_blocked_word_is_refused_before_the_engine(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        chat = client.post("/v1/chat/completions",
                           json=chat_body("Tell me about the Secret Project."))
        text = client.post("/v1/completions", json={"prompt": "A FORBIDDEN story", "max_tokens": 4})
        # Content parts, as the openai SDK sends them, are read too.
        parts = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "forbidden fruit"}]}],
            "max_tokens": 4})
        metrics = client.get("/metrics").text
    for response, param in ((chat, "messages"), (text, "prompt"), (parts, "messages")):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "blocked_word" and error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert response.headers["x-should-retry"] == "false"  # the openai SDK will not send it again
    assert "'secret project'" in chat.json()["error"]["message"]
    # Turned away at the door, as the plugin's refusals: none was let in to the engine.
    assert 'mlx_guardian_requests_refused_total{code="blocked_word"} 3.0' in metrics
    assert "mlx_guardian_requests_admitted_total 0.0" in metrics


def test_other_requests_are_served_and_say_they_were_checked(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        # A word that merely contains a blocked one is not it.
        response = client.post("/v1/chat/completions", json=chat_body("Nothing is unforbiddenly secret."))
    assert response.status_code == 200, response.text
    assert response.headers["x-blocked-words"] == "checked"
    assert response.json()["usage"]["completion_tokens"] > 0


def test_without_words_the_plugin_does_nothing(start_server):
    server = start_server()
    response = httpx.post(server.url + "/v1/chat/completions", json=chat_body("forbidden"), timeout=60)
    assert response.status_code == 200, response.text
    assert "x-blocked-words" not in response.headers


def test_the_words_are_live_a_saved_file_applies_without_a_restart(server, tmp_path):
    story = chat_body("Tell me a story.")
    assert httpx.post(server.url + "/v1/chat/completions", json=story, timeout=60).status_code == 200
    server.config.write_text('[blocked_words]\nwords = ["story"]\n')
    [reloaded] = server.wait_for_event("config_reloaded", timeout=30)
    assert reloaded["changed"] == ["blocked_words.words"]
    response = httpx.post(server.url + "/v1/chat/completions", json=story, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "blocked_word"

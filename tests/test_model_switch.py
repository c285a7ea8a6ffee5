"""Requests that name another model: refused unless allowed, admitted against it when allowed.

Stock loads whatever a request names, and when that load fails it is left
with no model: the next request skips the prompt guard.
"""

from __future__ import annotations

import json
import shutil

import httpx

from conftest import chat_body

CHAT = "/v1/chat/completions"


def test_a_failed_switch_keeps_the_served_model_and_its_guard(start_server, tmp_path):
    server = start_server("[guardian]\nallow_any_model = true\n", env={"HF_HUB_OFFLINE": "1"})
    missing = str(tmp_path / "no-such-model")
    with httpx.Client(timeout=60) as client:
        response = client.post(server.url + CHAT, json=chat_body(model=missing, max_tokens=4))
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
        server.wait_for_event("served_model_reloaded")
        # Stock would now have no model: the next prompt would skip the guard.
        too_long = client.post(server.url + CHAT, json=chat_body("word " * 3000, max_tokens=4))
        assert too_long.status_code == 400, too_long.text
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        assert client.post(server.url + CHAT, json=chat_body(max_tokens=4)).status_code == 200
    # Only the request for the missing model went in unadmitted: nothing to read it from.
    assert [e["model"] for e in server.events("admission_skipped")] == [missing]


def test_a_switch_to_an_allowed_model_is_admitted_against_that_model(start_server, tmp_path, model_cache):
    # Another model on disk: the demo model's files with a 512-token context.
    [served] = [p for p in model_cache.iterdir() if (p / "config.json").exists()]
    other = tmp_path / "short-context-model"
    shutil.copytree(served, other)
    config = json.loads((other / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (other / "config.json").write_text(json.dumps(config))

    server = start_server(f'[guardian]\nallowed_models = ["{other}"]\n')
    prompt = "word " * 700  # fits the served model's 2048 tokens, not the other's 512
    with httpx.Client(timeout=60) as client:
        refused = client.post(server.url + CHAT, json=chat_body(prompt, max_tokens=4, model=str(other)))
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["n_ctx"]) == ("context_length_exceeded", 512)
        [read] = server.events("unloaded_model_read")
        assert read["context_length"] == 512 and read["weights_bytes"] > 0
        # The served model takes the same prompt; then the other model serves a short one.
        assert client.post(server.url + CHAT, json=chat_body(prompt, max_tokens=4)).status_code == 200
        switched = client.post(server.url + CHAT, json=chat_body(max_tokens=4, model=str(other)))
        assert switched.status_code == 200, switched.text
        assert client.post(server.url + CHAT, json=chat_body(max_tokens=4)).status_code == 200
    assert server.events("admission_skipped") == []


def fake_hub_cache(folder):
    """A hub cache holding one model stock's /v1/models would list (its three files, empty)."""
    snapshot = folder / "models--mlx-community--Elsewhere-4bit" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
        (snapshot / name).write_text("{}")
    (folder / "models--mlx-community--Elsewhere-4bit" / "refs").mkdir()
    (folder / "models--mlx-community--Elsewhere-4bit" / "refs" / "main").write_text("abc123")
    (folder / "models--mlx-community--Elsewhere-4bit" / "blobs").mkdir()
    return folder


def test_the_models_listed_are_the_models_a_request_may_name(start_server, tmp_path, model_cache):
    # Started by a name that is not the model's resolved path (as `--model ./model` is): stock's
    # listing gives the resolved path, and a client that takes the id it was given must be served.
    [served] = [p for p in model_cache.iterdir() if (p / "config.json").exists()]
    by_link = tmp_path / "served-by-link"
    by_link.symlink_to(served, target_is_directory=True)
    hub = fake_hub_cache(tmp_path / "hub")
    server = start_server("", "--model", str(by_link),
                          env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    with httpx.Client(timeout=60) as client:
        listed = [model["id"] for model in client.get(server.url + "/v1/models").json()["data"]]
        # The hub cache's model would be refused (404 model_not_found), so it is not listed.
        assert listed == [str(served.resolve())]
        for name in (*listed, str(by_link), "default_model"):
            answer = client.post(server.url + CHAT, json=chat_body(max_tokens=4, model=name))
            assert answer.status_code == 200, (name, answer.text)
            assert answer.json()["model"] == name  # stock's echo of the name asked for
        refused = client.post(server.url + CHAT, json=chat_body(max_tokens=4, model="mlx-community/Elsewhere-4bit"))
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        # An adapter beside the listed name is a switch, as it is beside the name it was started with.
        adapter = client.post(server.url + CHAT, json=chat_body(max_tokens=4, model=listed[0],
                                                                 adapters=str(tmp_path / "adapter")))
        assert adapter.status_code == 404 and adapter.json()["error"]["param"] == "adapters", adapter.text
    # Each went to the loaded model as stock's arguments named it: admitted against its
    # tokenizer, with no other model's files read (stock would have loaded the listed name again).
    assert server.events("admission_skipped") == []
    assert server.events("unloaded_model_read") == []


def test_a_trailing_slash_lists_the_same_models(start_server, tmp_path):
    """/v1/models/ was a 404 for the model '' (stock lists them there); then, run as stock
    runs it, an empty list of the hub's models: stock filters by what follows the slash."""
    hub = fake_hub_cache(tmp_path / "hub")
    server = start_server("[guardian]\nallow_any_model = true\n",
                          env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    def models(path: str) -> list:
        return [model["id"] for model in httpx.get(server.url + path, timeout=30).json()["data"]]

    listed = models("/v1/models")
    assert "mlx-community/Elsewhere-4bit" in listed
    assert models("/v1/models/") == listed


def test_a_model_config_read_before_it_exists_is_read_again_once_it_does(tmp_path):
    """An allowed model not on disk yet had its unknown vocabulary size and context length
    cached for the life of the process: once stock had downloaded it, its logit_bias bounds
    stayed unchecked and /v1/models never gave its context_length."""
    import json

    from guardian.admission.facts import context_length_of, vocab_size_of

    folder = tmp_path / "later-model"
    assert context_length_of(str(folder)) is None and vocab_size_of(str(folder)) is None
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 512,
                                                    "max_position_embeddings": 4096}))
    assert context_length_of(str(folder)) == 4096 and vocab_size_of(str(folder)) == 512

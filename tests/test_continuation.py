"""Stream continuation: a request that had generated tokens when the engine
failed goes on, on the restarted engine, where it stopped.

Each test compares a request cut by a planted failure with the same request
served without one, at temperature 0 (greedy): the demo model's weights are
random but its argmax is deterministic, so the continued completion must be
the unfailed one, token for token, with the same finish_reason and usage.

The tests share one server (``continuing_server``): the token-faults plugin
loaded, [fault_injection] armable, each test's faults and [recovery] and
[watchdog] settings armed by a save of its file (all live); its log lines
from then on are the test's own.
"""

from __future__ import annotations

import json
import math
from typing import Optional

import httpx
import openai
import pytest

from conftest import SharedServer, chat_body, poll, read_stream

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def table(name: str, settings: dict) -> str:
    return f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items())


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
    if usage:  # the unfailed run compared with finds the prompt in the prompt cache
        usage = {key: value for key, value in usage.items() if key != "prompt_tokens_details"}
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


TOKEN_FAULTS_PLUGIN = '[guardian]\nplugins = ["tests.plugins.token_faults:TokenFaults"]\n'


def shared_config(token: dict, faults: dict, recovery: dict, watchdog: dict) -> str:
    """The shared server's file: the token-faults plugin (fail_at_token 0: nothing
    planted) and armable fault injection, with these settings."""
    return (TOKEN_FAULTS_PLUGIN + table("token_faults", token)
            + table("fault_injection", {"armable": True, "enabled": bool(faults), **faults})
            + table("recovery", recovery) + table("watchdog", watchdog))


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, model_cache):
    server = SharedServer(tmp_path_factory.mktemp("continuation"), model_cache, shared_config({}, {}, {}, {}))
    yield server
    server.stop()


@pytest.fixture
def continuing_server(shared_server):
    """``continuing_server(token={...}, faults={...}, recovery={...}, watchdog={...})``:
    the shared server running these (a token fault, a fault-injection trigger);
    nothing planted and the defaults again after the test, the server checked
    healthy (bounded) for the next one."""
    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy")

    def configure(token: Optional[dict] = None, faults: Optional[dict] = None,
                  recovery: Optional[dict] = None, watchdog: Optional[dict] = None) -> SharedServer:
        return shared_server.configure(shared_config(token or {}, faults or {}, recovery or {}, watchdog or {}))

    yield configure
    configure()
    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy after the test")


def test_stream_cut_mid_way_is_continued(continuing_server):
    server = continuing_server(faults=dict(at_step=20, max_faults=1))
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


# -- failures planted at an exact token (tests/plugins/token_faults.py) --------

MARKER = 2  # top_logprobs of the request the fault is planted in
SEAM = 25  # the engine fails while stock formats that request's 25th token


def token_faults(fail_at_token: int = SEAM, times: int = 1) -> str:
    return TOKEN_FAULTS_PLUGIN + table("token_faults", token_fault(fail_at_token, times))


def token_fault(fail_at_token: int = SEAM, times: int = 1) -> dict:
    return {"marker_top_logprobs": MARKER, "fail_at_token": fail_at_token, "times": times}


def message(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def test_non_streaming_request_is_continued_with_its_logprobs(continuing_server):
    server = continuing_server(token=token_fault())
    body = greedy(max_tokens=50, logprobs=True, top_logprobs=MARKER)
    with httpx.Client(timeout=60) as client:
        response = client.post(server.url + CHAT, json=body)
    assert response.status_code == 200, response.text
    [event] = continued_events(server)
    assert event["generated"] == SEAM - 1  # held, not sent: kept, not generated again
    got = response.json()
    expected = unfailed(server, CHAT, body)  # the fault fired once: this one runs through
    assert message(got) == message(expected)
    assert got["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 50
    assert got["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    got_lp = got["choices"][0]["logprobs"]["content"]
    expected_lp = expected["choices"][0]["logprobs"]["content"]
    assert len(got_lp) == len(expected_lp) == 50
    for k, (a, b) in enumerate(zip(got_lp, expected_lp)):
        # The continuation's logprobs come from a re-prefilled KV cache: equal
        # to float noise, and the same top tokens.
        assert {t["id"] for t in a["top_logprobs"]} == {t["id"] for t in b["top_logprobs"]}, k
        assert math.isclose(a["logprob"], b["logprob"], abs_tol=1e-3), k


def test_stream_continued_at_a_known_token_with_text_completions(continuing_server):
    server = continuing_server(token=token_fault())
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.0, "stream": True,
            "top_logprobs": MARKER, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + TEXT, body)
    assert result["done"] and not result["errors"], result
    [event] = continued_events(server)
    assert event["generated"] == SEAM - 1
    got, expected = streamed(result), unfailed(server, TEXT, body)
    assert got["text"] == expected["text"]
    assert got["finish_reason"] == expected["finish_reason"]
    assert got["usage"] == expected["usage"]


def seam_stop_word(model_cache, ids: list[int]):
    """A stop word whose tokens span the seam (the last token sent before the
    failure and the first one after it), and occur nowhere earlier; or None."""
    import transformers

    from guardian.demo_model import ensure_demo_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ensure_demo_model(model_cache)))
    sent = SEAM - 1  # ids[:sent] were sent before the failure
    for start in range(sent - 1, sent - 4, -1):
        for end in range(sent + 1, sent + 3):
            window = ids[start:end]
            word = tokenizer.decode(window)
            if tokenizer.encode(word, add_special_tokens=False) != window or not word.strip():
                continue
            earlier = ids[: end - 1]
            if any(earlier[i: i + len(window)] == window for i in range(len(earlier))):
                continue
            if word in tokenizer.decode(ids[:start]):
                continue
            return word, end
    return None


def test_a_stop_word_spanning_the_seam_stops_the_continuation(continuing_server, model_cache):
    server = continuing_server(token=token_fault())
    with httpx.Client(timeout=60) as client:
        for content in [f"Tell me story number {n}." for n in range(12)]:
            # Not the marker: this run learns the greedy tokens, unfailed.
            learn = client.post(server.url + CHAT, json=greedy(content=content, max_tokens=60, logprobs=True))
            ids = [t["id"] for t in learn.json()["choices"][0]["logprobs"]["content"]]
            found = seam_stop_word(model_cache, ids)
            if found:
                break
        assert found, "no stop word spans the seam in twelve prompts"
        word, stops_after = found
        body = greedy(content=content, max_tokens=60, stream=True, stop=[word], top_logprobs=MARKER,
                      stream_options={"include_usage": True})
        result = read_stream(client, server.url + CHAT, body)
    assert result["done"] and not result["errors"], result
    [event] = continued_events(server)
    assert event["generated"] == SEAM - 1
    got, expected = streamed(result), unfailed(server, CHAT, body)
    assert expected["finish_reason"] == "stop" and expected["usage"]["completion_tokens"] == stops_after
    assert got == expected
    assert word not in got["text"]


def test_a_stream_that_progresses_between_failures_is_continued_past_max_continuations(continuing_server):
    # Two failures in the same stream, one continuation allowed at one point.
    # The second failure comes SEAM - 1 tokens after the first: the stream
    # progressed, so it is continued again, and the default max_reruns (1)
    # blames nothing (before, the bound counted every continuation and the
    # second failure cut the stream). A stream failing twice at one point is
    # cut: tests/test_failure_progress.py.
    server = continuing_server(token=token_fault(times=2), recovery=dict(max_continuations=1))
    body = greedy(max_tokens=80, stream=True, top_logprobs=MARKER, stream_options={"include_usage": True})
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + CHAT, body)
    assert result["status"] == 200 and result["done"] and not result["errors"], result
    assert len(server.events("engine_error")) == 2
    assert [e["continuations"] for e in continued_events(server)] == [1, 2]
    assert server.events("request_blamed") == []
    got, expected = streamed(result), unfailed(server, CHAT, body)
    assert got["text"] == expected["text"]
    assert got["finish_reason"] == expected["finish_reason"] and got["usage"] == expected["usage"]


def test_the_openai_sdk_sees_one_clean_stream(continuing_server):
    server = continuing_server(token=token_fault())
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    kwargs = dict(model="default_model", messages=[{"role": "user", "content": "Tell me a story."}],
                  max_tokens=50, temperature=0.0, stream=True, stream_options={"include_usage": True})
    chunks = list(sdk.chat.completions.create(top_logprobs=MARKER, **kwargs))
    [event] = continued_events(server)
    unfailed_chunks = list(sdk.chat.completions.create(**kwargs))

    def summary(chunks):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
                 for c in chunks if c.usage]
        return text, finish, usage

    assert summary(chunks) == summary(unfailed_chunks)
    assert summary(chunks)[1] == ["length"]
    assert summary(chunks)[2][0][1] == 50


def test_a_stream_held_by_a_stalled_loop_is_continued(continuing_server):
    # The loop blocks at its 20th step (as a native deadlock would); the
    # watchdog abandons it and the replacement loop continues the stream,
    # without the prompt cache, which a stall drops.
    server = continuing_server(faults=dict(hang_at_step=20), watchdog=dict(interval_s=0.05, stall_timeout_s=1.0))
    body = greedy(max_tokens=60, stream=True, stream_options={"include_usage": True})
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + CHAT, body)
    assert result["done"] and not result["errors"], result
    assert server.events("engine_stalled")
    [event] = continued_events(server)
    assert 0 < event["generated"] < 60
    got, expected = streamed(result), unfailed(server, CHAT, body)
    assert got["text"] == expected["text"]
    assert got["finish_reason"] == expected["finish_reason"]
    assert got["usage"] == expected["usage"]


def test_a_stream_on_the_non_batched_path_is_continued(continuing_server):
    # A seed sends the request down stock's sequential path (stream_generate),
    # whose detokenizer and stop matcher are primed the same way. (Stock's
    # path catches what its own loop raises: the failure is planted in the
    # step, which the guardian marks as the engine's.)
    server = continuing_server(faults=dict(at_step=20, max_faults=1))
    body = greedy(max_tokens=40, stream=True, seed=7, stream_options={"include_usage": True})
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + CHAT, body)
    assert result["done"] and not result["errors"], result
    [event] = continued_events(server)
    assert 0 < event["generated"] < 40
    assert streamed(result) == unfailed(server, CHAT, body)


def test_a_seeded_request_no_client_saw_is_run_again_and_answers_as_if_unfailed(continuing_server):
    # Stock seeds the sampler again where a continuation starts: continued, a seeded request's
    # tokens after the cut were sampled from the seed's first draws and differed from an
    # unfailed run's. Its client has seen nothing yet, so it is run again from nothing.
    server = continuing_server(faults=dict(at_step=12, max_faults=1))
    body = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 30,
            "temperature": 3.0, "seed": 42}
    with httpx.Client(timeout=60) as client:
        got = client.post(server.url + CHAT, json=body)
    assert got.status_code == 200, got.text
    [rerun] = server.events("request_rerun")
    assert not rerun["continued"] and rerun["generated"] > 0, rerun
    expected = unfailed(server, CHAT, body)
    assert message(expected) == message(unfailed(server, CHAT, body))  # the seed makes an unfailed run repeat
    assert message(got.json()) == message(expected)
    assert got.json()["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]


def test_a_continued_request_that_fails_again_after_progress_is_continued_again(continuing_server):
    # Blame needs reproduction: the continuation fails again, but only after
    # SEAM - 1 new tokens (the plugin counts a continuation's tokens afresh), so
    # it is not at fault and is continued once more, to the same text as an
    # unfailed run. (A request that fails again at the same point, with no new
    # token, is blamed: tests/test_failure_progress.py.)
    server = continuing_server(token=token_fault(times=2))
    body = greedy(max_tokens=80, stream=True, top_logprobs=MARKER, stream_options={"include_usage": True})
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + CHAT, body)
    assert result["status"] == 200 and result["done"] and not result["errors"], result
    assert not server.events("request_blamed")
    assert len(continued_events(server)) == 2
    assert streamed(result) == unfailed(server, CHAT, body)

"""Validation at the door: every field checked before anything is queued.

One real ``mlx-guardian`` serves the whole module (the demo model: vocabulary
1000, context 2048). The bodies marked "kills stock" crashed stock
mlx_lm.server 0.32.2 in a measured run (bench/fuzz_campaign.py has the
campaign): the process (SIGSEGV, SIGABRT), or its generation thread.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conftest import REPO, Server, chat_body, free_port, poll, read_stream, run_guardian, spawn_guardian

from guardian import stock

MESSAGES = [{"role": "user", "content": "Hello there."}]
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_cache):
    folder = tmp_path_factory.mktemp("validation")
    port = free_port()
    log_path = folder / "server.log"
    proc = spawn_guardian(["--port", str(port)], log_path, model_cache)
    running = Server(proc, port, log_path)
    running.wait_healthy()
    yield running
    running.stop()


def chat(**fields) -> dict:
    return {"messages": MESSAGES, "max_tokens": 4, **fields}


# (endpoint, body, param, code); the comment says what the body did to stock 0.32.2.
REFUSED = [
    (CHAT, chat(logit_bias={"999999999": 5}), "logit_bias", "invalid_value"),  # kills stock: SIGSEGV
    (CHAT, chat(logit_bias={"1000": 5}), "logit_bias", "invalid_value"),  # kills stock: SIGABRT
    (CHAT, chat(logit_bias={"-99999999": 5}), "logit_bias", "invalid_value"),  # kills stock: SIGSEGV
    (CHAT, chat(logit_bias={"5": 1e300}), "logit_bias", "invalid_value"),
    (CHAT, chat(logit_bias={"five": 1}), "logit_bias", "invalid_type"),
    (CHAT, chat(stop=[1]), "stop[0]", "invalid_type"),  # kills stock's generation thread
    (CHAT, chat(stop={"a": 1}), "stop", "invalid_type"),
    # Past [guardian] max_stop_sequences (32) and max_stop_chars (256): stock builds its matcher
    # on the loop all requests share (50,000 strings of 10 characters held them ~4.5 s).
    (CHAT, chat(stop=["x"] * 33), "stop", "invalid_value"),
    (CHAT, chat(stop=["x", "y" * 257]), "stop[1]", "invalid_value"),
    (TEXT, {"prompt": "a", "max_tokens": 4, "stop": "x" * 257}, "stop", "invalid_value"),
    # More messages than the context (2048) has tokens: refused before any is rendered (100,000
    # took ~8 s of Python on the HTTP thread, the generation thread waiting on the GIL meanwhile).
    (CHAT, chat(messages=[{"role": "user", "content": "x"}] * 2049), "messages", "context_length_exceeded"),
    (TEXT, {"prompt": "", "max_tokens": 4}, "prompt", "invalid_value"),  # kills stock's thread
    (CHAT, chat(repetition_penalty=1.1, repetition_context_size=10**12),
     "repetition_context_size", "invalid_value"),  # kills stock's thread
    (CHAT, chat(presence_penalty=1.0, presence_context_size=10**12),
     "presence_context_size", "invalid_value"),  # kills stock's thread
    (CHAT, chat(seed=-1), "seed", "invalid_value"),  # stock drops the connection
    (CHAT, chat(seed=2**64), "seed", "invalid_value"),  # stock drops the connection
    (CHAT, chat(seed=True), "seed", "invalid_type"),
    (CHAT, chat(model=["a"]), "model", "invalid_type"),
    (CHAT, chat(draft_model={"x": 1}), "draft_model", "invalid_type"),
    (CHAT, chat(adapters=7), "adapters", "invalid_type"),
    (CHAT, chat(max_tokens="7"), "max_tokens", "invalid_type"),
    (CHAT, chat(max_completion_tokens=-3), "max_completion_tokens", "invalid_value"),
    (CHAT, chat(temperature=-1), "temperature", "invalid_value"),
    (CHAT, chat(top_p=1.5), "top_p", "invalid_value"),
    (CHAT, chat(temperature=10**400), "temperature", "invalid_value"),  # std::bad_cast in the step
    (CHAT, chat(top_logprobs=99, logprobs=True), "top_logprobs", "invalid_value"),
    (CHAT, chat(top_logprobs=12, logprobs=True), "top_logprobs", "invalid_value"),  # past stock's 11
    (CHAT, chat(stream="yes"), "stream", "invalid_type"),
    (CHAT, chat(stream=True, stream_options="x"), "stream_options", "invalid_type"),
    (CHAT, chat(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs.tokenize", "invalid_value"),
    (CHAT, chat(chat_template_kwargs={"return_dict": True}), "chat_template_kwargs.return_dict", "invalid_value"),
    (CHAT, chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs.tokenize", "invalid_value"),  # stock: 404
    # A prompt padded to 10**8 tokens on the HTTP thread, before the guard counts them.
    (CHAT, chat(chat_template_kwargs={"padding": "max_length", "max_length": 10**8}),
     "chat_template_kwargs.padding", "invalid_value"),
    (CHAT, chat(chat_template_kwargs={"truncation": True, "max_length": -5}),
     "chat_template_kwargs.max_length", "invalid_value"),  # stock: 404 with an OverflowError
    (CHAT, chat(chat_template_kwargs={"max_length": "5"}), "chat_template_kwargs.max_length", "invalid_type"),
    # A template of the client's: nested loops of 100,000 ran on the HTTP thread for hours.
    (CHAT, chat(chat_template_kwargs={"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                                       "{% endfor %}{% endfor %}"}),
     "chat_template_kwargs.chat_template", "invalid_value"),
    (CHAT, chat(chat_template_kwargs="x"), "chat_template_kwargs", "invalid_type"),
    (CHAT, {"max_tokens": 4}, "messages", "missing_required_parameter"),
    (CHAT, chat(messages=[]), "messages", "invalid_value"),
    (CHAT, chat(messages="hi"), "messages", "invalid_type"),
    (CHAT, chat(messages=[{"content": "x"}]), "messages[0].role", "missing_required_parameter"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "invalid_type"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages[0].content[0].text", "invalid_type"),
    (CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}]),
     "messages[0].content[0].type", "invalid_value"),  # a text model: no image is fetched
    (CHAT, chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]},
                          {"role": "user", "content": "x"}]),
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    (CHAT, chat(tools="x"), "tools", "invalid_type"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": 3}}]), "tools[0].function.name", "invalid_type"),
    (TEXT, {"prompt": [1, 2, 3], "max_tokens": 4}, "prompt", "invalid_type"),
    (TEXT, {"max_tokens": 4}, "prompt", "missing_required_parameter"),
    (TEXT, {"prompt": "a\ud800b", "max_tokens": 4}, "prompt", "invalid_value"),
]


@pytest.mark.parametrize("path, body, param, code", REFUSED,
                         ids=[f"{p}:{param}:{i}" for i, (p, _, param, _c) in enumerate(REFUSED)])
def test_an_invalid_field_is_named_in_a_400(server, path, body, param, code):
    response = httpx.post(server.url + path, content=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    assert error["message"]
    # The openai SDK would send a 4xx once: it is told not to retry.
    assert response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_the_least_max_tokens_is_the_installed_stocks_and_named_as_sent(server, field):
    # Stock 0.32 serves max_tokens from 1 (0.31.3 from 0). The door said "at least 0"
    # for -1 on 0.32, then stock refused 0 itself, naming max_tokens with no param
    # even when the client had sent max_completion_tokens.
    from guardian.stock.contract import MIN_MAX_TOKENS

    for value in (MIN_MAX_TOKENS - 1, -1):
        response = httpx.post(server.url + CHAT, json=chat(**{field: value}), timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (field, "invalid_value"), error
        assert f"at least {MIN_MAX_TOKENS}" in error["message"], error
    response = httpx.post(server.url + CHAT, json=chat(**{field: max(MIN_MAX_TOKENS, 1)}), timeout=30)
    assert response.status_code == 200, response.text


def test_refused_bodies_reach_no_engine_and_cut_no_stream(server):
    """Every refused body above, sent while another client streams: nothing
    restarts, the stream ends whole, and the next request is served."""
    bystander = {}

    def stream():
        with httpx.Client(timeout=60) as client:
            bystander.update(read_stream(client, server.url + CHAT, chat_body(max_tokens=200, stream=True)))

    before = httpx.get(server.url + "/guardian/status").json()
    thread = threading.Thread(target=stream)
    thread.start()
    with httpx.Client(timeout=30) as client:
        for path, body, _, _ in REFUSED:
            assert client.post(server.url + path, content=json.dumps(body).encode()).status_code == 400
    thread.join(60)
    assert bystander["status"] == 200 and bystander["done"] and not bystander["errors"]
    assert len(bystander["events"]) >= 2
    status = httpx.get(server.url + "/guardian/status").json()
    assert status["restarts"] == before["restarts"] == 0
    assert status["failures_in_window"] == 0
    assert server.events("engine_error") == []


@pytest.mark.parametrize("raw, param", [
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": -Infinity}', "presence_penalty"),
])
def test_non_finite_numbers_are_refused(server, raw, param):
    # Python's JSON parser takes NaN and Infinity, and NaN passes every range check.
    response = httpx.post(server.url + CHAT, content=raw, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_body_nested_past_the_parser_is_invalid_json(server):
    raw = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = httpx.post(server.url + CHAT, content=raw, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"


# Values at the edges that stock serves: the door must let them through.
SERVED = [
    (CHAT, chat(stop="")),
    (CHAT, chat(stop=["\n", "END", "x"])),
    (CHAT, chat(stop=["x" * 256] * 32)),  # at [guardian] max_stop_sequences and max_stop_chars
    (CHAT, chat(stop=None)),
    (CHAT, chat(logit_bias={"0": -100, "999": 100, "5": "2.5"})),
    (CHAT, chat(seed=2**64 - 1)),
    (CHAT, chat(seed=0, temperature=0.7)),
    (CHAT, chat(logprobs=True, top_logprobs=5)),
    (CHAT, chat(max_completion_tokens=3, max_tokens=None)),
    (CHAT, chat(xtc_probability=1, xtc_threshold=0)),  # JSON integers: stock took floats alone
    (TEXT, {"prompt": "a", "max_tokens": 4, "xtc_probability": 0, "xtc_threshold": 1}),
    (CHAT, chat(repetition_penalty=1.2, repetition_context_size=2**31 - 1)),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]}])),
    (CHAT, chat(messages=[{"role": "system", "content": None}, {"role": "user", "content": "x", "name": "bob"}])),
    (CHAT, chat(messages=[{"role": "user", "content": "What is the weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function",
                               "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                          {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}])),
    (CHAT, chat(unknown_field={"anything": [1, 2]}, n=1, user="u-1")),
    (CHAT, chat(model="default_model")),
    (CHAT, chat(draft_model=None, adapters=None)),  # stock's "none", sent by clients that send every field
    # A null is the field left out, as OpenAI takes it: the openai SDK sends temperature=None
    # as null (stock refused it: "temperature must be a number").
    (CHAT, chat(temperature=None, top_p=None, max_tokens=None, presence_penalty=None, frequency_penalty=None,
                seed=None, logit_bias=None, logprobs=None, top_logprobs=None, stream_options=None,
                response_format=None, tools=None, tool_choice=None, n=None, user=None, stream=None)),
    (TEXT, {"prompt": "null", "max_tokens": 4, "temperature": None, "top_k": None, "min_p": None}),
    (CHAT, chat(model=None)),  # the served model, as docs/quickstart.md says (stock: 400)
    # The tokenizer's own arguments at values that leave the prompt a list of tokens.
    (CHAT, chat(chat_template_kwargs={"truncation": False, "padding": "longest", "return_dict": False,
                                      "return_assistant_tokens_mask": False, "max_length": 4096})),
    (CHAT, chat(chat_template_kwargs={"truncation": True, "max_length": 5})),
    (TEXT, {"prompt": "Once upon a time", "max_tokens": 4, "echo": False}),
]


@pytest.mark.parametrize("path, body", SERVED, ids=[f"{p}:{i}" for i, (p, _) in enumerate(SERVED)])
def test_what_stock_serves_is_still_served(server, path, body):
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_stream_options_without_include_usage_ends_the_stream(server):
    # Stock reads stream_options["include_usage"] after the last token: {} cut the stream.
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + CHAT, chat(stream=True, stream_options={}))
    assert result["status"] == 200 and result["done"] and not result["errors"]


def served_model_id(server) -> str:
    models = httpx.get(server.url + "/v1/models").json()["data"]
    return next(m["id"] for m in models if "demo-model" in m["id"])


def test_the_served_model_named_by_its_path_is_served(server):
    response = httpx.post(server.url + CHAT, json=chat(model=served_model_id(server)), timeout=60)
    assert response.status_code == 200, response.text


def test_adapters_beside_the_default_model_follow_stocks_mapping(server, tmp_path):
    response = httpx.post(server.url + CHAT, json=chat(adapters=str(tmp_path / "adapter")), timeout=60)
    if stock.contract.STOCK_VERSION.startswith("0.31."):
        # 0.31 loads the adapter onto the default model: a switch, refused.
        assert response.status_code == 404, response.text
        assert response.json()["error"]["param"] == "adapters"
    else:
        # 0.32 maps default_model to the served adapter and ignores this one.
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("field", ["model", "draft_model", "adapters"])
def test_a_model_the_server_does_not_serve_is_404(server, field, tmp_path):
    # Stock reads adapters only beside a model named by its path.
    body = chat(**{field: str(tmp_path / "other-model")}, **({"model": served_model_id(server)}
                                                              if field == "adapters" else {}))
    response = httpx.post(server.url + CHAT, json=body, timeout=30)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (field, "model_not_found")
    assert f"this server serves `{served_model_id(server)}`" in error["message"]  # the id to send instead
    assert response.headers["x-should-retry"] == "false"
    assert server.events("model_switch_failed") == []  # nothing was loaded


@pytest.mark.parametrize("method, path", [("GET", "/v1/nothing"), ("POST", "/v1/nothing"),
                                          ("DELETE", "/v1/nothing"), ("GET", "/")])
def test_an_unknown_path_is_an_openai_404(server, method, path):
    response = httpx.request(method, server.url + path, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"


@pytest.mark.parametrize("method, path, allowed", [("DELETE", "/v1/chat/completions", "POST, OPTIONS"),
                                                   ("GET", "/v1/completions", "POST, OPTIONS"),
                                                   ("PUT", "/health", "GET, HEAD, OPTIONS")])
def test_a_method_a_path_does_not_take_is_an_openai_405(server, method, path, allowed):
    response = httpx.request(method, server.url + path, timeout=10)
    assert response.status_code == 405 and response.headers["Allow"] == allowed
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_malformed_input_is_logged_without_the_body(server):
    secret = "sk-client-secret-in-a-broken-body"
    response = httpx.post(server.url + CHAT, content=f'{{"messages": "{secret}"'.encode(), timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    rejected = poll(lambda: [e for e in server.events("request_rejected") if e.get("code") == "invalid_json"],
                    5, what="request_rejected invalid_json")
    assert rejected[-1]["level"] == "warning"
    assert secret not in server.log_path.read_text()


# -- flags that can never work ---------------------------------------------------------------
def run_with_flags(*args, model_cache, timeout=90):
    return run_guardian(["--port", str(free_port()), *args], env={"MLX_GUARDIAN_CACHE": str(model_cache)},
                        timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (("--prefill-step-size", "0"), "--prefill-step-size must be at least 1"),
    (("--decode-concurrency", "0"), "--decode-concurrency must be at least 1"),
    (("--temp", "-1"), "--temp must be at least 0"),
    (("--top-p", "1.5"), "--top-p must be between 0 and 1"),
    (("--top-k", "-1"), "--top-k must be at least 0"),
    pytest.param(("--max-tokens", "0"), "--max-tokens must be at least 1", marks=pytest.mark.skipif(
        stock.contract.MIN_MAX_TOKENS == 0, reason="this mlx-lm serves a request of 0 tokens")),
])
def test_a_flag_that_can_never_work_stops_the_server_at_start(model_cache, flags, message):
    result = run_with_flags(*flags, model_cache=model_cache)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr


@pytest.mark.skipif(stock.contract.STOCK_VERSION.startswith("0.31."), reason="mlx-lm 0.31 has no --kv-bits")
def test_kv_bits_that_cannot_quantize_the_heads_stop_the_server(model_cache):
    # The demo model's heads are 16 wide; the default group of 64 cannot divide them.
    result = run_with_flags("--kv-bits", "4", "--quantized-kv-start", "100", model_cache=model_cache)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "head dimension 16" in result.stderr and "--kv-group-size 64" in result.stderr
    assert "--quantized-kv-start 100" in result.stderr


@pytest.mark.skipif(stock.contract.STOCK_VERSION.startswith("0.31."), reason="mlx-lm 0.31 has no --kv-bits")
def test_kv_bits_never_reached_within_the_context_start_the_server(start_server):
    # Stock's default --quantized-kv-start (5000) is past the demo model's 2048-token context:
    # no request that fits ever quantizes, so stock serves every one, and so must the guardian.
    server = start_server("", "--kv-bits", "4")
    response = httpx.post(server.url + CHAT, json=chat(max_tokens=4), timeout=60)
    assert response.status_code == 200, response.text

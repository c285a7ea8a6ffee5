"""What an operator reads: an idle server writes nothing at INFO, a request
writes one line, every line is JSON whichever library wrote it, and each
request's id comes back in ``X-Request-ID`` and is the id on the request's
log lines.

One server for the module (probes every 0.2 s, the default log level); the
idle test runs first, before any request, so no line of another test can
land in its window.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from conftest import REPO, Server, chat_body, free_port, poll, spawn_guardian

COMPLETIONS = "/v1/chat/completions"
PROBES_PER_WINDOW = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_cache):
    folder = tmp_path_factory.mktemp("quiet-logs")
    config = folder / "guardian.toml"
    config.write_text("[watchdog]\nprobe_interval_s = 0.2\n")
    port = free_port()
    log_path = folder / "server.log"
    # Started whole (not forked): what a library prints as it is imported must reach this log too.
    proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config)], log_path, model_cache,
                          fork=False)
    server = Server(proc, port, log_path)
    try:
        server.wait_healthy()
        server.wait_for_event("server_started")
        yield server
    finally:
        server.stop()


def probes_run(server: Server) -> int:
    return httpx.get(server.url + "/guardian/status", timeout=5).json()["probes_run"]


def test_an_idle_server_writes_nothing_per_probe_at_info(server):
    # Past the start-up probe (INFO: the first) before the window opens.
    poll(lambda: probes_run(server) >= 2, 15, what="a second probe")
    lines_before = len(server.logs())
    first = probes_run(server)
    poll(lambda: probes_run(server) >= first + PROBES_PER_WINDOW, 15, interval=0.1,
         what=f"{PROBES_PER_WINDOW} more probes")
    # Neither the probes (stock's four "Prompt Cache" lines each, probe_finished)
    # nor the test's own polls of /guardian/status (http_access) wrote a line.
    assert server.logs()[lines_before:] == []


def test_a_prompt_longer_than_the_tokenizer_knows_is_logged_as_json(server):
    # The demo tokenizer's model_max_length is 2048: transformers warns when
    # admission counts this prompt's tokens, through a handler of its own.
    response = httpx.post(server.url + COMPLETIONS, json=chat_body("hello world " * 1500, max_tokens=2),
                          headers={"X-Request-ID": "over-long-1"}, timeout=60)
    assert response.status_code == 400, response.text
    lines = server.logs()
    assert [line for line in lines if line["event"] == "non_json_line"] == []
    [warning] = [line for line in lines if line.get("logger", "").startswith("transformers")]
    assert "longer than the specified maximum sequence length" in warning["event"]
    assert warning["level"] == "warning" and warning["request_id"] == "over-long-1"


def test_python_warnings_are_json_lines():
    code = ("from guardian.observability.logs import configure_logging; configure_logging('json', 'INFO'); "
            "import warnings; warnings.warn('a library deprecates something')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    [line] = [json.loads(text) for text in result.stderr.splitlines()]
    assert line["logger"] == "py.warnings" and line["level"] == "warning"
    assert "a library deprecates something" in line["event"]


def lines_of(server: Server, request_id: str) -> list[dict]:
    return [line for line in server.logs() if line.get("request_id") == request_id]


def test_the_clients_request_id_is_echoed_and_on_its_log_lines(server):
    # A prompt of its own: a prompt-cache hit would leave stock nothing to log on its thread.
    response = httpx.post(server.url + COMPLETIONS, json=chat_body("Client 42's own prompt.", max_tokens=2),
                          headers={"X-Request-ID": "client-id-42"}, timeout=30)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-id-42"
    # The access line is written as the request ends, just after the answer.
    access = poll(lambda: [line for line in lines_of(server, "client-id-42") if line["event"] == "http_access"],
                  10, what="the request's access line")
    assert '"POST /v1/chat/completions' in access[0]["line"]


def test_a_chat_completion_writes_one_line_at_info(server):
    # Stock's six (prompt-cache tables, prefill progress) are written at DEBUG
    # (test_logs.py: [guardian] stock_request_logs brings them back). Past the
    # start-up probe (INFO), whose line must not land in the window.
    poll(lambda: probes_run(server) >= 2, 15, what="a second probe")
    lines_before = len(server.logs())
    response = httpx.post(server.url + COMPLETIONS, json=chat_body("One line for me, please.", max_tokens=8),
                          headers={"X-Request-ID": "one-line-1"}, timeout=30)
    assert response.status_code == 200
    # The access line is the request's last: once it is there, all of them are.
    poll(lambda: lines_of(server, "one-line-1"), 10, what="the request's access line")
    [line] = server.logs()[lines_before:]
    assert line["event"] == "http_access" and line["request_id"] == "one-line-1"


@pytest.mark.parametrize("given", [None, "has spaces in it", "x" * 200, "-starts-with-a-dash"])
def test_without_a_sane_client_id_the_completion_id_is_the_request_id(server, given):
    headers = {"X-Request-ID": given} if given else {}
    response = httpx.post(server.url + COMPLETIONS, json=chat_body(max_tokens=2, stream=True),
                          headers=headers, timeout=30)
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    assert request_id != given and request_id.startswith("chatcmpl-")
    first_event = json.loads(response.text.split("data: ", 2)[1].split("\n", 1)[0])
    assert first_event["id"] == request_id
    poll(lambda: any(line["event"] == "http_access" for line in lines_of(server, request_id)), 10,
         what="the request's access line")


def test_a_refusal_and_other_paths_echo_the_clients_id(server):
    refused = httpx.post(server.url + COMPLETIONS, content=b"{not json", headers={"X-Request-ID": "refused-7"},
                         timeout=30)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "refused-7"
    with httpx.Client(timeout=10) as client:  # one connection: each request has its own id
        assert client.get(server.url + "/livez", headers={"X-Request-ID": "live-1"}).headers["x-request-id"] == "live-1"
        # Without one, every response still has an id, as OpenAI's do (the openai SDK shows
        # it as an error's request_id): made for it, and named by its access line.
        made = client.get(server.url + "/livez").headers["x-request-id"]
        assert made.startswith("req-") and made != "live-1"
        missing = client.get(server.url + "/v1/nothing-here")
        assert missing.status_code == 404 and missing.headers["x-request-id"].startswith("req-")
        assert missing.headers["x-request-id"] != made
    [line] = poll(lambda: lines_of(server, missing.headers["x-request-id"]), 10, what="the 404's access line")
    assert line["event"] == "http_access" and "/v1/nothing-here" in line["line"]

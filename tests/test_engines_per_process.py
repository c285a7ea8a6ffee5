"""Two guardian engines in one process both serve, and a failure of one spares the other.

Stock's loop finds ``BatchGenerator``, ``stream_generate`` and the sampling
factories in mlx_lm.server's module globals, one set per process. The
guardian swaps them once and routes each call to the engine whose loop runs
on the calling thread; before, a second engine re-pointed them at itself
and the first engine's loop failed its owner check, was abandoned, and its
server gave up (exit 5).

The two servers run in one child process (TWO_SERVERS below), each with its
own model provider, plugin manager and HTTP server, wired by
``guardian.serving.assembly.ServedModel`` as ``serve`` wires one; the first has a planted
fault (fault_injection's ``poison_marker``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import REPO, chat_body, poll, read_stream

POISON = "POISON-FOR-ENGINE-A"

TWO_SERVERS = textwrap.dedent('''
    import json, sys, threading
    from pathlib import Path

    from guardian import stock
    from guardian.config.loading import load_config
    from guardian.observability.logs import configure_logging
    from guardian.plugin_manager import make_plugin_manager
    from guardian.serving.assembly import ServedModel, make_http_server

    model, ports_path, *config_paths = sys.argv[1:]
    configure_logging("json", "INFO")

    def model_provider():
        """Stock's ModelProvider for --model, built by stock's own main()."""
        built = []
        sys.argv = ["mlx-guardian", "--model", model]
        stock.handler.run_stock_main(lambda host, port, provider: built.append(provider),
                                     add_arguments=lambda parser: None, after_parse=lambda namespace: None)
        built[0].load_default()
        return built[0]

    # Both engines exist before either generates: the first one's loop
    # builds its BatchGenerator after the second engine started its loop.
    servers = []
    for name, config_path in zip("ab", config_paths):
        config = load_config(config_path)
        served = ServedModel(model_provider(), config, make_plugin_manager(config),
                          on_exit=lambda code, name=name: print(f"engine {name} asked to exit {code}"))
        servers.append((name, served, make_http_server("127.0.0.1", 0, served)))
    ports = []
    for name, served, httpd in servers:
        served.start()
        threading.Thread(target=httpd.serve_forever, name=f"http-{name}", daemon=True).start()
        ports.append(httpd.server_address[1])
    Path(ports_path).write_text(json.dumps(ports))
    threading.Event().wait()
''')


@pytest.fixture
def two_servers(tmp_path, model_cache):
    from guardian.demo_model import ensure_demo_model

    model = str(ensure_demo_model(model_cache))
    watchdog = "[watchdog]\ninterval_s = 0.05\n"
    configs = {
        "a": watchdog + f'[fault_injection]\nenabled = true\npoison_marker = "{POISON}"\nmessage = "planted poison"\n',
        "b": watchdog,
    }
    paths = []
    for name, text in configs.items():
        path = tmp_path / f"guardian-{name}.toml"
        path.write_text(text)
        paths.append(str(path))
    ports_path = tmp_path / "ports.json"
    log_path = tmp_path / "two-servers.log"
    env = {**os.environ, "MLX_GUARDIAN_CACHE": str(model_cache)}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", TWO_SERVERS, model, str(ports_path), *paths],
                                stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def started():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        return ports_path.exists() and ports_path.read_text()

    try:
        ports = json.loads(poll(started, 120, interval=0.1, what="both servers started"))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            poll(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 200, 60, interval=0.05,
                 what=f"{url}/readyz 200")
        yield proc, urls, log_path
    finally:
        proc.kill()
        proc.wait(timeout=10)


def status(url: str) -> dict:
    return httpx.get(url + "/guardian/status", timeout=5).json()


def events(log_path, name: str) -> list[dict]:
    found = []
    for line in log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == name:
            found.append(event)
    return found


def test_two_engines_in_one_process_both_serve(two_servers):
    proc, (url_a, url_b), log_path = two_servers
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(4) as pool:
        # Both at once, streamed and not: each loop's steps are its own engine's.
        futures = [pool.submit(client.post, url + "/v1/chat/completions", json=chat_body(max_tokens=24))
                   for url in (url_a, url_b)]
        streams = [pool.submit(read_stream, client, url + "/v1/chat/completions",
                               chat_body(max_tokens=24, stream=True)) for url in (url_a, url_b)]
        for future in futures:
            response = future.result()
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 24
        for future in streams:
            result = future.result()
            assert result["status"] == 200 and result["done"] and not result["errors"]
    for url in (url_a, url_b):
        engine = status(url)
        assert engine["state"] == "ready" and engine["restarts"] == 0 and engine["steps"] > 0
    assert proc.poll() is None
    assert events(log_path, "abandoned_loop_exited") == []
    assert events(log_path, "engine_gave_up") == []


def test_steps_are_counted_by_the_engine_that_made_them(two_servers):
    _, (url_a, url_b), _ = two_servers
    steps_a = status(url_a)["steps"]
    response = httpx.post(url_b + "/v1/chat/completions", json=chat_body(max_tokens=32), timeout=60)
    assert response.status_code == 200, response.text
    # B's 32 tokens took B's steps; A, idle, made none (its probes are minutes apart).
    assert status(url_a)["steps"] == steps_a
    assert status(url_b)["steps"] >= 32


def test_a_planted_failure_in_one_engine_does_not_touch_the_other(two_servers):
    proc, (url_a, url_b), log_path = two_servers
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(2) as pool:
        # B streams while A fails on every step of its poison request.
        bystander = pool.submit(read_stream, client, url_b + "/v1/chat/completions",
                                chat_body(max_tokens=200, stream=True))
        poisoned = client.post(url_a + "/v1/chat/completions", json=chat_body(content=POISON, max_tokens=8))
        assert poisoned.status_code == 500, poisoned.text
        assert poisoned.json()["error"]["code"] == "request_failed_repeatedly"
        result = bystander.result()
        assert result["status"] == 200 and result["done"] and not result["errors"]
        assert len(result["events"]) > 1
        # A restarted and serves again; B never noticed.
        poll(lambda: status(url_a)["state"] == "ready", 30, what="engine A ready again")
        assert client.post(url_a + "/v1/chat/completions", json=chat_body(max_tokens=4)).status_code == 200
        assert client.post(url_b + "/v1/chat/completions", json=chat_body(max_tokens=4)).status_code == 200
    engine_a, engine_b = status(url_a), status(url_b)
    assert engine_a["restarts"] >= 1 and engine_a["last_error"]["message"]
    assert engine_b["restarts"] == 0 and engine_b["last_error"] is None
    assert proc.poll() is None
    assert events(log_path, "abandoned_loop_exited") == []

"""Subprocess mode, as an operator reads it: the client's X-Request-ID comes
back through the supervisor and names the child's log lines, and an idle
supervisor and child write nothing at INFO (the supervisor's health checks
of the child and the child's probes are routine, at DEBUG)."""

from __future__ import annotations

import time

import httpx

from conftest import chat_body, poll
from test_supervisor import COMPLETIONS, start_supervisor  # noqa: F401 - a fixture

HEALTH_CHECK_INTERVAL_S = 0.2


def probes_run(url: str) -> int:
    # /guardian/status is the child's, relayed by the supervisor.
    return httpx.get(url + "/guardian/status", timeout=5).json()["probes_run"]


def test_request_ids_pass_through_and_an_idle_pair_is_quiet(start_supervisor, tmp_path):
    config = tmp_path / "guardian.toml"
    config.write_text("[watchdog]\nprobe_interval_s = 0.2\n")
    supervised = start_supervisor("--guardian-config", str(config),
                                  "--supervisor-interval", str(HEALTH_CHECK_INTERVAL_S))
    response = httpx.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=2),
                          headers={"X-Request-ID": "through-the-proxy-1"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "through-the-proxy-1"
    # What the supervisor answers itself carries it too; an unsafe one is not echoed, and the
    # answer has one made for it instead (every response has one).
    livez = httpx.get(supervised.url + "/livez", headers={"X-Request-ID": "the-supervisor-1"}, timeout=5)
    assert livez.status_code == 200 and livez.headers["x-request-id"] == "the-supervisor-1"
    unsafe = httpx.get(supervised.url + "/livez", headers={"X-Request-ID": "two words"}, timeout=5)
    assert unsafe.headers["x-request-id"].startswith("req-")
    poll(lambda: any(line["event"] == "http_access" and line.get("request_id") == "through-the-proxy-1"
                     for line in supervised.logs()), 10, what="the child's access line for the request")

    poll(lambda: probes_run(supervised.url) >= 2, 15, what="a second probe")
    lines_before = len(supervised.logs())
    first, opened = probes_run(supervised.url), time.monotonic()
    poll(lambda: probes_run(supervised.url) >= first + 5, 15, interval=0.1, what="5 more probes")
    # Health checks of the child went on all along (one every 0.2 s).
    assert time.monotonic() - opened > 3 * HEALTH_CHECK_INTERVAL_S
    assert supervised.logs()[lines_before:] == []


def test_the_files_log_level_quiets_the_supervisor_too(start_supervisor, tmp_path):
    """[guardian] log_level wins over --log-level in a guardian; the supervisor read only the flag."""
    config = tmp_path / "guardian.toml"
    config.write_text('[guardian]\nlog_level = "WARNING"\n')
    supervised = start_supervisor("--guardian-config", str(config))
    assert httpx.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=2), timeout=30).status_code == 200
    assert not [line for line in supervised.logs() if line.get("level") == "info"]
    # Live in the supervisor too, as the reference says: it kept the level read at start
    # (its own lines, at INFO, are said only at the new level).
    config.write_text('[guardian]\nlog_level = "INFO"\n')
    [reloaded] = supervised.wait_for_event("supervisor_config_reloaded", timeout=30)
    assert reloaded["changed"] == ["guardian.log_level"], reloaded

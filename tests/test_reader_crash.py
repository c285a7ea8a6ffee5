"""A crash of the HTTP reader (the thread that accepts and reads every request) ends the
process with exit 1, a bug's code, for a service manager to start it again. Before, the
process stayed up deaf: its port accepted connections into the backlog that nobody read,
and systemd's watchdog went on being pinged while the engine was ready. The crash is
planted in the reader's loop by tests/supervisor_hooks/sitecustomize.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from conftest import chat_body
from guardian.exit_codes import EXIT_UNCAUGHT
from test_supervisor import start_supervisor, with_supervisor_hooks  # noqa: F401 - a fixture



def crash_env(armed: Path, where: str) -> dict:
    return with_supervisor_hooks(GUARDIAN_TEST_CRASH_READER_ARMED_BY=str(armed), GUARDIAN_TEST_CRASH_READER_IN=where)


def test_a_crashed_reader_ends_one_process_with_exit_1(start_server, tmp_path):
    armed = tmp_path / "crash-reader"
    server = start_server("[guardian]\nexit_grace_s = 2\n", env=crash_env(armed, "server"))
    assert httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30).status_code == 200
    armed.touch()
    assert server.proc.wait(timeout=30) == EXIT_UNCAUGHT
    [crashed] = server.events("http_reader_crashed")
    assert "planted in the HTTP reader" in str(crashed)
    [stopped] = server.events("server_stopped")
    assert stopped["exit_code"] == EXIT_UNCAUGHT


@pytest.mark.subprocess_mode
def test_a_crashed_reader_ends_the_supervisor_and_its_child_with_exit_1(start_supervisor, tmp_path):
    armed = tmp_path / "crash-reader"
    supervised = start_supervisor(env=crash_env(armed, "supervisor"))
    child_pid = supervised.wait_ready()
    assert httpx.post(supervised.url + "/v1/chat/completions", json=chat_body(max_tokens=2),
                      timeout=30).status_code == 200
    armed.touch()
    assert supervised.proc.wait(timeout=60) == EXIT_UNCAUGHT
    assert len(supervised.events("http_reader_crashed")) == 1  # the supervisor's; the child's reader lives
    # The child was stopped as at a SIGTERM, not left behind.
    [exited] = supervised.supervisor_events("child_exited")
    assert exited["pid"] == child_pid and "the supervisor's HTTP reader crashed" in exited["reason"]
    [stopped] = supervised.supervisor_events("supervisor_stopped")
    assert stopped["exit_code"] == EXIT_UNCAUGHT

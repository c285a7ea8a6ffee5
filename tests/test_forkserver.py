"""The fork server the tests start their servers from (tests/forkserver.py) behaves as
``subprocess`` does for what the tests use: exit statuses, signals, ``poll``."""

from __future__ import annotations

import signal

import pytest

import forkserver
from conftest import free_port, poll, spawn_guardian

pytestmark = [pytest.mark.one_version,
              pytest.mark.skipif(not forkserver.enabled(), reason="the fork server is Linux's, and turned on")]


def test_a_forked_server_exits_signals_and_polls_as_a_subprocess_would(tmp_path, model_cache):
    helped = spawn_guardian(["--help"], tmp_path / "help.log", model_cache)
    assert isinstance(helped, forkserver.ForkedProcess)
    assert helped.wait(timeout=30) == 0
    assert "--guardian-config" in (tmp_path / "help.log").read_text()  # its output reached its own log
    assert spawn_guardian(["--no-such-flag"], tmp_path / "usage.log", model_cache).wait(timeout=30) == 2

    server = spawn_guardian(["--port", str(free_port())], tmp_path / "server.log", model_cache)
    poll(lambda: "server_started" in (tmp_path / "server.log").read_text(), 30, what="the server started")
    assert server.poll() is None and server.returncode is None
    server.send_signal(signal.SIGKILL)
    # Ended, told at once: poll waits for the fork server's word of a zombie.
    assert poll(lambda: server.poll() is not None, 5, what="the kill seen") and server.returncode == -signal.SIGKILL
    server.send_signal(signal.SIGTERM)  # an ended process takes no signal, and no error
    assert server.wait(timeout=1) == -signal.SIGKILL

"""Subprocess mode and the live configuration: SIGHUP to the supervisor reaches the child.

The supervisor passes --guardian-config to its child, which watches the
file itself; a SIGHUP to the supervisor (what `systemctl reload` sends) is
forwarded to the child, which re-reads the file, and nobody restarts.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from conftest import poll
from test_supervisor import start_supervisor  # noqa: F401 - a fixture

pytestmark = pytest.mark.one_version


def test_sighup_to_the_supervisor_makes_the_child_reread_its_file(start_supervisor, tmp_path):
    config = tmp_path / "guardian.toml"
    config.write_text("[prompt_guard]\nmax_prompt_tokens = 0\n")
    supervised = start_supervisor("--guardian-config", str(config))
    child_pid = supervised.wait_ready()

    def child_config() -> dict:
        return httpx.get(supervised.url + "/guardian/status", timeout=5).json()["config"]

    loads = child_config()["loads"]
    supervised.proc.send_signal(signal.SIGHUP)
    poll(lambda: child_config()["loads"] == loads + 1, 15, what="the child's reload")
    assert child_config()["reason"] == "sighup"
    [forwarded] = supervised.supervisor_events("signal_forwarded")
    assert forwarded["pid"] == child_pid and forwarded["signal"] == "SIGHUP"
    # Nobody was restarted: the same supervisor, the same child.
    assert supervised.proc.poll() is None
    assert supervised.wait_ready() == child_pid
    assert not supervised.supervisor_events("child_exited")

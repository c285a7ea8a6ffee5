"""Readiness before the first probe has generated a token.

The README (the watchdog, systemd): mlx-guardian writes ``READY=1`` "once
the model is loaded and the first probe generated a token", and tests wait
for ``/readyz`` as proof that "the start-up probe passed". Here the very
first engine step, the start-up probe's, never returns.
"""

from __future__ import annotations

import pytest

from conftest import poll

FIRST_STEP_HANGS = ("[fault_injection]\nenabled = true\nhang_at_step = 1\n"
                    "[watchdog]\ninterval_s = 0.05\nstall_timeout_s = 120\nprobe_timeout_s = 2.0\n")


@pytest.mark.xfail(strict=True, reason=(
    "BUG: while the start-up probe's step hangs, the probe itself is work in flight and the "
    "heartbeat was set when the step began, so Watchdog.progressing() calls it 'generating': "
    "/readyz answers 200 and READY=1 goes to systemd for up to probe_timeout_s (10 s by default) "
    "before any token was generated. A supervisor's start check sees that 200, marks the child "
    "ready, and --supervisor-start-timeout never applies (it waits --supervisor-unhealthy-after "
    "instead). Synthetic probes should not count as visible progress, nor should a heartbeat "
    "from a step that has not returned."))
def test_not_ready_until_the_first_probe_generated(start_server, notify_receiver):
    server = start_server(FIRST_STEP_HANGS, wait=False, env={"NOTIFY_SOCKET": notify_receiver.address})
    server.wait_for_event("fault_injected", timeout=60)
    statuses = set()

    def probe_over():
        statuses.add(server.status("/readyz"))
        notify_receiver.received("READY=1")
        return server.events("probe_finished")

    [probe] = poll(probe_over, 30, interval=0.01, what="the start-up probe's deadline")
    assert not probe["ok"]
    assert 200 not in statuses, "/readyz said ready before any token was generated"
    assert "READY=1" not in notify_receiver.messages

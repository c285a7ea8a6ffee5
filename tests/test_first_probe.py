"""Readiness before the first probe has generated a token.

docs/deploy.md (systemd and launchd): mlx-guardian writes ``READY=1`` "once
the model is loaded and the first probe generated a token", and tests wait
for ``/readyz`` as proof that "the start-up probe passed". Here the very
first engine step, the start-up probe's, never returns. Before the fix,
the probe in flight counted as visible progress (the heartbeat is set when
a step begins): /readyz said 200 "generating" and READY=1 went out for up
to probe_timeout_s before any token was generated, so a supervisor marked
the child ready and its start timeout never applied.
"""

from __future__ import annotations

import httpx

from conftest import poll

FIRST_STEP_HANGS = ("[fault_injection]\nenabled = true\nhang_at_step = 1\n"
                    "[watchdog]\ninterval_s = 0.05\nstall_timeout_s = 120\nprobe_timeout_s = 2.0\n")


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
    # The probe was cancelled at its deadline: no client left (each failed probe was one).
    status = httpx.get(server.url + "/guardian/status", timeout=5).json()
    assert status["requests_cancelled"] == {"client_left": 0, "deadline": 0}

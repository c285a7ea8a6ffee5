"""How one process stops: SIGTERM or SIGINT drains the requests in flight for up to
``[guardian] exit_grace_s``, with the watchdog still at work; what is left at the end is
answered (503, or a stream's error event), not cut by the exit; a second signal a second
or more later ends the drain; a failure of the engine during it is the exit code.
(The supervisor's own stop: tests/test_supervisor_signals.py.) The slow steps, hangs and
failures are planted inside stock's own ``BatchGenerator.next``
(tests/plugins/stock_step_faults.py), where real ones happen."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from conftest import arm, chat_body, pace, poll, read_stream, scraped
from guardian.exit_codes import EXIT_ENGINE_FAILED, EXIT_OK
from guardian.serving.exit_request import SAME_STOP_S

pytestmark = [pytest.mark.one_version]  # signals and the drain: nothing of mlx-lm's version

COMPLETIONS = "/v1/chat/completions"
STEP_FAULTS = '[guardian]\nplugins = ["tests.plugins.stock_step_faults:StockStepFaults"]\n'
# Each of stock's steps 20 ms longer: an 800-token request takes 16 s.
SLOW_STEPS = STEP_FAULTS + "[stock_step_faults]\ndelay_s = 0.02\n"


class InFlight:
    """A streaming and a non-streaming request, each on a thread of its own."""

    def __init__(self, server, max_tokens: int, content: str = "Tell me a story."):
        self.results: dict = {}
        self.content = content
        self.threads = [threading.Thread(target=self._stream, args=(server, max_tokens), daemon=True),
                        threading.Thread(target=self._post, args=(server, max_tokens), daemon=True)]
        for thread in self.threads:
            thread.start()

    def _stream(self, server, max_tokens):
        with httpx.Client(timeout=60) as client:
            self.results["stream"] = read_stream(client, server.url + COMPLETIONS,
                                                 chat_body(self.content, max_tokens=max_tokens, stream=True))

    def _post(self, server, max_tokens):
        try:
            with httpx.Client(timeout=60) as client:
                self.results["answer"] = client.post(server.url + COMPLETIONS, json=chat_body(self.content, max_tokens=max_tokens))
        except httpx.TransportError as e:
            self.results["answer"] = e

    def join(self) -> dict:
        for thread in self.threads:
            thread.join(timeout=30)
        return self.results


def with_the_engine(server) -> int:
    status = httpx.get(server.url + "/guardian/status", timeout=5).json()
    return status["in_flight"] + status["queued"]


def both_generating(server) -> bool:
    return scraped(server, "mlx_guardian_requests_in_flight") == 2


def test_requests_still_in_flight_when_the_drain_ends_are_answered_not_cut(start_server):
    """They got a connection closed by the exit: a stream ended with no error event, no
    finish_reason and no [DONE] (an answer cut short that reads as whole), a non-streaming
    request no status at all. Under --supervise the supervisor answered them."""
    server = start_server(SLOW_STEPS.replace("[guardian]\n", "[guardian]\nexit_grace_s = 2.0\n"))
    in_flight = InFlight(server, max_tokens=800)
    poll(lambda: both_generating(server), 20, what="both requests generating")
    server.proc.send_signal(signal.SIGTERM)
    # Taken out of a load balancer's rotation by either health path, as under --supervise;
    # alive all the same.
    poll(lambda: server.status("/health") == 503, 5, interval=0.05, what="/health 503 in the drain")
    assert httpx.get(server.url + "/health", timeout=5).json()["reason"] == "the server is stopping"
    assert server.status("/readyz") == 503 and server.status("/livez") == 200
    assert server.proc.wait(timeout=20) == EXIT_OK
    results = in_flight.join()
    stream, answer = results["stream"], results["answer"]
    assert stream["status"] == 200 and stream["done"], stream
    assert stream["errors"] and stream["errors"][-1]["code"] == "server_stopping", stream["errors"]
    assert isinstance(answer, httpx.Response), answer
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_stopping"
    assert answer.headers["retry-after"] == "1"
    # The log says which requests the grace ended on, where each stood, and where the loop was.
    [timed_out] = server.events("drain_timed_out")
    assert timed_out["grace_s"] == 2.0 and timed_out["requests_in_flight"] == 2, timed_out
    assert sorted(r["stage"] for r in timed_out["unfinished"]) == ["started", "streaming"], timed_out
    assert all(r["tokens"] > 0 and not r["probe"] for r in timed_out["unfinished"]), timed_out
    assert timed_out["loop_stack"], timed_out
    # And where the connection layer's thread was, and that it ran the deadlines' timers on time.
    assert timed_out["reader_stack"] and timed_out["reader_timers_overdue_s"] < 1.0, timed_out


def test_a_hang_during_the_drain_is_recovered_as_at_any_time(start_server):
    """SIGTERM switched the watchdog off: a hang in the drain was never seen, and the
    requests waited out exit_grace_s (15 s), then were cut by the exit."""
    server = start_server(SLOW_STEPS.replace("[guardian]\n", "[guardian]\nexit_grace_s = 15.0\n")
                          + "hang_at_call = 30\n")
    in_flight = InFlight(server, max_tokens=60)
    server.wait_for_event("stock_step_hang")
    poll(lambda: with_the_engine(server) == 2, 10, what="both requests with the engine, hung or queued")
    server.proc.send_signal(signal.SIGTERM)
    stopping_at = time.monotonic()
    assert server.proc.wait(timeout=30) == EXIT_OK
    print(f"\nmeasured: exit {time.monotonic() - stopping_at:.2f} s after SIGTERM")
    results = in_flight.join()
    assert results["stream"]["status"] == 200 and results["stream"]["done"] and not results["stream"]["errors"]
    assert results["answer"].status_code == 200, results["answer"]
    events = [e["event"] for e in server.logs()]
    assert "engine_stalled" in events[events.index("server_stopping"):]


def test_an_engine_that_gives_up_during_the_drain_exits_with_its_code_not_0(start_server, tmp_path):
    """The give-up (exit 4) came during the drain, and the process exited 0, as the SIGTERM
    before it asked: a service manager does not restart a clean stop."""
    # Stock's step fails at every prefill, and each request is run again, never blamed (as
    # a broken engine fails everything): the engine gives up after its backoff waits.
    armed = tmp_path / "armed"
    server = start_server(f"""
        [guardian]
        plugins = ["tests.plugins.stock_step_faults:StockStepFaults"]
        exit_grace_s = 30.0
        [stock_step_faults]
        raise_message = "planted in stock's step"
        armed_by = "{armed}"
        [recovery]
        max_reruns = 100
        reload_after_failures = 0
    """)
    arm(armed, 1000)  # once serving: its first probe has passed
    in_flight = InFlight(server, max_tokens=50)
    server.wait_for_event("engine_backoff")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == EXIT_ENGINE_FAILED
    [gave_up] = server.events("engine_gave_up")
    assert gave_up["exit_code"] == EXIT_ENGINE_FAILED
    [stopped] = server.events("server_stopped")
    assert stopped["exit_code"] == EXIT_ENGINE_FAILED
    # Each answered: an error (event), or a 503 for one that came after the SIGTERM.
    results = in_flight.join()
    assert results["stream"]["errors"] or results["stream"]["status"] == 503, results["stream"]
    assert isinstance(results["answer"], httpx.Response) and results["answer"].status_code >= 500


def test_a_second_stop_signal_ends_the_drain_and_one_at_the_same_moment_does_not(start_server):
    """A person's second Ctrl-C while a long request drains ends the process at once, as
    the supervisor's second signal does; a SIGTERM that comes with the first (a supervisor or
    mlx.launch passing on a terminal's Ctrl-C) is the same stop, and the drain goes on."""
    # The engine hangs under the request, and the watchdog is slow to see it: the drain
    # would wait for it up to 60 s.
    server = start_server("""
        [guardian]
        plugins = ["tests.plugins.stock_step_faults:StockStepFaults"]
        exit_grace_s = 60
        [stock_step_faults]
        hang_at_call = 8
        [watchdog]
        stall_timeout_s = 120
    """)
    in_flight = InFlight(server, max_tokens=32)
    server.wait_for_event("stock_step_hang")
    poll(lambda: with_the_engine(server) == 2, 10, what="both requests with the engine, hung or queued")
    server.proc.send_signal(signal.SIGINT)
    server.proc.send_signal(signal.SIGTERM)
    server.wait_for_event("server_stopping")
    pace(SAME_STOP_S)
    assert server.proc.poll() is None and not server.events("drain_cut_short")
    server.proc.send_signal(signal.SIGINT)
    second_at = time.monotonic()
    assert server.proc.wait(timeout=20) == EXIT_OK
    print(f"\nmeasured: exit {time.monotonic() - second_at:.2f} s after the second SIGINT")
    [cut] = server.events("drain_cut_short")
    assert cut["requests_in_flight"] == 2 and cut["seconds_left"] > 30
    # What was left is answered, as at the drain's end: the one the engine hung under, and
    # the one queued behind it (whichever came first: a stream still queued has sent no
    # headers, and gets its 503 as the other does; a CI run had the stream queued).
    results = in_flight.join()
    stream = results["stream"]
    errors = stream["errors"] if stream["status"] == 200 else [stream["body"]["error"]]
    assert errors and errors[-1]["code"] == "server_stopping", stream
    assert results["answer"].status_code == 503

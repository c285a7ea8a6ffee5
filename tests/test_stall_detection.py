"""Stalls seen in seconds: the stall limit follows the engine's own pace.

At default settings a step that never returns is reported within 5 s (the
issue's goal; the limit's floor is 3 s), while steps that are slow but return
(a slow model, a big model's prefill chunks, a first step that compiles
kernels) raise no false alarm. Hangs are planted with the fault-injection
plugin (the guardian's step hook) and, from outside the guardian, inside
stock's own ``BatchGenerator.next`` (tests/plugins/stock_step_faults.py).

The tests whose faults are slow steps and the [watchdog] settings they need
(all live) share one server (``slowed_server``), armed by a save of its file at
each test's start, and none waits for a start-up probe run at the slow pace. A
test whose fault is bound at start (a process's Nth step, a new loop's first
step, a plugin's hang) keeps a server of its own.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import httpx
import pytest

from conftest import SharedServer, chat_body, poll, read_stream, stamp

STEP_FAULTS = '[guardian]\nplugins = ["tests.plugins.stock_step_faults:StockStepFaults"]\n'
GOAL_S = 5.0  # issue 11: a step that never returns is reported within 5 s


def keys(**settings) -> str:
    def toml(value):
        return str(value).lower() if isinstance(value, bool) else repr(value)

    return "".join(f"{k} = {toml(v)}\n" for k, v in settings.items())


def table(name: str, **settings) -> str:
    return f"[{name}]\n" + keys(**settings)


def abandoned_loops(server) -> int:
    return httpx.get(server.url + "/guardian/status").json()["abandoned_loop_threads"]


def post_all(server, bodies: list[dict], timeout: float = 120) -> list[httpx.Response]:
    """Send every body at once, each on its own connection; the responses in order."""
    responses: list = [None] * len(bodies)

    def send(i):
        with httpx.Client(timeout=timeout) as client:
            responses[i] = client.post(server.url + "/v1/chat/completions", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return responses


# The shared server: stock's step wrapped (nothing planted until a save),
# fault injection armable, 32-token prefill chunks (a short chat is one chunk).
# No idle probe in its life: a probe's steps would take a test's slow steps or
# its armed slow token, and a server of each test's own never lived the 30 s
# to its first. Its tests' stalls add up abandoned loops: no cap, so none
# takes the exit rung for the others'.
SHARED_ARGS = ("--prefill-step-size", "32")
SHARED_WATCHDOG = dict(probe_interval_s=600.0, max_abandoned_loops=0)


def shared_config(step_faults: dict, faults: dict, watchdog: dict, core: Optional[dict] = None) -> str:
    return (STEP_FAULTS + keys(**(core or {})) + table("stock_step_faults", **step_faults)
            + table("fault_injection", armable=True, enabled=bool(faults), **faults)
            + table("watchdog", **{**SHARED_WATCHDOG, **watchdog}))


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, model_cache):
    server = SharedServer(tmp_path_factory.mktemp("stall-detection"), model_cache,
                          shared_config({}, {}, {}), *SHARED_ARGS)
    yield server
    server.stop()


@pytest.fixture
def slowed_server(shared_server):
    """``slowed_server(step_faults={...}, faults={...}, watchdog={...}, core={...})``: the
    shared server running these faults and settings; all off again after the test, and
    the server checked healthy (bounded) for the next one."""
    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy")

    def configure(step_faults: Optional[dict] = None, faults: Optional[dict] = None,
                  watchdog: Optional[dict] = None, core: Optional[dict] = None) -> SharedServer:
        return shared_server.configure(shared_config(step_faults or {}, faults or {}, watchdog or {}, core))

    yield configure
    shared_server.configure(shared_config({}, {}, {}))
    poll(shared_server.alive, 30, interval=0.1, what="the shared server healthy after the test")


class LimitRecorder:
    """Polls /guardian/status in the background; keeps every stall limit seen while busy."""

    def __init__(self, server):
        self.server = server
        self.limits: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.1):
                try:
                    status = client.get(self.server.url + "/guardian/status").json()
                except httpx.TransportError:
                    continue
                if status["in_flight"]:
                    self.limits.append(status["stall_limit_s"])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


def test_hang_inside_stocks_step_is_reported_within_5_s_and_every_request_served(start_server):
    # Defaults but the fault: stock's own step blocks forever at its 120th call,
    # while 8 requests decode (each wants 256 tokens, so few if any have finished).
    server = start_server(STEP_FAULTS + table("stock_step_faults", hang_at_call=120))
    bodies = [chat_body(content=f"Tell me story {i}.", max_tokens=256) for i in range(8)]
    responses = post_all(server, bodies)
    [hang] = server.events("stock_step_hang")
    [stalled] = server.events("engine_stalled")
    detected_s = stamp(stalled) - stamp(hang)
    print(f"\nmeasured: stall reported {detected_s:.2f} s after stock's step blocked "
          f"(heartbeat age {stalled['heartbeat_age_s']} s)")
    assert detected_s <= GOAL_S
    assert stalled["heartbeat_age_s"] <= GOAL_S
    assert stalled["action"] == "restart" and stalled["in_flight"] >= 1
    # Where the stuck loop thread was: in stock's step (the planted wait inside it).
    assert any(frame.startswith("plugins/stock_step_faults.py:") and frame.endswith(" in next")
               for frame in stalled["stuck_at"]), stalled["stuck_at"]
    # The replacement loop served every request the stuck one held.
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] > 0
    server.wait_for_event("engine_restarted")
    assert len(server.events("engine_stalled")) == 1


def test_hang_in_the_step_hook_is_reported_within_5_s(start_server):
    # The fault-injection plugin's hang, at defaults: a stream that has sent tokens.
    server = start_server(table("fault_injection", enabled=True, hang_at_step=40))
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + "/v1/chat/completions", chat_body(max_tokens=200, stream=True))
    assert result["status"] == 200 and result["done"]
    [hang] = [e for e in server.events("fault_injected") if e["kind"] == "hang"]
    [stalled] = server.events("engine_stalled")
    detected_s = stamp(stalled) - stamp(hang)
    print(f"\nmeasured: stall reported {detected_s:.2f} s after the step hook blocked")
    assert detected_s <= GOAL_S
    poll(lambda: server.status("/readyz") == 200, 15, what="ready again")


def test_a_slow_model_is_not_a_stall(slowed_server):
    # Every step 1.5 s: half the 3 s floor, yet the limit follows the pace (4 x 1.5 s).
    server = slowed_server(faults=dict(step_delay_s=1.5))
    # The pace known first, from slow steps (a server of its own had its
    # start-up probe's): a request that arrives is judged by it at once.
    with httpx.Client(timeout=120) as client:
        assert client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=1)).status_code == 200
    with LimitRecorder(server) as recorder, httpx.Client(timeout=120) as client:
        response = client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4))
    assert response.status_code == 200, response.text
    assert server.events("engine_stalled") == []
    known = [limit for limit in recorder.limits if limit < 30]
    assert known and min(known) >= 4 * 1.4, recorder.limits


def test_a_long_prefill_of_slow_chunks_is_not_a_stall(slowed_server):
    # After fast steps, a long prompt whose every 32-token chunk takes 2 s (a big
    # model's prefill) under a 1.5 s floor: a fixed limit at the floor would fire
    # at the first chunk. The request's first chunks are judged by
    # stall_timeout_s (their size is unknown to the watchdog), the next ones by
    # those. (Scaled down from 4 s chunks and the 3 s default floor: the same
    # proof in a quarter of the time.)
    chunk_s, floor_s = 2.0, 1.5
    server = slowed_server(step_faults=dict(prefill_delay_s=chunk_s),
                           watchdog=dict(stall_min_s=floor_s,
                                         # A probe's prefill would be slow too: give it time.
                                         probe_timeout_s=30.0,
                                         # A short memory (~2 s of looks): slow steps age out sooner.
                                         pace_samples=8))
    # No slow step is in the pace (an earlier test's have aged out); idle looks remain.
    poll(lambda: (httpx.get(server.url + "/guardian/status").json()["longest_recent_gap_s"] or 9) < 1.0,
         30, interval=0.2, what="a fast pace")
    with LimitRecorder(server) as recorder, httpx.Client(timeout=120) as client:
        started = time.monotonic()
        response = client.post(server.url + "/v1/chat/completions",
                               json=chat_body(content="word " * 50, max_tokens=2))
        elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert elapsed > 3 * chunk_s, "the prefill should have taken several slow chunks"
    assert server.events("engine_stalled") == []
    # The later chunks were judged by the first ones: near 4 x the chunk, not the 30 s ceiling.
    assert any(4 * chunk_s <= limit < 30 for limit in recorder.limits), recorder.limits


def test_a_slow_first_step_after_start_and_after_a_restart_is_not_a_stall(start_server):
    # Every new BatchGenerator's first step takes 2.5 s (mlx compiling kernels):
    # at start (the start-up probe's) and after the engine fails and its loop
    # runs again (the re-run request's). Nothing is known of a new loop yet: it
    # is judged by stall_timeout_s, not by the 1 s floor nor the old loop's fast
    # pace. (Scaled down from 6 s steps and the 3 s default floor: the same proof
    # in less than half the time.)
    config = (STEP_FAULTS + table("stock_step_faults", first_call_delay_s=2.5)
              + table("fault_injection", enabled=True, at_step=20)
              + table("watchdog", stall_min_s=1.0))
    server = start_server(config)
    with httpx.Client(timeout=120) as client:
        response = client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=64))
    assert response.status_code == 200, response.text
    server.wait_for_event("engine_restarted")
    slow_first_steps = server.events("stock_step_slow_first_call")
    assert len(slow_first_steps) >= 2  # the start-up probe's, and the re-run's after the restart
    assert stamp(slow_first_steps[-1]) > stamp(server.events("engine_error")[0])
    assert server.events("engine_stalled") == []


def test_a_new_kind_of_requests_first_token_may_compile_kernels_and_is_not_a_stall(slowed_server, tmp_path):
    # mlx compiles a sampler's kernels when it samples its first token, steps
    # after the prompt's: on CUDA with a cold kernel cache that took 25 s, and a
    # stock test's first sampled request was stalled, restarted and blamed.
    # Here a prompt's chunks take 0.3 s each (several steps go by, the pace is
    # known: ~1.2 s), then the step returning its first token takes 2.5 s: for
    # a kind of request (its samplers) that never produced a token, not a
    # stall; for a kind that did (kernels compiled), a stall as before.
    armed = tmp_path / "slow-token"
    # Prompts of several chunks (32 tokens each): steps go by before the first token is sampled.
    server = slowed_server(step_faults=dict(token_delay_s=2.5, token_delay_armed_by=str(armed),
                                            prefill_delay_s=0.3),
                           # A short memory of the pace: the slow step is forgotten in ~1 s.
                           watchdog=dict(stall_min_s=1.0, pace_samples=4))

    def fast_pace():
        return (httpx.get(server.url + "/guardian/status").json()["longest_recent_gap_s"] or 9) < 0.5

    poll(fast_pace, 30, interval=0.2, what="a fast pace")
    abandoned_before = abandoned_loops(server)
    sampled = {"temperature": 0.7, "top_p": 0.9}
    with httpx.Client(timeout=120) as client:
        armed.touch()
        response = client.post(server.url + "/v1/chat/completions",
                               json=chat_body("word " * 60, max_tokens=4, **sampled))
        assert response.status_code == 200, response.text
        assert len(server.events("stock_step_slow_token")) == 1
        assert server.events("engine_stalled") == []
        poll(fast_pace, 30, interval=0.2, what="a fast pace again")
        armed.touch()
        # A longer prompt (~370 tokens, ~11 chunks): its stall is judged only once two steps
        # went by after the watchdog first saw it waiting, and on a loaded machine a look may
        # come late. With ~190 tokens a clean clone's run (0.31.3 lane) once saw no stall here,
        # its server log lost; this margin is the likeliest mend, not a proven one.
        response = client.post(server.url + "/v1/chat/completions",
                               json=chat_body("other " * 120, max_tokens=4, **sampled))
    assert response.status_code == 200, response.text  # re-run on the new loop
    assert len(server.events("stock_step_slow_token")) == 2
    [stalled] = server.events("engine_stalled")
    assert stalled["heartbeat_age_s"] < 2.5
    # The stalled thread's slow step returns beside the new loop. It unwinds only
    # once the live loop, between two steps, lets it go, and it never ends: on
    # CUDA the two threads' work interleaving killed the process.
    [let_go] = server.wait_for_event("abandoned_loop_let_go", timeout=30)
    [left] = server.wait_for_event("abandoned_loop_exited", timeout=30)
    assert left["parked"] and left["steps"] == let_go["steps"], (let_go, left)
    assert stamp(let_go) <= stamp(left)
    assert abandoned_loops(server) == abandoned_before + 1  # the shared server's other tests' too
    with httpx.Client(timeout=60) as client:
        response = client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4, **sampled))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("late_step", ["raises", "returns past the wait"])
def test_a_late_step_unwinding_frees_its_batch_and_the_loop_waiting_for_it_is_no_stall(slowed_server, tmp_path,
                                                                                       late_step):
    # A stall abandons a loop; its step returns (or raises) once the replacement
    # decodes the stream it re-ran. The old thread unwinds while the live loop waits (at most
    # unwind_timeout_s, 5 s), and here the stuck step's responses take 3 s to free, past the
    # ~1-2 s stall limit. The waiting loop is alive: no second stall, no failure counted
    # on its stream, which ends whole. And the abandoned loop's batch (its KV
    # caches) is freed as it unwinds: parked with stock's frames held by its
    # exception, the thread kept it for good. A step that returns late is tried with a 1 s
    # unwind_timeout_s: past it, the live loop goes on decoding while the old thread unwinds.
    past_the_wait = late_step == "returns past the wait"
    armed, released = tmp_path / "slow-token", tmp_path / "slow-token-returns"
    server = slowed_server(step_faults=dict(token_delay_s=30.0, token_delay_armed_by=str(armed),
                                            token_delay_released_by=str(released), unwind_delay_s=3.0,
                                            delay_s=0.01, prefill_delay_s=0.3,
                                            token_delay_raises="late" if late_step == "raises" else ""),
                           watchdog=dict(stall_min_s=1.0, pace_samples=4,
                                         **(dict(unwind_timeout_s=1.0) if past_the_wait else {})))

    def fast_pace():
        return (httpx.get(server.url + "/guardian/status").json()["longest_recent_gap_s"] or 9) < 0.5

    # A prompt of several slow chunks: steps go by before its first token (a
    # stall of a request without a token is judged only then); then ~400 steps
    # of 10 ms or more, decoding still while the stuck step's responses are freed.
    # (A prompt of its own: one the prompt cache holds skips its prefill.)
    body = chat_body(f"{late_step} word " * 30, max_tokens=400, stream=True)
    stream: dict = {"lines": []}

    def read():
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
                stream["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        stream["lines"].append((time.time(), line[len("data: "):]))

    with httpx.Client(timeout=120) as client:
        assert client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=8)).status_code == 200
    poll(fast_pace, 30, interval=0.2, what="a fast pace")
    abandoned_before = abandoned_loops(server)
    armed.touch()
    reader = threading.Thread(target=read)
    reader.start()
    try:
        [stalled] = server.wait_for_event("engine_stalled", timeout=30)
        poll(lambda: len(stream["lines"]) >= 20, 30, interval=0.05, what="the re-run decoding on the new loop")
    finally:
        released.touch()
    [slow] = server.events("stock_step_slow_token")
    [freed] = server.wait_for_event("stock_step_slow_token_batch_freed", timeout=30)
    reader.join(timeout=120)
    assert freed["call"] == slow["call"]
    [freeing] = server.events("stock_step_responses_freeing")
    [let_go] = server.events("abandoned_loop_let_go")
    [left] = server.wait_for_event("abandoned_loop_exited", timeout=30)
    # Freed by the abandoned thread, while the live loop waited through its unwinding.
    assert freeing["thread"] == left["thread"]
    assert stamp(let_go) <= min(stamp(freeing), stamp(freed)), (let_go, freeing, freed)
    assert max(stamp(freeing), stamp(freed)) <= stamp(left), (freeing, freed, left)
    assert stamp(left) - stamp(freeing) >= 2.5
    assert stream["lines"][-1][0] > stamp(left)  # the stream was still decoding: work in flight all along
    assert stream["status"] == 200 and stream["lines"][-1][1] == "[DONE]", stream["lines"][-3:]
    assert not [data for _, data in stream["lines"] if '"error"' in data]
    assert len(server.events("engine_stalled")) == 1, server.events("engine_stalled")
    assert server.events("engine_error") == []  # a late raise is the abandoned loop's, no failure's
    assert stalled["in_flight"] == 1
    if past_the_wait:
        [slow_to_leave] = server.events("abandoned_loop_slow_to_leave")
        assert slow_to_leave["timeout_s"] == 1.0
        assert stamp(let_go) + 0.95 <= stamp(slow_to_leave) < stamp(left), (let_go, slow_to_leave, left)
        # The live loop went on while the old thread still unwound.
        assert [at for at, _ in stream["lines"] if stamp(slow_to_leave) < at < stamp(left)]
    else:
        assert server.events("abandoned_loop_slow_to_leave") == []
    assert abandoned_loops(server) == abandoned_before + 1


def test_a_replacement_loop_is_judged_by_its_own_silence(start_server):
    # The loop that replaces a stuck one never asks for work (its start blocks):
    # its probe fails after probe_timeout_s, and the stall it reports is that
    # loop's own silence, not the stuck loop's added to it (was 3 + 2 s here).
    # (Scaled down from a 5 s stall and a 4 s probe: the wrong sum, 5 s, is still
    # past the bound below, with the same 2 s of slack for the right one.)
    stall_s, probe_s = 3.0, 2.0
    config = (table("guardian", plugins=["tests.plugins.loop_faults:LoopFaults"])
              + table("loop_faults", hang_loop_start=2)
              + table("fault_injection", enabled=True, hang_at_step=40)
              + table("watchdog", stall_timeout_s=stall_s, stall_min_s=stall_s, probe_timeout_s=probe_s))
    server = start_server(config)
    # The client waits through both stalls: a client that leaves takes its request
    # with it (guardian.serving.connection), and with no work waiting there is no stall to see.
    with httpx.Client(timeout=20) as client:
        try:
            client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=200))
        except httpx.TimeoutException:
            pass  # the loop that would serve it never starts
    first, second = server.wait_for_event("engine_stalled", timeout=30, count=2)[:2]
    assert first["heartbeat_age_s"] >= stall_s
    assert "failed its probe" in second["reason"]
    assert second["heartbeat_age_s"] < probe_s + 2.0, second


def test_a_continuation_prefilling_after_other_steps_gets_a_first_prefill_chunks_allowance():
    """A continuation after a failure holds its tokens and prefills them again. Judged as a
    request past its prefill, its first chunk (whose length the watchdog cannot see) got
    the pace of the steps before it: when it ran after others (the proof probe's decode,
    a suspect's turn alone), a big model's 2048-token chunk took seconds against a 3 s
    limit: a stall, and, alone at two, a blame without proof (an audit)."""
    from queue import Queue
    from types import SimpleNamespace

    import pluggy

    from guardian import hookspecs, stock
    from guardian.config.tables import WatchdogSettings
    from guardian.engine.ledger import RequestLedger
    from guardian.engine.record import RequestRecord, Stage
    from guardian.health.stall_detection import StallDetector

    request, args = stock.requests.make_request("hi", max_tokens=64, cli_args=SimpleNamespace(num_draft_tokens=3))
    record = RequestRecord(Queue(), (None, request, args), request_id="continued", stream=True, ledger=RequestLedger())
    assert not record.prefilling  # queued: not the loop's yet
    record.stage = Stage.STARTED  # taken by stock's loop (its context came)
    assert record.prefilling
    record.generated.extend([5, 6, 7])  # three tokens
    assert not record.prefilling
    record.prepare_rerun(continued=True)  # the engine failed under it
    assert record.stage is Stage.QUEUED and not record.prefilling
    in_flight: list = []
    engine = SimpleNamespace(steps=0, lifecycle=SimpleNamespace(owner=1, restarts=1),
                             ledger=SimpleNamespace(in_flight=lambda: list(in_flight), produced_kinds={record.kind}))
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    detector = StallDetector(engine, pm, WatchdogSettings(stall_min_s=1.0, stall_timeout_s=30.0, pace_samples=4))

    def look(beat: float, steps: int) -> float:
        engine.steps = steps
        detector._observe_pace(beat)
        return detector.stall_limit_s

    # Another request's steps (the proof probe's) on the restarted loop: the pace is theirs.
    for step in range(1, 11):
        assert look(0.02 * step, step) == (30.0 if step < 3 else 1.0)
    # The loop takes it: while stock has not begun it (a model switch's load), the ceiling.
    in_flight.append(record)
    record.stage = Stage.TAKEN
    assert look(0.2, 10) == 30.0
    assert look(0.21, 12) == 1.0  # steps went by: it waited beside others' work
    # Its prefill begins: its first chunk is unknown, the ceiling applies.
    record.stage = Stage.STARTED
    assert record.prefilling and record.has_output
    assert look(0.22, 12) == 30.0
    assert look(3.2, 13) == 30.0  # that chunk took 3 s
    # A step past it: the next chunks are judged by the first's.
    assert look(6.2, 14) == pytest.approx(4 * 3.0)
    record.generated.append(8)  # its first new token
    assert not record.prefilling


def test_failed_probes_in_a_row_past_a_thousand_still_leave_the_watchdog_looking():
    """After a failed probe the next waits probe_retry_s, doubled for each failure in a row:
    at the 1,025th (a plugin's probe failing every 30 s for 8.5 hours, sooner under deep
    /readyz checks) the doubling overflowed a float, and every look of the watchdog raised."""
    from types import SimpleNamespace

    import pluggy

    from guardian import hookspecs
    from guardian.config.tables import WatchdogSettings
    from guardian.engine.lifecycle import EngineState
    from guardian.health.stall_detection import StallDetector

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    engine = SimpleNamespace(lifecycle=SimpleNamespace(on_trial=False), state=EngineState.READY,
                             failures=SimpleNamespace(proof_wanted=False), ledger=SimpleNamespace(has_work=lambda: False))
    detector = StallDetector(engine, pm, WatchdogSettings())
    now = time.monotonic()
    detector.last_probe = {"ok": False, "monotonic": now, "results": []}
    detector._last_probe_at, detector._failed_in_a_row = now, 5000
    detector._maybe_probe(now + 1)  # raised OverflowError
    assert detector._last_probe_at == now  # not due: probe_interval_s (30 s) caps the wait


def test_the_stall_limit_is_stall_pace_factor_times_the_pace_and_follows_its_change():
    """[watchdog] stall_pace_factor, at start and changed live (no test set it: the slow
    model's test above checks the default, 4 x 1.5 s, so the setting went unread unseen)."""
    import pluggy

    from guardian import hookspecs
    from guardian.config.tables import WatchdogSettings
    from guardian.health.stall_detection import StallDetector

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    detector = StallDetector(None, pm, WatchdogSettings(stall_pace_factor=6.0, stall_min_s=0.5))
    for step in range(5):  # a step a second
        detector.pace.observe(beat=float(step), steps=step, loop=("loop", 0), waiting=())
    assert detector.pace.limit(120.0) == 6.0
    detector.settings = WatchdogSettings(stall_pace_factor=2.5, stall_min_s=0.5)  # the live view, saved anew
    detector.settings_changed()
    detector._follow_settings()
    assert detector.pace.limit(120.0) == 2.5


def test_the_pace_is_the_longest_gap_of_the_last_pace_samples_looks_and_follows_its_change():
    """[watchdog] pace_samples: how many looks the pace remembers. One slow step (2 s), then
    eight fast ones (0.1 s): remembering 32, the limit is still 4 x 2 s; remembering 4, the
    slow step is forgotten and the limit is the floor. Saved live, it takes the new count."""
    import pluggy

    from guardian import hookspecs
    from guardian.config.tables import WatchdogSettings
    from guardian.health.stall_detection import StallDetector

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    clock = {"beat": 0.0, "steps": 0}  # one loop's heartbeat and step count, across calls

    def limit_after_the_steps(detector) -> float:
        """Looks after a step of 0.1 s, one of 2 s, then eight of 0.1 s."""
        for gap in [0.1, 2.0] + [0.1] * 8:
            clock["beat"] += gap
            clock["steps"] += 1
            detector.pace.observe(beat=clock["beat"], steps=clock["steps"], loop=("loop", 0), waiting=())
        return detector.pace.limit(30.0)

    assert limit_after_the_steps(StallDetector(None, pm, WatchdogSettings(stall_min_s=0.5))) == 8.0  # 32
    short = StallDetector(None, pm, WatchdogSettings(stall_min_s=0.5, pace_samples=4))
    assert limit_after_the_steps(short) == 0.5
    short.settings = WatchdogSettings(stall_min_s=0.5, pace_samples=32)  # the live view, saved anew
    short.settings_changed()
    short._follow_settings()
    assert short.pace.gaps.maxlen == 32
    assert limit_after_the_steps(short) == 8.0  # the slow step is within the last 32 looks again


def test_one_verification_of_a_replacement_loop_at_a_time_however_late_its_thread_starts():
    """The watchdog verifies a loop that replaced a stuck one with a probe, on a thread of its
    own. It checked the probes' lock before starting one, so a thread not yet scheduled by
    the next look (a loaded machine) made it start a second: two failed probes, two rungs
    climbed for one loop. The verification's thread is held at its first line here, as
    a late one would be, while the watchdog looks again and again."""
    from types import SimpleNamespace

    import pluggy

    import guardian
    from guardian import hookspecs
    from guardian.config.tables import WatchdogSettings
    from guardian.health.stall_detection import StallDetector

    class PassingProbe:
        @guardian.hookimpl
        def probe(self, engine, timeout_s):
            return {"name": "generation", "ok": True}

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(PassingProbe(), name="generation_probe")
    verified = []
    lifecycle = SimpleNamespace(on_trial=True, stalls=1, verified=lambda stalls_seen, probed_since=None: verified.append(1))
    engine = SimpleNamespace(lifecycle=lifecycle, steps=0, abandoned_loop_threads=0,
                             plugin_view=None, ledger=SimpleNamespace(completed_for_users=0))
    detector = StallDetector(engine, pm, WatchdogSettings())
    started, go = [], threading.Event()
    code = StallDetector._verify_replacement.__code__

    def hold_at_its_start(frame, event, arg):
        if frame.f_code is code and event == "call":
            started.append(threading.current_thread())
            go.wait(10)
        return None

    threading.settrace(hold_at_its_start)
    try:
        for _ in range(5):  # the watchdog's looks while the first verification is not under way yet
            detector._maybe_probe(time.monotonic())
        poll(lambda: started, 5, what="the verification's thread")
    finally:
        threading.settrace(None)
        go.set()
    assert len(started) == 1
    poll(lambda: verified, 5, what="the replacement verified")
    # Once it is done, a later look may verify again (still on trial: another replacement).
    poll(lambda: detector._maybe_probe(time.monotonic()) or len(verified) >= 2, 5, what="a second verification")
    # The last look may have started one more: done before the test ends (its log lines,
    # written after pytest closed the capture, were a logging error in a later test's output).
    poll(lambda: not detector._verifying, 5, what="the last verification done")


@pytest.mark.parametrize("keepalive_s", [None, 0.3, 0.0], ids=["default", "0.3 s", "none"])
def test_a_stream_silent_for_a_second_is_sent_keepalive_comments(slowed_server, tmp_path, keepalive_s):
    """A stream under way was silent for as long as a step was slow, or the engine was
    being replaced after a stall (seconds), and a client's read timeout (the openai SDK's)
    could run out. Each second without a token now brings stock's own keepalive comment;
    ``[guardian] stream_keepalive_s`` sets the second, and 0 sends none."""
    armed = tmp_path / "slow-token"
    # One step 4 s slow, and a floor that makes it no stall: a silence, nothing else. Steps
    # of 10 ms at least: the stream is still under way when the first token's arrival arms
    # the slow one (200 tokens could all be out before, on an idle machine).
    server = slowed_server(step_faults=dict(token_delay_s=4.0, token_delay_armed_by=str(armed)),
                           faults=dict(step_delay_s=0.01), watchdog=dict(stall_min_s=10.0),
                           core=None if keepalive_s is None else dict(stream_keepalive_s=keepalive_s))
    arrivals: list[tuple[float, bytes]] = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/chat/completions",
                           json=chat_body(max_tokens=200, stream=True)) as response:
            assert response.status_code == 200
            for chunk in response.iter_raw():
                arrivals.append((time.monotonic(), chunk))
                if b"data: {" in chunk and not armed.exists() and not server.events("stock_step_slow_token"):
                    armed.touch()  # the next step that makes a token is the slow one
    body = b"".join(chunk for _, chunk in arrivals)
    assert len(server.events("stock_step_slow_token")) == 1 and server.events("engine_stalled") == []
    assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
    gaps = [later - earlier for (earlier, _), (later, _) in zip(arrivals, arrivals[1:])]
    # Stock's own come with the prompt's progress, before the first token; these after it.
    keepalives = body[body.index(b"data: {"):].count(b": keepalive")
    print(f"\nmeasured: longest silence {max(gaps):.2f} s, {keepalives} keepalive comments after the first token")
    if keepalive_s is None:  # 1 s: a comment at the watchdog's first look (every 0.25 s) after it
        assert keepalives >= 2
        assert max(gaps) < 2.5  # 4 s without them
    elif keepalive_s:  # 0.3 s: every 0.3-0.55 s, so 7 or more in 4 s where the default sends 3-4
        assert keepalives >= 6
        assert max(gaps) < 1.5
    else:
        assert keepalives == 0
        assert max(gaps) >= 3.5  # the slow step's silence, whole

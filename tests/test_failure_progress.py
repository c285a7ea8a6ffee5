"""Failures are judged by progress: blame needs reproduction, giving up needs
no progress, and a memory shortage is answered as one (issue 23).

Real ``mlx-guardian`` servers on the CPU; faults planted inside stock's own
step (the fault-injection plugin's step hook, or ``tests/plugins/position_faults.py``
wrapping ``BatchGenerator``). A fault every 25 steps is what sustained
memory pressure did to a server on main: requests that had progressed were
blamed (500), and the process exited 4 while it was still serving.
"""

from __future__ import annotations

import json
import time
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import chat_body, pace, poll, read_stream, scraped
from guardian.exit_codes import EXIT_ENGINE_FAILED
from test_blame import stream_signalling_start
from test_memory_admission import device_reports_free_memory

COMPLETIONS = "/v1/chat/completions"
POSITION_FAULTS = '[guardian]\nplugins = ["tests.plugins.position_faults:PositionFaults"]\n'
POISON = "POISON-AT-A-TOKEN"


def table(name: str, **settings) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())


def status(server) -> dict:
    return httpx.get(server.url + "/guardian/status", timeout=5).json()


def eight_clients(server, requests_each: int, max_tokens: int) -> list[tuple[bool, dict]]:
    """8 clients, each sending ``requests_each`` requests one after the other,
    every other client streaming: (stream, result) for every request."""
    url = server.url + COMPLETIONS

    def client(i: int) -> list:
        stream = i % 2 == 0
        results = []
        with httpx.Client(timeout=60) as http:
            for n in range(requests_each):
                body = chat_body(f"Client {i}, request {n}: tell me a story.", max_tokens=max_tokens, stream=stream)
                if stream:
                    results.append((True, read_stream(http, url, body)))
                else:
                    response = http.post(url, json=body)
                    results.append((False, {"status": response.status_code, "body": response.json()}))
        return results

    with ThreadPoolExecutor(8) as pool:
        return [result for results in pool.map(client, range(8)) for result in results]


def streaming_bystanders(pool: ThreadPoolExecutor, url: str, count: int = 3) -> list:
    """``count`` long streams beside a test's request (futures of their results), each
    already streaming when this returns."""
    started = [threading.Event() for _ in range(count)]
    bystanders = [pool.submit(stream_signalling_start, url, chat_body(f"Bystander {i}.", max_tokens=3000,
                                                                        stream=True), event)
                  for i, event in enumerate(started)]
    poll(lambda: all(event.is_set() for event in started), 30, what="the bystanders streaming")
    return bystanders


def test_a_fault_every_25_steps_under_8_clients_completes_every_request(start_server):
    # Recovery at its defaults: on main the sixth failure within 60 s exited
    # the process (code 4), and requests in flight at two failures were blamed.
    server = start_server(table("fault_injection", enabled=True, every_n_steps=25)
                          + table("watchdog", probe_interval_s=3600.0))
    results = eight_clients(server, requests_each=3, max_tokens=64)

    assert len(results) == 24
    for stream, result in results:
        assert result["status"] == 200, result
        if stream:
            assert result["done"] and not result["errors"], result
            assert result["events"][-1]["choices"][0]["finish_reason"] == "length"
        else:
            assert result["body"]["usage"]["completion_tokens"] == 64
    # The engine can take one more step after the last answer went out, and the
    # fault can land there: the log and the status are read once they agree and
    # that restart is over (CI read "restarting" in the ~20 ms between the
    # failure's count and the new loop's first look for work).
    def settled():
        now = status(server)
        errors = server.events("engine_error")
        return now["failures_total"] == len(errors) and now["state"] == "ready" and (now, errors)

    now, errors = poll(settled, 10, what="the status and the log agreeing on the failures, the engine ready")
    assert len(errors) > 5, "more failures than max_failures (5) within the window"
    # Only the first counts: every later one came after tokens were generated.
    assert [e["progressed"] for e in errors] == [False] + [True] * (len(errors) - 1)
    assert all(e["failures_in_window"] <= 1 for e in errors)
    assert server.proc.poll() is None and server.events("engine_gave_up") == []
    assert server.events("request_blamed") == [] and server.events("request_quarantined") == []
    # Serving while it fails: degraded, in the status, the metrics and the log.
    assert now["degraded"]
    assert now["quarantine"]["quarantined_count"] == 0
    assert now["failures_after_progress"] == len(errors) - 1
    assert now["failure_rate_per_min"] > 5 and now["time_lost_s"] > 0
    assert scraped(server, "mlx_guardian_engine_degraded") == 1.0
    assert scraped(server, "mlx_guardian_engine_failures_total") >= len(errors)
    [degraded] = server.events("engine_degraded")
    assert degraded["failures_recent"] == 6 and degraded["failure_rate_per_min"] > 0
    assert server.health() == 200


def test_a_fault_every_few_steps_fails_the_proof_as_well_and_no_long_prompt_is_blamed(start_server):
    # A hunt: a fault every 6 steps, prefill in chunks of 16 tokens. A long prompt, whose
    # prefill always reached the 6th step, was blamed: 500
    # request_failed_repeatedly, then quarantined. Its proofs, one token each, always
    # passed. Now a proof runs as many steps as the engine ran in a row up to the failure,
    # and it fails too: the engine's fault, answered to retry, nobody blamed.
    # Not the incident's message (a memory failure alone is a shortage, never blamed).
    server = start_server(table("fault_injection", enabled=True, every_n_steps=6, message="a native fault")
                          + table("watchdog", probe_interval_s=3600.0), "--prefill-step-size", "16")
    url = server.url + COMPLETIONS
    long_prompt = "Summarize: " + " ".join(f"item {i}," for i in range(200))
    with httpx.Client(timeout=60) as http:
        first = http.post(url, json=chat_body(long_prompt, max_tokens=4))
        again = http.post(url, json=chat_body(long_prompt, max_tokens=4))
        short = http.post(url, json=chat_body("Hi.", max_tokens=2))
    for response in (first, again):
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_restarting"
    assert short.status_code == 200, short.text
    assert server.events("request_blamed") == [] and server.events("request_quarantined") == []
    proofs = server.events("proof_probe_queued")
    assert proofs and all(1 < proof["tokens"] <= 6 for proof in proofs), proofs
    assert server.proc.poll() is None and server.events("engine_gave_up") == []


def test_a_poison_that_fails_at_the_same_token_is_blamed_once_it_reproduces_alone(start_server):
    server = start_server(POSITION_FAULTS + table("position_faults", marker=POISON, fail_at=5))
    url = server.url + COMPLETIONS
    poison = chat_body(f"{POISON} in a story.", max_tokens=16)
    with ThreadPoolExecutor(3) as pool:
        bystanders = streaming_bystanders(pool, url)
        with httpx.Client(timeout=60) as http:
            blamed = http.post(url, json=poison)
        # Its verdict did not wait for the bystanders: the suspect with the fewest tokens left
        # runs alone first. (Each bystander ran alone to its end first, one after the other.)
        assert not all(f.done() for f in bystanders)
        bystanders = [f.result() for f in bystanders]

    assert blamed.status_code == 500, blamed.text
    error = blamed.json()["error"]
    assert error["code"] == "request_failed_repeatedly"
    assert "5 tokens generated" in error["message"]
    assert blamed.headers["x-should-retry"] == "false"
    for result in bystanders:
        assert result["status"] == 200 and result["done"] and not result["errors"], result
    # At token 5 beside the bystanders; continued, at token 5 again: run alone;
    # at token 5 alone: a probe proves the engine, then alone again; at token 5
    # alone a second time: blamed. (Its second failure came in the step that
    # prefilled every continuation, before the bystanders' next token: they were
    # to run alone too, and once it was blamed they went on together.)
    errors = server.events("engine_error")
    assert len(errors) == 4 and all("planted poison at token 5" in e["error_message"] for e in errors)
    [blamed_event] = server.events("request_blamed")
    poison_id = blamed_event["request_id"]
    assert [e["blamed"] for e in errors] == [[], [], [], [poison_id]]
    assert [e["awaiting_proof"] for e in errors] == [[], [], [poison_id], []]
    assert "2 of them alone" in error["message"]
    reruns = [e for e in server.events("request_rerun") if e["request_id"] == poison_id]
    assert [(e["generated"], e["continued"], e["isolated"], e["awaiting_proof"]) for e in reruns] == [
        (5, True, False, False), (5, True, True, False), (5, False, True, True)]  # past max_continuations: from nothing
    with httpx.Client(timeout=30) as http:
        again = http.post(url, json=poison)
        assert again.status_code == 500 and again.json()["error"]["code"] == "request_quarantined"
    assert len(server.events("engine_error")) == 4
    assert server.proc.poll() is None


def test_a_streamed_poison_beside_streams_is_blamed_not_cut_at_its_first_failure_alone(start_server):
    # A hunt: beside others at token 5, continued; beside them there again; then alone
    # there, its first failure alone but its third at that point, past max_continuations
    # (2): cut with engine_restarting, "retry", never blamed, and sent again it was the
    # same. Now it gets its proof, is continued once more, and is blamed at its next
    # failure alone there.
    server = start_server(POSITION_FAULTS + table("position_faults", marker=POISON, fail_at=5))
    url = server.url + COMPLETIONS
    with ThreadPoolExecutor(3) as pool:
        bystanders = streaming_bystanders(pool, url)
        with httpx.Client(timeout=60) as http:
            poisoned = read_stream(http, url, chat_body(f"{POISON} streamed beside others.", max_tokens=16,
                                                        stream=True))
        bystanders = [f.result() for f in bystanders]

    assert poisoned["status"] == 200 and poisoned["done"], poisoned
    [error] = poisoned["errors"]
    assert error["code"] == "request_failed_repeatedly", error
    # Its 5 tokens, none twice across its continuations (mlx-lm 0.31.3's handler held back
    # the text of all 5 here: the error was its only event), then the error.
    assert len(poisoned["events"]) <= 5 + 1 and "error" in poisoned["events"][-1]
    for result in bystanders:
        assert result["status"] == 200 and result["done"] and not result["errors"], result
    errors = server.events("engine_error")
    [blamed] = server.events("request_blamed")
    assert [e["blamed"] for e in errors] == [[], [], [], [blamed["request_id"]]]
    assert [bool(e["awaiting_proof"]) for e in errors] == [False, False, True, False]
    with httpx.Client(timeout=30) as http:
        again = http.post(url, json=chat_body(f"{POISON} streamed beside others.", max_tokens=16, stream=True))
        assert again.status_code == 500 and again.json()["error"]["code"] == "request_quarantined"


def test_a_lone_stream_failing_at_one_token_is_blamed_after_its_proof_not_cut(start_server):
    # Alone at token 5, continued; alone at token 5 again: a probe proves the engine;
    # a third time, past max_continuations (2): blamed, not cut with a "retry" its
    # client would follow into the same failure.
    server = start_server(POSITION_FAULTS + table("position_faults", marker=POISON, fail_at=5))
    body = chat_body(f"{POISON} streamed alone.", max_tokens=16, stream=True)
    with httpx.Client(timeout=60) as http:
        result = read_stream(http, server.url + COMPLETIONS, body)
        assert result["status"] == 200 and result["done"], result
        [error] = result["errors"]
        assert error["code"] == "request_failed_repeatedly" and "5 tokens generated" in error["message"]
        again = http.post(server.url + COMPLETIONS, json=body)
        assert again.status_code == 500 and again.json()["error"]["code"] == "request_quarantined"
    errors = server.events("engine_error")
    assert [bool(e["awaiting_proof"]) for e in errors] == [False, True, False] and errors[-1]["blamed"]


def test_a_request_made_again_from_nothing_is_no_proof_of_the_engine(start_server):
    # max_continuations = 0: after its failure at token 5 the request runs again from
    # nothing, making its 5 tokens again. Those are its own, no work for anyone else: it
    # was blamed at its second failure with no proof run (a review). Now a probe first.
    server = start_server(POSITION_FAULTS + table("position_faults", marker=POISON, fail_at=5)
                          + table("recovery", max_continuations=0))
    with httpx.Client(timeout=60) as http:
        blamed = http.post(server.url + COMPLETIONS, json=chat_body(f"{POISON} made again.", max_tokens=16))
    assert blamed.json()["error"]["code"] == "request_failed_repeatedly", blamed.text
    errors = server.events("engine_error")
    [request_id] = errors[-1]["blamed"]
    assert [e["awaiting_proof"] for e in errors] == [[], [request_id], []]
    assert len(server.events("proof_probe_queued")) == 1


def test_distinct_poisons_sent_back_to_back_are_each_blamed_and_the_server_stays_up(start_server):
    """A blame forgives its failures only if the engine completed a request since the one
    before (an engine that fails everything blames each request in turn). Poisons sent back
    to back left no completion between them: each was blamed rightly, and the fourth ended
    the process (exit 4). Now a probe runs ahead of the next request after such a blame, and
    its token proves the engine between them."""
    server = start_server(POSITION_FAULTS + table("position_faults", marker=POISON, fail_at=0))
    with httpx.Client(timeout=60) as http:
        for i in range(5):
            answer = http.post(server.url + COMPLETIONS, json=chat_body(f"{POISON}, variant {i}.", max_tokens=8))
            assert answer.status_code == 500, (i, answer.text)
            assert answer.json()["error"]["code"] == "request_failed_repeatedly", (i, answer.text)
        assert http.post(server.url + COMPLETIONS, json=chat_body(max_tokens=4)).status_code == 200
    assert server.proc.poll() is None and status(server)["state"] == "ready"
    assert len(server.events("request_blamed")) == 5 and not server.events("engine_gave_up")
    assert status(server)["failures_in_window"] <= 2  # at most the last blame's, not yet proven


def test_a_stream_continued_at_one_point_past_max_continuations_is_cut(start_server):
    # The count that bounds continuations is of failures at one point: this
    # stream fails at its token 5 each time (max_reruns raised so that it is
    # not blamed first).
    server = start_server(POSITION_FAULTS + table("position_faults", marker=POISON, fail_at=5)
                          + table("recovery", max_continuations=1, max_reruns=5))
    with httpx.Client(timeout=60) as http:
        result = read_stream(http, server.url + COMPLETIONS,
                             chat_body(f"{POISON} streamed.", max_tokens=16, stream=True))
    assert result["status"] == 200 and result["done"], result
    assert [e["code"] for e in result["errors"]] == ["engine_restarting"]
    assert len(server.events("engine_error")) == 2
    [continued] = server.events("request_rerun")
    assert continued["continued"] and continued["generated"] == 5


def test_out_of_memory_for_a_request_that_fits_is_a_503_then_it_is_served(start_server):
    # The request fails the engine out of memory at every step, twice: alone,
    # and alone again when re-run. It needs far less than the device has: 503
    # with Retry-After, never quarantined; once the shortage passes the same
    # request is served: where nothing measures free memory at once, alone (the
    # KV budget's cap, learned from the failure, refused it at the door until
    # memory_cap_hold_s passed); where the device's free memory is measured, once
    # the device has it.
    server = start_server(table("fault_injection", enabled=True, exception="MemoryError",
                                message="planted: out of memory", poison_marker="OOM-HERE", max_faults=2)
                          + table("prompt_guard", memory_cap_hold_s=2.0)
                          + table("watchdog", resource_interval_s=0.2))
    url = server.url + COMPLETIONS
    body = chat_body("OOM-HERE, then a story.", max_tokens=8)
    with httpx.Client(timeout=60) as http:
        short = http.post(url, json=body)
        assert short.status_code == 503, short.text
        assert short.json()["error"]["code"] == "memory_shortage"
        assert short.headers["x-should-retry"] == "true" and int(short.headers["retry-after"]) >= 1
        errors = server.events("engine_error")
        assert [e["classification"] for e in errors] == ["out_of_memory"] * 2
        [shortage] = server.events("request_short_of_memory")
        assert errors[-1]["short_of_memory"] == [shortage["request_id"]] and errors[-1]["blamed"] == []
        assert server.events("request_quarantined") == []
        assert status(server)["quarantine"]["quarantined_count"] == 0

        answers = []

        def served():
            response = http.post(url, json=body)
            answers.append(response)
            return response.status_code == 200

        poll(served, 30, interval=0.2, what="the request served once the shortage passed")
        # Where nothing measures free memory it runs alone at once under the learned cap.
        assert len(answers) == 1 or device_reports_free_memory()
        for refused in answers[:-1]:  # the door's answer while the measured KV budget was capped
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "memory_shortage"
            assert refused.headers["x-should-retry"] == "true" and "retry-after" in refused.headers
        assert answers[-1].json()["usage"]["completion_tokens"] == 8
    assert len(server.events("engine_error")) == 2 and server.proc.poll() is None


def test_a_client_that_retries_a_request_short_of_memory_as_told_never_ends_the_process(start_server):
    """The incident's error (Metal's resource limit) raised inside stock's step for one
    request, which its client sends again each time Retry-After says: each time it fails
    alone, twice, and is answered 503 memory_shortage. A probe between the retries proves
    the engine serves, so those failures are forgiven; they counted toward the crash loop,
    and the fourth retry got 503 engine_failed as the process exited 4. A stream of it whose
    head was sent gets the same error as an event (which the openai SDK does not retry)."""
    server = start_server(POSITION_FAULTS + table("position_faults", marker="SHORT-OF-MEMORY", fail_at=0,
                                                  message="[metal::malloc] Resource limit (499000) exceeded."))
    body = chat_body("SHORT-OF-MEMORY, then a story.", max_tokens=8)
    with httpx.Client(timeout=60) as http:
        for attempt in range(8):
            answer = http.post(server.url + COMPLETIONS, json=body)
            assert answer.status_code == 503, (attempt, answer.text)
            assert answer.json()["error"]["code"] == "memory_shortage", (attempt, answer.text)
            pace(float(answer.headers["retry-after"]))  # as the openai SDK does
        streamed = read_stream(http, server.url + COMPLETIONS, {**body, "stream": True})
        assert streamed["status"] == 200 and [e["code"] for e in streamed["errors"]] == ["memory_shortage"]
        assert http.post(server.url + COMPLETIONS, json=chat_body(max_tokens=4)).status_code == 200
    errors = server.events("engine_error")
    assert len(errors) == 18 and {e["classification"] for e in errors} == {"metal_resource_limit"}
    assert server.proc.poll() is None and status(server)["state"] == "ready"
    assert status(server)["failures_in_window"] <= 2  # at most the last attempt's, not yet proven


def test_a_crash_suspect_whose_stream_progressed_is_not_quarantined():
    # The supervisor's side (guardian.quarantine.crashes), its decision alone:
    # a stream continued on the next child that relayed tokens since its first
    # crash is struck once again, not twice; one that did not is quarantined.
    from guardian.quarantine.crashes import CrashQuarantine

    class Stream:
        def __init__(self, tokens):
            self.tokens = tokens

    quarantine = CrashQuarantine(quarantine_s=600, strike_window_s=300)
    for generation, tokens in enumerate(([1, 2], [1, 2, 3, 4], [1, 2, 3, 4]), start=1):
        with quarantine.relaying(generation, "POST", "/v1/chat/completions", "fp") as relay:
            relay.stream = Stream(tokens)
            relay.lost = True
        quarantine.child_exited(generation, crashed=True)
        struck = quarantine.status()
        if generation < 3:  # the first crash, then one after progress
            assert struck["suspects"][0]["strikes"] == 1 and struck["quarantined_count"] == 0
    assert struck["quarantined_count"] == 1, "the third crash found it where the second did"


def test_a_crash_suspect_is_forgotten_once_its_strike_window_has_passed():
    """A suspect is cleared when the same request is answered in full; a unique prompt never
    is. Kept for good, after one crash every answered request worked out its fingerprint (a
    parse and a hash of its body) for as long as the supervisor ran. Past the strike window
    it cannot strike again: forgotten, as the window would count it anyway."""
    from guardian.quarantine.crashes import CrashQuarantine

    window_s = 1.0
    quarantine = CrashQuarantine(quarantine_s=600, strike_window_s=window_s)
    with quarantine.relaying(1, "POST", "/v1/chat/completions", "fp-unique") as relay:
        relay.lost = True
    quarantine.child_exited(1, crashed=True)

    def answered_once(generation: int) -> None:
        with quarantine.relaying(generation, "POST", "/v1/chat/completions", f"fp-{generation}") as other:
            other.answered = True

    answered_once(2)
    assert [s["strikes"] for s in quarantine.status()["suspects"]] == [1]  # within its window: kept

    def forgotten() -> bool:
        answered_once(3)
        return not quarantine.suspects

    poll(forgotten, window_s + 10, what="the suspect forgotten once its window passed")
    assert quarantine.status()["suspects"] == [] and quarantine.status()["quarantined_count"] == 0


def test_giving_up_counts_failures_in_a_row_without_progress_and_progress_ends_the_row():
    """Random failures work apart (one step in twenty failing, each now and then twice in a
    row) added up within the window: 6 failures each straight after another, amid thousands
    of steps, ended the process with exit 4 while 90 % of its failures came after progress
    (a review's load test, 14 s in). Only a row of failures with no progress between them
    counts: the engine's progress ends it."""
    from guardian.engine.blame import FailureBudget

    budget = FailureBudget(window_s=60.0)
    at = 0.0
    for progress in range(6):  # pairs: one after progress, then one straight after it
        assert (budget.add(progress, now=at) is None) == (progress > 0)  # the first always counts
        assert budget.add(progress, now=at + 0.1) is not None
        assert budget.count(now=at + 0.1) <= 2  # was 1 + progress: past max_failures (5) at the fifth pair
        at += 1.0
    assert budget.after_progress == 5 and budget.total == 12
    for _ in range(5):  # a row with no progress at all: it counts whole
        budget.add(5, now=at)
    assert budget.count(now=at) == 6


def test_the_crash_loops_window_leaves_out_restarts_not_waits():
    """A dead engine of a large model: each failure, then 20 s reading the weights again.
    On the wall clock its sixth failure came 100 s after its first, and the 60-s window
    never held more than three; on the engine's clock they are seconds apart. A backoff
    wait is time like any other: it spreads a burst at the rate the window allows."""
    from guardian.engine.blame import FailureBudget

    budget = FailureBudget(window_s=60.0)
    at = 0.0
    for _ in range(6):
        assert budget.add(0, now=at) is not None
        # A scrape in the middle of the reload, past the window: it prunes nothing. (The
        # restart's span was marked at its end, and a read before that pruned for good.)
        assert budget.count(now=at + 19.0) >= 1
        at += 20.0
        budget.lost(20.0)
        budget.running_again(now=at)
    assert budget.count(now=at) == 6
    assert budget.time_lost_s == 120.0

    # A restart that fails too (its reload raised): the engine never ran between.
    failing = FailureBudget(window_s=60.0)
    for at in (0.0, 40.0, 80.0, 120.0):
        failing.add(0, now=at)
    failing.running_again(now=130.0)
    assert failing.count(now=131.0) == 4

    waited = FailureBudget(window_s=60.0)
    at = 0.0
    for _ in range(4):
        waited.add(0, now=at)
        waited.running_again(now=at + 1.0)  # a backoff wait of 28 s: the clock runs
        waited.restarting(now=at + 29.0)
        at += 30.0
        waited.running_again(now=at)
    assert waited.count(now=at) == 2

    # Two restarts that fail in a row, each after its wait: both waits count.
    twice = FailureBudget(window_s=60.0)
    twice.add(0, now=0.0)
    twice.running_again(now=1.0)
    twice.restarting(now=41.0)
    twice.add(0, now=42.0)
    twice.running_again(now=43.0)
    twice.restarting(now=83.0)
    twice.running_again(now=84.0)
    assert twice.count(now=84.0) == 1  # 80 s of waits since the first


def test_a_suspect_is_blamed_once_it_failed_alone_twice_with_the_engine_working_between():
    """Failing alone once blamed a request: an engine that fails every step blamed the
    first request it met (500, "will not be retried", quarantined), and one step in
    twenty failing at random blamed 53 innocent requests in 45 s
    (bench/random_faults_blame.py). Now the verdict is PROVE (a probe, then alone
    again) until the suspect failed alone twice at its point with the engine working
    for others between its last two failures (a completion, or a token not its own);
    then BLAME. After MAX_PROOFS failed proofs it is answered 503 (the engine's fault).
    Without a progress to compare (no probe to prove the engine with, or a stall) it is
    BLAME as before; a memory failure alone stays a shortage."""
    from types import SimpleNamespace

    from guardian.engine.blame import MAX_PROOFS, Verdict, verdicts

    def suspect(before=(3, 40, 0), **overrides):
        fields = dict(client_has_output=False, stuck_failures=2, synthetic=False, isolate=False,
                      progress_at_previous_alone_failure=before, alone_failures=2, tokens_made=0, proofs=0,
                      failed_alone_at_point=True, steps_proven=6, steps_to_prove_before=6,
                      may_continue=lambda _: False, continuable_for_proof=lambda: True)
        return SimpleNamespace(**{**fields, **overrides})

    def verdict(record, **kwargs):
        [(_, decided)] = verdicts([record], max_reruns=1, max_continuations=2, **kwargs)
        return decided

    assert verdict(suspect(), progress=(3, 40)) is Verdict.PROVE  # nothing between
    assert verdict(suspect(), progress=(4, 40)) is Verdict.BLAME  # a probe completed
    assert verdict(suspect(), progress=(3, 41)) is Verdict.BLAME  # a token, another's
    # Re-run from nothing, its own 14 tokens made again: no proof of the engine.
    assert verdict(suspect((3, 40, 6), tokens_made=20), progress=(3, 54)) is Verdict.PROVE
    assert verdict(suspect((3, 40, 6), tokens_made=20), progress=(3, 55)) is Verdict.BLAME
    assert verdict(suspect(alone_failures=1), progress=(4, 40)) is Verdict.PROVE  # alone once
    # The engine ran 5 steps in a row before its last run, 6 up to the failure before: an
    # engine failing every 6 steps would do that too (its proof was cut short, or failed).
    assert verdict(suspect(steps_proven=5), progress=(4, 40)) is Verdict.PROVE
    # Alone twice at its point, a proof between, then alone at an earlier token (run again
    # from nothing): no reproduction of the first two.
    assert verdict(suspect(failed_alone_at_point=False), progress=(4, 40)) is Verdict.PROVE
    assert verdict(suspect(alone_failures=1)) is Verdict.BLAME  # nothing to prove the engine with
    assert verdict(suspect(None), progress=(3, 40)) is Verdict.PROVE  # its failure before noted by a stall
    assert verdict(suspect(), progress=(3, 40), memory=True) is Verdict.SHORTAGE
    assert verdict(suspect(synthetic=True), progress=(3, 40)) is Verdict.ANSWER
    assert verdict(suspect(stuck_failures=1), progress=(3, 40)) is Verdict.RERUN
    # Its proofs failed as well: the engine's fault, answered to retry, not held for good.
    assert verdict(suspect(proofs=MAX_PROOFS), progress=(3, 40)) is Verdict.ANSWER
    assert verdict(suspect(proofs=MAX_PROOFS, client_has_output=True, may_continue=lambda _: True),
                   progress=(3, 40)) is Verdict.CUT
    # A stream that sent tokens, past max_continuations at its point: blamed once it
    # reproduced (a cut would be sent again); else its proof, and continued once more
    # (cut there, a poison beside others was never blamed: a hunt), unless its proofs
    # failed or it cannot be continued.
    streamed = dict(client_has_output=True, stuck_failures=3)
    assert verdict(suspect(**streamed), progress=(4, 40)) is Verdict.BLAME
    assert verdict(suspect(**streamed), progress=(3, 40)) is Verdict.PROVE
    assert verdict(suspect(**streamed, proofs=MAX_PROOFS), progress=(3, 40)) is Verdict.CUT
    assert verdict(suspect(**streamed, continuable_for_proof=lambda: False), progress=(3, 40)) is Verdict.CUT
    # Beside others it is run alone first.
    [(_, first), (_, second)] = verdicts([suspect(), suspect()], 1, 2, progress=(4, 40))
    assert first is second is Verdict.ISOLATE


def test_a_proof_is_as_long_as_the_run_of_steps_that_ended_in_the_failure():
    """The steps a proof must run: the engine's run of steps up to the failure, the failing
    step included, capped at proof_max_steps; a suspect's next failure alone counts as a
    reproduction only after that many steps without a failure before its run (a review)."""
    from queue import Queue
    from types import SimpleNamespace

    from guardian import stock
    from guardian.engine.blame import reproduced_alone
    from guardian.engine.failures import FailureHandler
    from guardian.engine.ledger import RequestLedger
    from guardian.engine.probes import END_OF_SEQUENCE_BIAS, no_end_of_sequence
    from guardian.engine.record import RequestRecord

    engine = SimpleNamespace(steps=0)
    handler = FailureHandler(engine)
    settings = dict(window_s=60.0, max_failures=5, max_reruns=1, max_continuations=2, quarantine_s=0.0)
    handler.configure(**settings, proof_max_steps=8)
    engine.steps = 6
    assert handler._run_of_steps_ended() == (0, 6)  # failed at the 6th step since the start
    engine.steps = 30
    assert handler._run_of_steps_ended() == (6, 8)  # 24 steps, capped
    handler.configure(**settings)  # a recovery plugin written before the setting: as it was
    assert handler.proof_max_steps == 8

    request, args = stock.requests.make_request("hi", max_tokens=4, cli_args=SimpleNamespace(num_draft_tokens=3))
    record = RequestRecord(Queue(), (None, request, args), request_id="suspect", stream=True, ledger=RequestLedger())
    # Taken at step 30 (right after a failure there), failed alone at its 6th step.
    record.taken_at_step = 30
    record.note_failure((1, 10), alone=True, steps=(30, 6))
    assert (record.steps_proven, record.steps_to_prove) == (0, 6)
    # A proof of 5 steps passed (steps 37-41), then it ran alone and failed at the same point.
    record.taken_at_step = 41
    record.note_failure((2, 15), alone=True, steps=(36, 6))
    assert (record.steps_proven, record.steps_to_prove_before) == (5, 6)
    assert not reproduced_alone(record, (2, 15))  # 5 steps proven, 6 needed: a fault every 6 steps
    # Its next proof ran 6 (steps 43-48): now its failure alone again is a reproduction.
    record.taken_at_step = 48
    record.note_failure((3, 21), alone=True, steps=(42, 6))
    assert record.steps_proven == 6 and reproduced_alone(record, (3, 21))

    assert no_end_of_sequence(None) is None  # weights being read
    assert no_end_of_sequence(SimpleNamespace(eos_token_ids=set())) is None
    bias = no_end_of_sequence(SimpleNamespace(eos_token_ids={2, 7}))
    assert bias == {2: END_OF_SEQUENCE_BIAS, 7: END_OF_SEQUENCE_BIAS}
    _, barred = stock.requests.make_request("hi", max_tokens=6, cli_args=SimpleNamespace(num_draft_tokens=3),
                                            logit_bias=bias)
    assert barred.logits.logit_bias == bias and barred.max_tokens == 6


def test_a_stream_whose_client_left_while_it_waited_to_run_again_holds_no_new_request():
    """After a blame, streams one failure from a cut run again ``guarded``: no new request
    is taken until each is past its point. One whose client left while it waited (a
    review) was guarded all the same, never ran, and held every new request for good."""
    from queue import Empty, Queue

    from guardian.engine.ledger import RequestLedger
    from guardian.request_context import request_scope

    def put(ledger, request_id):
        with request_scope(request_id, True, client=request_id):
            return ledger.put((Queue(), "request", "args"))

    def take(ledger):
        try:
            return ledger.get_nowait()[0]
        except Empty:
            return None

    ledger = RequestLedger()
    left, stays = put(ledger, "left"), put(ledger, "stays")
    assert [take(ledger), take(ledger)] == [left, stays]
    ledger.rerun(ledger.take_in_flight())  # the engine failed under both
    left.cancel()  # its client left while it waited to run again
    ledger.clear_isolation(at_risk=lambda record: True)  # a blame; both one failure from a cut
    assert ledger.guarded == {stays}
    newcomer = put(ledger, "newcomer")
    assert take(ledger) is stays and take(ledger) is None  # guarded: no new request yet
    ledger.unguard(stays)  # past its point
    assert take(ledger) is newcomer


def test_a_proof_of_the_engine_runs_before_every_re_run():
    """A suspect with one token left sorted ahead of the proof queued for it, and the
    proofs piled up; a failed proof sorted behind streams run together waited for their
    ends (two reviews). A proof goes first; then re-runs beside each other; then the
    suspects to run alone, the fewest tokens left first."""
    from types import SimpleNamespace

    from guardian.engine.ledger import rerun_order

    def record(seq, isolate, synthetic=False, left=8):
        return SimpleNamespace(seq=seq, isolate=isolate, synthetic=synthetic, tokens_left=lambda: left)

    suspect_one_left = record(1, True, left=1)
    beside = record(2, False)
    proof = record(3, True, synthetic=True, left=1)
    suspect_long = record(0, True, left=200)
    ordered = sorted([suspect_long, beside, suspect_one_left, proof], key=rerun_order)
    assert ordered == [proof, beside, suspect_one_left, suspect_long]


def test_a_request_past_metals_largest_buffer_is_blamed_not_told_to_come_back(start_server):
    """Metal's "Attempting to allocate N bytes which is greater than the maximum allowed
    buffer size" is one array past the device's largest buffer: the request's shapes, not
    a shortage. Taken for one, the request was answered 503 memory_shortage (come back) each
    time it was sent, never quarantined, and the KV budget was capped below every request
    for a minute (a review). It is blamed once it fails alone; the budget keeps its size."""
    message = ("[metal::malloc] Attempting to allocate 137438953472 bytes which is greater than the "
               "maximum allowed buffer size of 77309411328 bytes.")
    # Raised inside stock's own BatchGenerator step, where Metal's allocator fails.
    server = start_server(POSITION_FAULTS + table("position_faults", marker="HUGE-ALLOC", fail_at=0,
                                                  message=message))
    with httpx.Client(timeout=60) as http:
        blamed = http.post(server.url + COMPLETIONS, json=chat_body("HUGE-ALLOC, then a story.", max_tokens=8))
        assert blamed.status_code == 500, blamed.text
        assert blamed.json()["error"]["code"] == "request_failed_repeatedly"
        assert blamed.headers["x-should-retry"] == "false"
        assert {e["classification"] for e in server.events("engine_error")} == {"metal_buffer_too_large"}
        assert not server.events("kv_budget_lowered")
        again = http.post(server.url + COMPLETIONS, json=chat_body("HUGE-ALLOC, then a story.", max_tokens=8))
        assert again.json()["error"]["code"] == "request_quarantined"
        assert http.post(server.url + COMPLETIONS, json=chat_body("hello", max_tokens=4)).status_code == 200


def test_readiness_after_a_failed_probe_comes_back_with_the_next_completion_or_a_probe_soon(start_server):
    """One idle probe failed (two planted faults, then the engine was fine), and /readyz said
    503 "the last probe failed" until the next probe, probe_interval_s (30 s) later, while
    every request got 200; a supervisor, whose limit is 30 s too, replaced that healthy
    child (a hunt). Now a user's completion since makes it ready, and without one the next
    probe comes probe_retry_s after the failure."""
    # Not a memory shortage's message, whose proof comes at once; each round's its own, which
    # arms the faults anew.
    armed = ('[fault_injection]\narmable = true\nenabled = {}\nprobability = 1.0\nmax_faults = 2\n'
             'message = "planted engine fault ({})"\n')
    # The completion's round retries no probe meanwhile: on a loaded machine the next look at
    # /readyz once came more than probe_retry_s (1 s) after the failed probe, which had passed.
    # No probe runs but the test's own, nor while the faults are armed: a probe that was under
    # way as they were took the first, the next probe the second, was run again and passed (a
    # loaded CI run: "probe passed" after a 503 the engine's restart gave, or no probe failed).
    config = (armed + "[watchdog]\nprobe_retry_s = {}\nprobe_interval_s = 600.0\nprobe_max_age_s = 600.0\n"
              "deep_check_reuse_s = 0.0\n"  # the deep check runs its own round: it meets the faults
              + table("recovery", backoff_base_s=0.0))
    server = start_server(config.format("false", 0, 1.0))
    readyz = lambda: httpx.get(server.url + "/readyz", timeout=10)
    with httpx.Client(timeout=60) as http:
        for then in ("a completion", "a probe"):
            # The faults armed, and no retry due meanwhile: the round before's failed probe,
            # more than probe_retry_s back on a loaded machine, was retried at once as a save
            # made the retry 1 s, met both faults, and the deep check's own probe passed.
            server.save_config(config.format("true", then, 300.0))
            failed = http.get(server.url + "/readyz?deep=1")  # its probe's steps arm them and meet both
            assert failed.status_code == 503 and failed.json()["last_probe"]["ok"] is False, failed.text
            failed_at = time.monotonic()
            if then == "a completion":
                # Said once the engine is back from the second fault's restart (a moment, or
                # longer on a loaded machine: "engine restarting" until then).
                said = poll(lambda: (answer := readyz().json())["state"] == "ready" and answer, 10,
                            what="the engine back")
                assert said["reason"] == "the last probe failed", (said, server.events("probe_finished"))
                assert http.post(server.url + COMPLETIONS, json=chat_body(max_tokens=4)).status_code == 200
                ready = readyz()
                assert ready.status_code == 200, ready.text
                assert ready.json()["reason"] == "a request completed since the last probe failed", (
                    ready.json(), server.events("probe_finished"))
            else:
                server.save_config(config.format("false", then, 1.0))  # the next probe due 1 s after the failure
                poll(lambda: readyz().status_code == 200, 10, interval=0.1, what="ready again by a probe")
                assert time.monotonic() - failed_at < 1.0 + 4, "not probe_interval_s (600 s) later"
                assert readyz().json()["reason"] == "probe passed"
    assert server.proc.poll() is None


def test_a_shortage_that_fails_everything_is_waited_out_for_its_grace_then_ends_the_process(start_server, tmp_path):
    """Memory another process held for a few seconds failed every step, probes too: with
    clients retrying as Retry-After says, a 4 s shortage ended the process (exit 4), whose
    restart reads the weights again into the same shortage (a hunt). Now it is waited out
    for [recovery] shortage_grace_s, restarting on the loaded weights; a shortage that
    outlasts it still ends the process."""
    grace_s = 5.0
    # Metal's resource limit at every step; a save that changes a key arms the faults anew.
    armed = "[fault_injection]\narmable = true\nenabled = {}\nprobability = 1.0\nevery_n_steps = {}\n"
    config = armed + table("recovery", max_failures=2, backoff_base_s=0.1, backoff_max_s=0.4,
                           shortage_grace_s=grace_s)
    server = start_server(config.format("false", 0))
    path = server.config
    answers = []

    def retry_while(condition, http) -> None:
        while condition():
            try:
                answer = http.post(server.url + COMPLETIONS, json=chat_body(max_tokens=4))
            except httpx.TransportError:  # the process ended
                return
            answers.append(answer)
            if answer.status_code != 200:
                pace(min(float(answer.headers.get("retry-after", 0.2)), 0.3))

    with httpx.Client(timeout=60) as http:
        path.write_text(config.format("true", 0))
        server.wait_for_event("config_reloaded", timeout=10)  # armed at the next step
        short_from = time.monotonic()
        # A passing shortage: it lasts until it has gone past max_failures, and is over well
        # within the grace. (Not a fixed 2.5 s: on a loaded machine the first step came 1.6 s
        # after the save, and the rest of the 2.5 s held four failures, none past the limit.)
        waited_out = lambda: server.events("memory_shortage_waited_out")
        retry_while(lambda: not waited_out() and time.monotonic() - short_from < 30, http)
        assert waited_out(), "the shortage went past max_failures (2)"
        assert answers and {a.status_code for a in answers} == {503}, [a.text for a in answers]
        path.write_text(config.format("false", 0))
        server.wait_for_event("config_reloaded", timeout=15, count=2)
        retry_while(lambda: answers[-1].status_code != 200 and time.monotonic() - short_from < 60, http)
        assert answers[-1].status_code == 200, answers[-1].text
        assert server.proc.poll() is None and server.events("engine_gave_up") == []
        path.write_text(config.format("true", 1))  # one that does not pass
        server.wait_for_event("config_reloaded", timeout=10, count=3)
        short_from = time.monotonic()
        retry_while(lambda: server.proc.poll() is None and time.monotonic() - short_from < grace_s + 20, http)
    assert server.proc.wait(timeout=30) == EXIT_ENGINE_FAILED
    assert time.monotonic() - short_from >= grace_s - 0.5

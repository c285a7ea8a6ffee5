"""After the engine ran out of device memory, the KV budget is what the device can give.

The failure is planted (fault_injection raising CUDA's out-of-memory message
while a marked request is started): the CPU backend (Metal too) reports no free memory,
so the cap is the one learned from the failure, the KV admitted when the
device ran out, less the margin (guardian.admission.memory_cap). The cap is
temporary: a request over it that fits the configured budget runs alone, in
its turn (it was 503 memory_shortage until the cap lifted, and before that 400
kv_cache_budget_exceeded, which no SDK retries); only one over the configured
budget gets 400. On a GPU
bench/gpu_oom.py runs the real failure, with the measured cap. And a request
waiting its turn for KV memory still ends at its deadline, or when its client leaves.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import chat_body, poll, scraped, send_raw

pytestmark = [pytest.mark.one_version, pytest.mark.lane_0313]


def device_reports_free_memory() -> bool:
    from guardian.admission.memory_cap import device_free_memory

    return device_free_memory() is not None

CUDA_OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
# mlx's Metal allocator when newBuffer returns nothing (its CUDA one's for managed memory too).
METAL_NO_BUFFER = "[malloc] Unable to allocate 1073741824 bytes."
# Four and a half of the demo model's 256-token KV blocks (131,072 bytes each).
CONFIGURED_BUDGET = 600_000
OOM_ONCE = f"""
[fault_injection]
enabled = true
message = "{CUDA_OOM}"
poison_marker = "OOM-HERE"
max_faults = 1
"""


@pytest.mark.skipif(device_reports_free_memory(),
                    reason="the device reports its free memory (CUDA): a planted failure with the memory "
                    "free lifts the cap at once; bench/gpu_oom.py runs a real one there")
def test_after_a_memory_failure_a_request_over_the_cap_runs_alone(start_server):
    """The cap learned from the one request in flight at the failure is below that request's
    size: every request as large got 503 for a minute (a review: every request, the demo
    model's smallest included), though the shortage had passed (the request itself was
    served at once, re-run). It waits for the rest to end, then runs alone."""
    server = start_server(OOM_ONCE.replace("max_faults = 1\n", "max_faults = 1\nstep_delay_s = 0.02\n")
                          + f"[prompt_guard]\nkv_budget_bytes = {CONFIGURED_BUDGET}\n"
                          "memory_cap_hold_s = 600.0\n")  # capped throughout, however slow the machine
    # Over 256 tokens: two of the KV cache's 256-token steps, where a small request takes one.
    big = chat_body("OOM-HERE " + "word " * 300, max_tokens=64)
    with httpx.Client(timeout=60) as client:
        # In flight when the device "ran out": re-run on the restarted loop, served.
        first = client.post(server.url + "/v1/chat/completions", json=big)
        assert first.status_code == 200, first.text
        [error] = server.events("engine_error")
        assert error["classification"] == "out_of_memory"
        [lowered] = server.wait_for_event("kv_budget_lowered")
        assert 0 < lowered["kv_budget_bytes"] < lowered["kv_budget_configured_bytes"]

        # Over the configured budget (the device's total here): it never fits, 400 as before.
        never = client.post(server.url + "/v1/chat/completions", json=chat_body("word " * 300, max_tokens=1000))
        assert never.status_code == 400, never.text
        assert never.json()["error"]["code"] == "kv_cache_budget_exceeded"
        assert never.json()["error"]["kv_budget_bytes"] == CONFIGURED_BUDGET
        assert never.headers["x-should-retry"] == "false"

        # What fits in what the device gave is still served.
        small = client.post(server.url + "/v1/chat/completions", json=chat_body("hello", max_tokens=4))
        assert small.status_code == 200, small.text

        # Over the cap: it waits for the stream that runs (80 steps of 20 ms), then runs alone.
        ended = {}
        with client.stream("POST", server.url + "/v1/chat/completions",
                           json=chat_body("hello", max_tokens=80, stream=True)) as stream:
            lines = stream.iter_lines()
            next(lines)  # under way: it holds its KV

            def big_request():
                ended["big"] = (client.post(server.url + "/v1/chat/completions", json=big), time.monotonic())
            waiting = threading.Thread(target=big_request)
            waiting.start()
            server.wait_for_event("request_queued")
            for _ in lines:
                pass
            ended["stream"] = time.monotonic()
        waiting.join(timeout=60)
        answer, answered_at = ended["big"]
        assert answer.status_code == 200, answer.text
        assert answered_at > ended["stream"]
    assert len(server.events("engine_error")) == 1


@pytest.mark.skipif(device_reports_free_memory(),
                    reason="the device reports its free memory (CUDA): a planted failure with the memory "
                    "free lifts the cap at once; bench/gpu_oom.py runs a real one there")
def test_a_memory_failure_inside_stocks_own_step_caps_the_budget_too(start_server, tmp_path):
    """The same, with the failure raised inside stock's BatchGenerator.next
    (tests/plugins/stock_step_faults.py), where a real allocator fails."""
    arm = tmp_path / "arm"
    server = start_server('[guardian]\nplugins = ["tests.plugins.stock_step_faults:StockStepFaults"]\n'
                          f'[stock_step_faults]\nraise_message = "{CUDA_OOM}"\narmed_by = "{arm}"\n')
    big = chat_body("word " * 300, max_tokens=64)
    with httpx.Client(timeout=60) as client:
        arm.touch()  # the next prefill step raises: this request's
        first = client.post(server.url + "/v1/chat/completions", json=big)
        assert first.status_code == 200, first.text  # re-run after the restart
        assert not arm.exists()
        [error] = server.events("engine_error")
        assert error["classification"] == "out_of_memory"
        [lowered] = server.wait_for_event("kv_budget_lowered")
        assert 0 < lowered["kv_budget_bytes"] < lowered["kv_budget_configured_bytes"]
        again = client.post(server.url + "/v1/chat/completions", json=big)  # over the cap: alone
        assert again.status_code == 200, again.text
        assert len(server.events("engine_error")) == 1


@pytest.mark.skipif(device_reports_free_memory(),
                    reason="the device reports its free memory (CUDA): a request over the measured cap gets "
                    "503 at the door and never runs alone")
def test_a_request_over_the_learned_cap_that_fails_alone_again_lowers_it_no_further(start_server, tmp_path):
    """A request over the cap a failure taught runs alone, reserving the whole cap: less than
    its KV. Its failure says it does not fit now, not that the cap is too high; taken for
    that, each of a client's retries cut the cap by a quarter, until every request ran alone
    and the rest got 429 kv_cache_budget_busy."""
    arm = tmp_path / "arm"
    server = start_server('[guardian]\nplugins = ["tests.plugins.stock_step_faults:StockStepFaults"]\n'
                          f'[stock_step_faults]\nraise_message = "{CUDA_OOM}"\narmed_by = "{arm}"\n'
                          f"[prompt_guard]\nkv_budget_bytes = {CONFIGURED_BUDGET}\nmemory_cap_hold_s = 600.0\n")
    big = chat_body("word " * 300, max_tokens=64)
    with httpx.Client(timeout=60) as client:
        for attempt in range(1, 4):  # the first teaches the cap; the retries run over it, alone
            arm.touch()  # the next step raises: this request's
            answer = client.post(server.url + "/v1/chat/completions", json=big)
            assert answer.status_code == 200, answer.text  # re-run after the restart
            assert not arm.exists() and len(server.events("engine_error")) == attempt
    lowered = server.wait_for_event("kv_budget_lowered", count=3)
    learned = lowered[0]["kv_budget_learned_bytes"]
    assert 0 < learned < CONFIGURED_BUDGET
    assert [(e["kv_budget_bytes"], e["kv_budget_learned_bytes"]) for e in lowered] == [(learned, learned)] * 3


@pytest.mark.parametrize("message, classification", [
    (CUDA_OOM, "out_of_memory"),
    # mlx's Metal allocator when the device gives no buffer (its CUDA one's for managed
    # memory too): it was "unknown", so no shortage was seen, and a request that met it
    # alone was blamed (500, quarantined) instead of told to come back (503).
    (METAL_NO_BUFFER, "out_of_memory"),
    ("[metal::malloc] Resource limit (499000) exceeded.", "metal_resource_limit"),
    ("[metal::malloc] Attempting to allocate 8589934592 bytes which is greater than the maximum allowed "
     "buffer size of 4294967296 bytes.", "metal_buffer_too_large"),
    ("[METAL] Command buffer execution failed: Insufficient Memory "
     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)", "out_of_memory"),
    ("[reshape] Cannot reshape array of size 6 into shape (4).", "unknown"),
])
def test_mlx_allocators_words_are_classified(message, classification):
    """The texts mlx's allocators raise (mlx/backend/metal/allocator.cpp, cuda/allocator.cpp),
    as the engine's failures are classified: a shortage is waited out and caps the KV budget."""
    from guardian.engine.failures import classify

    assert classify(RuntimeError(message)) == classification
    assert classify(MemoryError()) == "out_of_memory"


def test_the_measured_cap_follows_the_device_and_lifts_when_memory_comes_back():
    from guardian.admission.memory_cap import MemoryCap

    free = {"bytes": 1000}
    cap = MemoryCap(margin=0.25, measure=lambda weights: free["bytes"])
    cap.engine_failed(kv_admitted_bytes=2000)
    # The lower of learned (2000 less the margin) and measured (1000 less the margin).
    assert cap.restarted(weights_bytes=0, configured_bytes=5000) == 750
    free["bytes"] = 800  # another process took more
    assert cap.resample(weights_bytes=0, configured_bytes=5000) == (600, False)
    free["bytes"] = 10_000  # and gave it back
    assert cap.resample(weights_bytes=0, configured_bytes=5000) == (None, True)


def test_without_a_measurement_the_learned_cap_holds_until_a_quiet_spell():
    from guardian.admission.memory_cap import MemoryCap

    now = {"s": 0.0}
    cap = MemoryCap(margin=0.25, hold_s=60, measure=lambda weights: None, clock=lambda: now["s"])
    cap.engine_failed(kv_admitted_bytes=2000)
    assert cap.restarted(weights_bytes=0, configured_bytes=5000) == 1500
    now["s"] = 59.0
    assert cap.resample(weights_bytes=0, configured_bytes=5000) == (1500, False)
    now["s"] = 61.0
    assert cap.resample(weights_bytes=0, configured_bytes=5000) == (None, True)



# One ~1,800-token request takes the whole KV budget (the demo model: 512 bytes a
# token); one more may wait for it, at most 20 s; steps of 20 ms hold it ~36 s.
KV_QUEUE = """
[fault_injection]
enabled = true
step_delay_s = 0.02
[prompt_guard]
kv_budget_bytes = 1572864
max_queued = 1
max_queue_wait_s = 20.0
[access]
client_max_concurrent = 2
"""


def test_a_request_waiting_for_kv_memory_keeps_its_deadline_and_its_clients_leaving(start_server):
    """It waited out max_queue_wait_s (20 s) whatever its deadline, then got a 429; and
    one whose client left kept its place in the queue, so the next client got 429 at once."""
    server = start_server(KV_QUEUE)

    def waiting_for_memory() -> int:
        return httpx.get(server.url + "/guardian/status", timeout=5).json()["waiting_for_memory"]

    with send_raw(server.port, chat_body(max_tokens=1800, stream=True)) as hog:
        assert hog.recv(64).startswith(b"HTTP/1.0 200")  # the budget is its
        started = time.monotonic()
        late = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=1800), timeout=30,
                          headers={"x-stainless-read-timeout": "1.5"})
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded", late.text
        assert time.monotonic() - started < 5
        with send_raw(server.port, chat_body(max_tokens=1800)):
            poll(lambda: waiting_for_memory() == 1, 10, what="a request waiting for KV memory")
        poll(lambda: waiting_for_memory() == 0, 10, what="the place of the request whose client left")
        # Its place is free, and its place among its client's two: the next one waits in it
        # (here until its deadline), no 429.
        after = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=1800), timeout=30,
                           headers={"x-stainless-read-timeout": "1"})
        assert after.status_code == 504, after.text
    # Neither reached the engine: refused at admission, for their deadlines.
    assert scraped(server, "mlx_guardian_requests_refused_total", code="deadline_exceeded") == 2

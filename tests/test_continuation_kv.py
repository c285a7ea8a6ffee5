"""Continuations that cost little: a re-run starts from the KV its failed batch held.

When the engine fails between steps, each request's KV cache in stock's
batch is a completed step's: the guardian copies it out before the dead loop
goes (guardian.engine.kept_kv), and the request's re-run prefills only the
last token of its prompt (a continuation's prompt: the prompt, then the
tokens already generated) instead of all of it. A failure inside stock's
step may leave the caches half written: then nothing is kept, and the re-run
prefills as before. Either way a greedy stream goes on with the very text of
an unfailed run (tests/test_continuation.py covers the seam itself).
"""

from __future__ import annotations

import threading

import httpx
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from conftest import arm, chat_body, poll, read_stream
from test_continuation import CHAT, continued_events, greedy, streamed, token_faults, unfailed

from guardian.engine.kept_kv import KeptKV

STEP_FAULTS = '[guardian]\nplugins = ["tests.plugins.stock_step_faults:StockStepFaults"]\n'


def status(server) -> dict:
    return httpx.get(server.url + "/guardian/status", timeout=10).json()


def prefilled(event: dict) -> int:
    """Prompt tokens a continuation prefilled again (request_continuation_started)."""
    return event["prompt_tokens"] - event["cached_tokens"]


def test_a_continued_stream_prefills_one_token_from_its_kept_kv(start_server):
    # The failure comes while stock formats the request's 25th token
    # (tests/plugins/token_faults.py): its step completed, so its KV is intact.
    server = start_server(token_faults())
    body = greedy(max_tokens=50, stream=True, top_logprobs=2, stream_options={"include_usage": True})
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + CHAT, body)
    assert result["done"] and not result["errors"], result
    [kept] = server.events("continuation_kv_kept")
    assert kept["requests"] == 1
    [started] = server.events("request_continuation_started")
    assert started["generated"] == 24
    assert prefilled(started) == 1, started  # without the kept KV: the 24 tokens generated and more
    counts = status(server)
    assert counts["continuation_kv"]["reused"] == 1
    assert counts["rerun_prompt_tokens"] - counts["rerun_prompt_tokens_cached"] == 1
    got, expected = streamed(result), unfailed(server, CHAT, body)
    assert got["text"] == expected["text"]
    assert got["usage"] == expected["usage"]


def test_every_request_in_the_batch_goes_on_from_its_own_kv(start_server):
    # Three requests decoding when a fault is planted before a step (the
    # fault-injection plugin): each continuation finds its own row's KV.
    server = start_server("[fault_injection]\nenabled = true\nat_step = 8\nmin_started = 3\n"
                          "max_faults = 1\nstep_delay_s = 0.01\n"
                          "[watchdog]\nprobe_interval_s = 3600.0\n")  # no probe's row in the batch
    results, threads = {}, []

    def send(name: str, body: dict) -> None:
        with httpx.Client(timeout=60) as client:
            if body["stream"]:
                results[name] = streamed(read_stream(client, server.url + CHAT, body))
            else:
                results[name] = client.post(server.url + CHAT, json=body).json()

    bodies = {f"request {i}": greedy(content=f"Tell me story number {i}.", max_tokens=40)
              for i in range(3)}
    for i in (0, 2):
        bodies[f"request {i}"].update(stream=True, stream_options={"include_usage": True})
    for name, body in bodies.items():
        threads.append(threading.Thread(target=send, args=(name, body), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 3, results
    [_] = server.events("engine_error")
    [kept] = server.events("continuation_kv_kept")
    assert kept["requests"] == 3
    starts = server.events("request_continuation_started")
    assert len(starts) == len(continued_events(server)) == 3
    assert [prefilled(event) for event in starts] == [1, 1, 1], starts
    assert status(server)["continuation_kv"] == {"kept": 3, "reused": 3, "dropped": 0,
                                                 "reused_tokens": sum(e["cached_tokens"] for e in starts),
                                                 "held": 0}
    for name, got in results.items():
        usage = got["usage"]
        assert usage["completion_tokens"] == 40, (name, got)


def test_a_failure_inside_stocks_step_keeps_nothing_and_the_stream_still_goes_on(start_server, tmp_path):
    # A request's prefill step raises inside stock's own BatchGenerator.next
    # (tests/plugins/stock_step_faults.py), while a stream decodes beside it:
    # the step may have written the stream's KV half way, so the continuation
    # prefills its generated tokens again, and its text is still the unfailed one.
    arm_file = tmp_path / "arm"
    server = start_server(STEP_FAULTS + f'[stock_step_faults]\nraise_message = "planted in the step"\n'
                          f'armed_by = "{arm_file}"\n[fault_injection]\nenabled = true\nstep_delay_s = 0.02\n')
    # 200 tokens: the stream still decodes (~3.5 s left) when the other request's prefill
    # fails, after the polls and a loaded machine's delays (60 left ~1 s).
    body = greedy(max_tokens=200, stream=True, stream_options={"include_usage": True})
    result = {}

    def stream() -> None:
        with httpx.Client(timeout=60) as client:
            result.update(read_stream(client, server.url + CHAT, body))

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    steps = poll(lambda: status(server)["in_flight"] and status(server)["steps"], 10, what="the stream taken")
    poll(lambda: status(server)["steps"] >= steps + 10, 10, what="the stream decoding")
    arm(arm_file, 1)
    with httpx.Client(timeout=60) as client:
        other = client.post(server.url + CHAT, json=chat_body("Another request.", max_tokens=8))
    thread.join(timeout=60)
    assert other.status_code == 200, other.text
    assert result["done"] and not result["errors"], result
    assert server.events("stock_step_raise")
    [discarded] = server.events("continuation_kv_discarded")
    assert "middle of a step" in discarded["reason"]
    assert not server.events("continuation_kv_kept")
    [started] = server.events("request_continuation_started")
    assert prefilled(started) > started["generated"]  # its generated tokens, prefilled again
    got, expected = streamed(result), unfailed(server, CHAT, body)
    assert got["text"] == expected["text"]
    assert got["usage"] == expected["usage"]


# -- the store itself, on real (tiny) KV caches ---------------------------------

def kv(tokens: int) -> list:
    """A one-layer KV cache holding ``tokens`` positions."""
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, tokens, 4)), mx.zeros((1, 1, tokens, 4)))
    return [cache]


def test_a_rerun_takes_the_kept_cache_with_the_longest_prefix_cut_to_leave_one_token():
    kept = KeptKV()
    kept.keep("model", [([1, 2, 3, 9], kv(4)), ([1, 2, 3, 4, 5, 6], kv(6)), ([7, 8], kv(2))])
    cache, rest = kept.take("model", [1, 2, 3, 4, 5])
    # The row one token ahead of the prompt (its last token not yet sent) is cut
    # back to leave the prompt's last token to prefill.
    assert rest == [5] and cache[0].offset == 4
    assert kept.take("other model", [7, 8, 1]) is None  # another model's KV is never used
    cache, rest = kept.take("model", [7, 8, 1])
    assert rest == [1] and cache[0].offset == 2
    assert kept.status() == {"kept": 3, "reused": 2, "dropped": 0, "reused_tokens": 6, "held": 1}
    assert kept.take("model", [5, 5]) is None  # no prefix in common
    assert kept.drop() == 1 and not len(kept)


def test_a_kept_cache_that_holds_exactly_the_prompt_leaves_its_last_token_to_prefill():
    kept = KeptKV()
    kept.keep("model", [([1, 2, 3], kv(3))])
    cache, rest = kept.take("model", [1, 2, 3])
    assert rest == [3] and cache[0].offset == 2  # stock samples the next token from that prefill

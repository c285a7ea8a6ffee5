"""Subprocess mode continues a stream across its child's death.

A stream (chat or text completion) cut by a SIGKILL or SIGSEGV of its child goes on from the next
child, after the tokens its client already has (guardian.relay_protocol):
the client sees one stream. At temperature 0 the demo model's argmax is
deterministic, so the continued stream must be the one an unfailed run
gives, token for token, with the same finish_reason and usage. Uses
test_supervisor's fixture (cleanup kills each supervisor's process group).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from conftest import RELAYED, chat_body, poll, scraped
from guardian.supervise.client_writes import STREAM_KEEPALIVE, StreamKeepAlive
from test_continuation import streamed
from test_continuation import TEXT as TEXT_COMPLETIONS
from test_supervisor import (COMPLETIONS, SLOW_STEPS, assert_restarting_error, start_supervisor,  # noqa: F401
                             with_supervisor_hooks)


def greedy_stream(content: str, max_tokens: int) -> dict:
    return chat_body(content, max_tokens=max_tokens, stream=True, temperature=0.0,
                     stream_options={"include_usage": True})


class StreamReader(threading.Thread):
    """Reads one stream in the background: its raw lines and data events, as they come."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.result = {"status": None, "events": [], "done": False, "errors": []}
        self.raw_lines: list[str] = []

    def run(self):
        # As JSON's ASCII text (json.dumps' default), which carries a lone surrogate as its
        # escape; httpx's json= writes UTF-8, which has none.
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", self.url, content=json.dumps(self.body), headers={"Content-Type": "application/json"}) \
                as response:
            self.result["status"] = response.status_code
            self.headers = response.headers
            for line in response.iter_lines():
                self.raw_lines.append(line)
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.result["done"] = True
                    continue
                event = json.loads(line[len("data: "):])
                self.result["events"].append(event)
                if "error" in event:
                    self.result["errors"].append(event["error"])


def read_whole(url: str, body: dict) -> StreamReader:
    reader = StreamReader(url, body)
    reader.run()
    return reader


def reference_and_cut(url: str, body: dict, pid: int, signum: int, after_events) -> tuple:
    """The stream unfailed, then again with its child killed by ``signum`` once
    ``after_events(reference)`` events were relayed: (reference, cut, that many), both
    read whole."""
    reference = read_whole(url, body)
    assert reference.result["done"] and not reference.result["errors"]
    cut = StreamReader(url, body)
    cut.start()
    events_before_kill = after_events(reference)
    poll(lambda: len(cut.result["events"]) >= events_before_kill, 60, what=f"{events_before_kill} events relayed")
    os.kill(pid, signum)
    cut.join(timeout=120)
    assert not cut.is_alive()
    return reference, cut, events_before_kill


@pytest.mark.parametrize("signum, path, hand_off", [
    (signal.SIGKILL, COMPLETIONS, True), (signal.SIGSEGV, TEXT_COMPLETIONS, True),
    # Relayed: the Mac's path, where nothing is handed off (conftest.RELAYED).
    pytest.param(signal.SIGKILL, COMPLETIONS, False, marks=RELAYED.marks)])
def test_a_stream_cut_by_the_childs_death_is_continued_on_the_next_child(start_supervisor, tmp_path, signum, path,
                                                                          hand_off):
    config = tmp_path / "slow.toml"
    # Steps of at least 10 ms: the kill lands mid-stream (240 tokens: ~1.6 s left after the
    # first third, for a loaded client reading behind what was sent).
    config.write_text(SLOW_STEPS + ("" if hand_off else "[supervisor]\nhand_off = false\n"))
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    body = greedy_stream("Go on across the crash.", max_tokens=240)
    if path == TEXT_COMPLETIONS:
        body = {**{k: v for k, v in body.items() if k != "messages"}, "prompt": "Go on across the crash."}
    else:
        # A lone surrogate, valid JSON as "\\ud800": the crash's suspects are fingerprinted from
        # the bodies in flight, and this one's once ended the supervisor (UnicodeEncodeError).
        body["user"] = "\ud800"
    # A third of the way (the demo model's text completions send fewer events than tokens).
    reference, cut, events_before_kill = reference_and_cut(
        supervised.url + path, body, first_pid, signum, lambda reference: len(reference.result["events"]) // 3)

    assert cut.result["status"] == 200 and cut.result["done"], cut.result
    assert not cut.result["errors"]
    assert streamed(cut.result) == streamed(reference.result)
    # The next child's prompt cache hits were of its longer prompt: of the client's, at most all.
    [usage] = [e["usage"] for e in cut.result["events"] if e.get("usage")]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage
    # One stream: every event carries the first child's id and created.
    assert {(e["id"], e["created"]) for e in cut.result["events"]} == {
        (cut.result["events"][0]["id"], cut.result["events"][0]["created"])}
    # The child's tags and headers stay between it and the supervisor.
    assert not any(line.startswith(": guardian-tokens") for line in cut.raw_lines)
    assert not any(name.lower().startswith("x-guardian-continu") for name in cut.headers)
    [continuing] = supervised.supervisor_events("stream_continuing")
    assert continuing["dead_child_pid"] == first_pid and continuing["tokens_relayed"] >= events_before_kill
    second_pid = supervised.wait_ready(not_pid=first_pid, timeout=30)
    assert second_pid != first_pid
    # The next child, which served the continuation alone, counts its client's prompt: the
    # tokens it went on after are a re-run's prefill (they were counted as prompt tokens).
    # Counted as the request ends, which may come after its client read the last event (a
    # loaded CI run scraped 0 of 25).
    poll(lambda: scraped(supervised, "mlx_guardian_prompt_tokens_total") == usage["prompt_tokens"], 10,
         what=f"{usage['prompt_tokens']} prompt tokens counted")
    child = httpx.get(supervised.url + "/guardian/status", timeout=10).json()
    assert child["rerun_prompt_tokens"] >= continuing["tokens_relayed"], child["rerun_prompt_tokens"]
    if not hand_off:  # the reference and the cut stream, each through the supervisor
        passed = "mlx_guardian_supervisor_requests_passed_total"
        assert scraped(supervised, passed, how="handed_off") == 0 and scraped(supervised, passed, how="relayed") >= 2
    print(f"\nmeasured: {continuing['tokens_relayed']} tokens relayed before the "
          f"{signal.Signals(signum).name}; the stream went on from the next child, identical to an unfailed run")


def test_a_stream_longer_than_the_head_limit_is_continued(start_supervisor, tmp_path):
    """The ids a continuation goes on after travel in the child's head, which the public
    door's max_header_bytes bounded: past it (here 1,024 bytes, ~250 of the demo model's
    ids; at the default 64 KiB, ~10,000 of a large vocabulary's) the child refused the
    continuation (431) and the stream ended with an error event."""
    config = tmp_path / "small-heads.toml"
    config.write_text(SLOW_STEPS + "[http]\nmax_header_bytes = 1024\n")
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    body = greedy_stream("Go on across the crash, at length.", max_tokens=600)  # ~3 s left after 300
    reference, cut, _ = reference_and_cut(supervised.url + COMPLETIONS, body, first_pid, signal.SIGKILL,
                                          lambda _: 300)

    assert cut.result["status"] == 200 and cut.result["done"] and not cut.result["errors"], cut.result
    assert streamed(cut.result) == streamed(reference.result)
    [continuing] = supervised.supervisor_events("stream_continuing")
    assert continuing["tokens_relayed"] >= 300
    assert not supervised.supervisor_events("stream_continuation_refused")


def test_a_clamped_stream_continued_on_the_next_child_ends_where_it_would_have(start_supervisor, tmp_path):
    """A prompt near the context, max_tokens past it: the door clamps max_tokens to what
    fits. The next child counted the prompt without the tokens its continuation went on
    after, and clamped again after them: 78 tokens where 58 fitted, past the context (a
    review, 3 of 3)."""
    config = tmp_path / "slow.toml"
    # 50 ms steps: ~58 tokens fit, and the kill after 20 leaves ~1.9 s (0.4 s at 10 ms).
    config.write_text(SLOW_STEPS.replace("step_delay_s = 0.01", "step_delay_s = 0.05"))
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    body = {"prompt": "Once upon a time. " + "hello there " * 495, "max_tokens": 500, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    reference, cut, _ = reference_and_cut(supervised.url + TEXT_COMPLETIONS, body, first_pid, signal.SIGKILL,
                                          lambda _: 20)
    assert cut.result["status"] == 200 and cut.result["done"] and not cut.result["errors"], cut.result
    usage = streamed(reference.result)["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 2048  # the demo model's context, filled
    assert streamed(cut.result) == streamed(reference.result)
    assert supervised.supervisor_events("stream_continuing")


def test_a_stream_with_a_stop_string_is_continued(start_supervisor, tmp_path):
    """On 0.32, text held back for a stop string made a stream not continuable: a child's
    death cut it with an error event (a review, 4 of 4; fine on 0.31.3)."""
    config = tmp_path / "slow.toml"
    # 50 ms steps: the kill lands mid-stream. At 10 ms the 80 tokens' second half took
    # ~0.4 s, and under a loaded run's six workers the kill came after the stream's end.
    config.write_text(SLOW_STEPS.replace("step_delay_s = 0.01", "step_delay_s = 0.05"))
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    body = {"prompt": "The lighthouse keeper wrote", "max_tokens": 80, "temperature": 0.0, "stream": True,
            "stop": ["cheese sandwich"], "stream_options": {"include_usage": True}}
    reference, cut, _ = reference_and_cut(supervised.url + TEXT_COMPLETIONS, body, first_pid, signal.SIGKILL,
                                          lambda reference: len(reference.result["events"]) // 2)
    assert cut.result["status"] == 200 and cut.result["done"] and not cut.result["errors"], cut.result
    assert streamed(cut.result) == streamed(reference.result)
    assert supervised.supervisor_events("stream_continuing")


def test_a_continuations_ids_are_written_in_lines_http_server_reads():
    """A long stream's ids (7 bytes each for a vocabulary of 150,000) in one header line
    passed 64 KiB, which http.server reads no more of; in lines, they come back whole."""
    import http.client
    import io

    from guardian import relay_protocol
    from guardian.serving import framing

    for tokens in ([], [7], list(range(140_000, 160_000))):
        headers = relay_protocol.continue_headers("key", tokens)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n" + b"".join(
            f"{name}: {value}\r\n".encode() for name, value in headers) + b"\r\n"
        framing.judge_head(head, framing.STDLIB_MAX_HEADERS)  # no line past http.server's
        parsed = http.client.parse_headers(io.BytesIO(head.partition(b"\r\n")[2]))
        assert relay_protocol.continued_from(parsed, vocab_size=None) == tokens
    assert len(headers) == 4  # the key, and 140,000 bytes of ids in three lines


def test_a_client_cannot_claim_to_be_the_supervisor(start_supervisor):
    """The continuation headers from a client are dropped at the public port;
    a child answers them only with the supervisor's key."""
    supervised = start_supervisor()
    supervised.wait_ready()
    body = greedy_stream("Who is asking?", max_tokens=8)
    honest = read_whole(supervised.url + COMPLETIONS, body)
    forged = StreamReader(supervised.url + COMPLETIONS, body)
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", supervised.url + COMPLETIONS, json=body,
            headers={"X-Guardian-Continue-From": "1,2,3", "X-Guardian-Relay-Key": "guess",
                     "X-Guardian-Key-Name": "mallory"}) as response:
        forged.result["status"] = response.status_code
        lines = list(response.iter_lines())
    assert forged.result["status"] == 200
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", [])) == \
        streamed(honest.result)["text"]
    # Nor can it name the API key that let it in (no key is configured: none did).
    def completion_lines():
        return [e for e in supervised.events("http_access") if COMPLETIONS in e.get("line", "")]

    poll(lambda: len(completion_lines()) >= 2, 10, what="both streams' access lines")
    assert not [e for e in completion_lines() if "api_key" in e]
    # Straight to the child, without the key: refused (it serves only its supervisor), nothing tagged.
    child_url = f"http://127.0.0.1:{supervised.supervisor()['child']['port']}"
    direct = httpx.post(child_url + COMPLETIONS, json=body, timeout=30,
                        headers={"X-Guardian-Continue-From": "1,2,3", "X-Guardian-Relay-Key": "guess"})
    assert direct.status_code == 403 and direct.json()["error"]["code"] == "not_from_supervisor"
    assert ": guardian-tokens" not in direct.text


def test_past_max_resends_a_cut_stream_ends_with_an_error_event(start_supervisor, tmp_path):
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS)
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-max-resends", "0")
    first_pid = supervised.wait_ready()
    cut = StreamReader(supervised.url + COMPLETIONS, greedy_stream("No second chance.", max_tokens=200))
    cut.start()
    poll(lambda: len(cut.result["events"]) >= 10, 60, what="10 events relayed")
    os.kill(first_pid, signal.SIGKILL)
    cut.join(timeout=60)
    assert cut.result["done"]
    [error] = cut.result["errors"]
    assert_restarting_error({"error": error})
    assert not supervised.supervisor_events("stream_continuing")


def test_a_stream_whose_text_stops_matching_its_tokens_is_marked_not_continuable():
    """Stock holds text back (a tool call, reasoning) or writes text no token
    carried: from that event on, the child says so and the supervisor will not
    continue the stream (a cut ends it with an error event, as before)."""
    import io

    from guardian.relay_protocol import RelayedStream, TokenTaggingOutput

    wire = io.BytesIO()
    output = TokenTaggingOutput(wire)
    event = b'data: {"id": "c1", "created": 7, "choices": [{"delta": {"content": "%s"}}]}\n\n'
    output.consumed(11, "Hi")
    output.write(event % b"Hi")  # the tokens' text exactly: tagged
    output.consumed(12, "<tool")
    output.write(event % b"")  # stock held "<tool" back: not what the tokens said
    output.consumed(13, " there")
    output.write(event % b" there")
    assert not output.continuable

    stream = RelayedStream()
    relayed = stream.relay(wire.getvalue())
    assert stream.tokens == [11] and not stream.continuable
    assert b"guardian-tokens" not in relayed and relayed.count(b"data: ") == 3


def test_text_held_back_for_a_stop_string_is_tagged_once_it_catches_up():
    """0.32 holds back text that may begin a stop string, mid-token: "attic" wrote "atti",
    and the "c" came with the next token's event. That marked the stream not continuable
    (on 0.32, nearly any stop string: a review, 4 of 4). The event is held until the text
    catches up, then both go out under one tag."""
    import io

    from guardian.relay_protocol import RelayedStream, TokenTaggingOutput

    wire = io.BytesIO()
    output = TokenTaggingOutput(wire)
    event = b'data: {"id": "c1", "created": 7, "choices": [{"index": 0, "text": "%s"}]}\n\n'
    output.consumed(11, "The")
    output.write(event % b"The")
    output.consumed(12, " attic")
    output.write(event % b" atti")  # "c" held back: it may begin "cheese sandwich"
    assert wire.getvalue().count(b"data: ") == 1  # held here too
    output.consumed(13, " door")
    output.write(event % b"c door")
    assert output.continuable
    stream = RelayedStream()
    relayed = stream.relay(wire.getvalue())
    assert stream.tokens == [11, 12, 13] and stream.continuable
    assert relayed.count(b"data: ") == 3 and b"guardian-tokens" not in relayed

    # Held, then the stop string matched: its text is never written. The held event goes
    # out with the end (after the last token the end is written whole, or not at all).
    wire = io.BytesIO()
    output = TokenTaggingOutput(wire)
    output.consumed(21, " attic")
    output.write(event % b" atti")
    output.consumed(22, "heese")
    output.consumed(23, " sandwich")
    output.write(b'data: {"id": "c1", "created": 7, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}\n\n')
    output.write(b"data: [DONE]\n\n")
    output.release()
    assert wire.getvalue().count(b"data: ") == 3


def test_a_tokens_text_that_says_data_done_ends_no_stream():
    """A model that wrote "data: [DONE]" as text (an example of SSE, held back by a stop
    string and written as one event) ended the stream for the supervisor: a raw search of
    the bytes found it, and when the child died next the client's stream was cut without
    an error event, never continued (a hunt; both modes). Only an event of its own ends it."""
    from guardian.handoff import ClientView
    from guardian.relay_protocol import EventRelay, RelayedStream

    text_event = b'data: {"choices": [{"delta": {"content": "Example: data: [DONE] then"}}]}\n\n'
    relay = EventRelay(RelayedStream())
    relay.pass_on(text_event)
    assert not relay.done
    relay.pass_on(b"data: [DONE]\n\n")
    assert relay.done
    view = ClientView()
    view.visible(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + text_event)
    assert not view.complete
    from guardian.relay_protocol import ends_stream
    assert ends_stream(b"data: [DONE]\r\n\r\n") and not ends_stream(b'data: {"text": "x\\ndata: [DONE]\\n"}\n\n')


def test_events_held_for_lagging_text_are_bounded():
    """Text that never catches up with its tokens' (a stop string's start that grows for
    ever) held every event until the end: past MAX_LAGGING_EVENTS they go out, marked not
    continuable, so the client is never kept waiting on them."""
    import io

    from guardian.relay_protocol import MAX_LAGGING_EVENTS, RelayedStream, TokenTaggingOutput

    wire = io.BytesIO()
    output = TokenTaggingOutput(wire)
    event = b'data: {"id": "c1", "created": 7, "choices": [{"index": 0, "text": "%s"}]}\n\n'
    for token in range(MAX_LAGGING_EVENTS):
        output.consumed(token, "ab")
        output.write(event % (b"ba" if token else b"a"))  # "a", "aba", "ababa": a token behind
    assert wire.getvalue() == b"" and output.continuable
    output.consumed(MAX_LAGGING_EVENTS, "ab")
    output.write(event % b"ba")
    assert wire.getvalue().count(b"data: ") == MAX_LAGGING_EVENTS + 1 and not output.continuable
    stream = RelayedStream()
    stream.relay(wire.getvalue())
    assert not stream.continuable


GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                             "parameters": {"type": "object", "properties": {}}}}
TOOL_CALL_SCRIPT = 'Let me check. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_a_stream_cut_inside_a_tool_call_is_continued_to_one_call(start_supervisor, tmp_path, model_cache):
    """Stock writes the text before a tool call with part of the call's first
    token's text (the detokenizer held a space back, and stock splits it from
    the "<"), then holds the call back until it is complete. That event is held
    until its text catches up with its tokens' (guardian.relay_protocol), so the
    client has nothing past the last tag: a cut while the call is written is
    continued on the next child from there, and the client gets the text once
    and the call once. (It was marked not continuable, and the cut ended the
    stream with an error event. The demo model's tool call is scripted,
    tests/plugins/scripted_tokens.py.)"""
    from mlx_lm.utils import load_tokenizer

    from guardian.demo_model import ensure_demo_model

    tokenizer = load_tokenizer(ensure_demo_model(model_cache))
    script = [*tokenizer.encode(TOOL_CALL_SCRIPT, add_special_tokens=False), tokenizer.eos_token_id]
    config = tmp_path / "tool-call.toml"
    config.write_text('[guardian]\nplugins = ["tests.plugins.scripted_tokens:ScriptedTokens"]\n'
                      f"[scripted_tokens]\ntoken_ids = {script}\nrepetition_penalty = 1.01\n"
                      # 50 ms steps: the call takes ~1.5 s to write.
                      + SLOW_STEPS.replace("0.01", "0.05"))
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    body = chat_body("What time is it?", max_tokens=100, stream=True, temperature=0.0,
                     repetition_penalty=1.01, tools=[GET_TIME])
    reference = read_whole(supervised.url + COMPLETIONS, body)
    assert reference.result["done"] and not reference.result["errors"]
    [call] = [tc for e in reference.result["events"] for c in e["choices"]
              for tc in c["delta"].get("tool_calls") or ()]
    assert call["function"]["name"] == "get_time"

    cut = StreamReader(supervised.url + COMPLETIONS, body)
    cut.start()
    poll(lambda: "check." in streamed(cut.result)["text"], 60, what="the text before the call")
    # The child's status, through the supervisor (the child serves only its supervisor).
    child_status = supervised.url + "/guardian/status"
    steps = httpx.get(child_status, timeout=5).json()["steps"]
    # Some 5 tokens into the call: stock holds them back, nothing more reaches the client.
    poll(lambda: httpx.get(child_status, timeout=5).json()["steps"] >= steps + 5, 30, what="the call begun")
    os.kill(first_pid, signal.SIGKILL)
    cut.join(timeout=120)
    assert not cut.is_alive()
    assert cut.result["status"] == 200 and cut.result["done"] and not cut.result["errors"], cut.result
    assert streamed(cut.result)["text"] == streamed(reference.result)["text"] == "Let me check. "
    calls = [tc for e in cut.result["events"] for c in e["choices"] for tc in c["delta"].get("tool_calls") or ()]
    assert [c["function"] for c in calls] == [call["function"]]
    assert supervised.supervisor_events("stream_continuing")
    [lost] = supervised.supervisor_events("proxy_child_lost")
    assert lost["child_pid"] == first_pid and lost["bytes_sent"]
    # The next child serves the same request whole.
    supervised.wait_ready(not_pid=first_pid)
    again = read_whole(supervised.url + COMPLETIONS, body)
    assert again.result["done"] and not again.result["errors"]
    assert [tc["function"] for e in again.result["events"] for c in e["choices"]
            for tc in c["delta"].get("tool_calls") or ()] == [call["function"]]


def test_a_stream_that_progressed_between_two_crashes_is_no_poison(start_supervisor, tmp_path):
    # Two children die under one stream, with tokens relayed between the two
    # deaths: the crash quarantine strikes it once at each (it progressed), so
    # it is neither quarantined nor refused; on main the second crash made it a
    # poison body (two strikes) and the stream ended with request_quarantined.
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS)  # steps of at least 10 ms: each kill lands mid-stream
    # At the default max_resends (1): a stream that progressed counts its resends from 0
    # again, as in one process (it ended with an error event at the second death before).
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    body = greedy_stream("Go on across two crashes.", max_tokens=300)
    reference = read_whole(supervised.url + COMPLETIONS, body)
    assert reference.result["done"] and not reference.result["errors"]

    cut = StreamReader(supervised.url + COMPLETIONS, body)
    cut.start()
    poll(lambda: len(cut.result["events"]) >= 60, 60, what="events relayed from the first child")
    os.kill(first_pid, signal.SIGKILL)
    second_pid = supervised.wait_ready(not_pid=first_pid, timeout=60)
    at_first_crash = len(cut.result["events"])
    poll(lambda: len(cut.result["events"]) >= at_first_crash + 60, 60, what="events relayed from the second child")
    os.kill(second_pid, signal.SIGKILL)
    cut.join(timeout=120)
    assert not cut.is_alive()

    assert cut.result["status"] == 200 and cut.result["done"] and not cut.result["errors"], cut.result["errors"]
    assert streamed(cut.result) == streamed(reference.result)
    first, second = supervised.supervisor_events("crash_suspects")
    assert [s["strikes"] for s in first["suspects"]] == [1]
    [struck] = second["suspects"]
    assert struck["strikes"] == 1 and struck["progressed"] and not struck["quarantined"]
    assert struck["position"] > first["suspects"][0]["position"] > 0
    quarantine = supervised.supervisor()["quarantine"]
    assert quarantine["quarantined"] == [] and quarantine["refused"] == 0


def test_a_stream_let_in_at_the_memory_floor_is_continued_on_the_next_child(start_supervisor, tmp_path):
    """Memory admission paused for good (1-byte thresholds: anything is over them), a stream
    is let in at the floor; its child dies. Its continuation is a request to the next child,
    whose start-up probe had just filled mlx's buffer cache: refused 429 memory_pressure
    there, the stream ended with engine_restarting, cut (a hunt). A continuation is a
    stream let in before: memory admission lets it through."""
    config = tmp_path / "floor.toml"
    config.write_text(SLOW_STEPS + "[resources]\ntrim_above_bytes = 1\nrefuse_above_bytes = 1\nresume_below_bytes = 1\n")
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    body = greedy_stream("Go on past the memory line.", max_tokens=240)

    def let_in() -> "StreamReader":
        reader = StreamReader(supervised.url + COMPLETIONS, body)
        reader.start()
        poll(lambda: reader.result["status"] is not None, 60, what="the stream's status")
        if reader.result["status"] == 200:
            return reader
        reader.join(timeout=30)
        assert reader.result["status"] == 429, reader.result
        return None

    cut = poll(let_in, 60, interval=0.2, what="the stream let in at the floor")
    poll(lambda: len(cut.result["events"]) >= 60, 60, what="events relayed before the kill")
    os.kill(first_pid, signal.SIGKILL)
    cut.join(timeout=120)
    assert not cut.is_alive()
    assert cut.result["done"] and not cut.result["errors"], cut.result["errors"]
    [continuing] = supervised.supervisor_events("stream_continuing")
    assert continuing["dead_child_pid"] == first_pid
    assert not supervised.supervisor_events("stream_continuation_refused")
    whole = streamed(cut.result)
    assert whole["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 240, whole


def test_streams_waiting_for_the_next_child_are_kept_alive(start_supervisor, tmp_path):
    """Two identical streams whose child died wait for the next one: its start (a model's
    load; here a start held 4 s), then their turns to run alone, sent nothing, and a client
    reading with a 2.5 s timeout (httpx's, the openai SDK's timeout=) gave up. SSE comments
    keep them reading. The second's usage counted the first's continuation, cached in the
    next child's prompt cache, as its prompt's (31 cached of 17)."""
    config = tmp_path / "slow.toml"
    config.write_text(SLOW_STEPS + '[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n'
                      "[slow_start]\nhold_s = 4.0\n")
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    streams = [[], []]

    def read(lines: list) -> None:
        with httpx.Client(timeout=httpx.Timeout(2.5)) as client, client.stream(
                "POST", supervised.url + COMPLETIONS, json=greedy_stream("Go on, slowly.", max_tokens=240)) \
                as response:
            lines.extend(response.iter_lines())

    readers = [threading.Thread(target=read, args=(lines,), daemon=True) for lines in streams]
    for reader in readers:
        reader.start()
    poll(lambda: all(len(lines) >= 20 for lines in streams), 60, what="both streams under way")
    supervised.signal_child(first_pid, signal.SIGKILL)
    for reader in readers:
        reader.join(timeout=120)
    assert {e["dead_child_pid"] for e in supervised.supervisor_events("stream_continuing")} == {first_pid}
    for lines in streams:
        assert [line for line in lines if line][-1] == "data: [DONE]" and '"error"' not in "".join(lines)
        assert lines.count(": keepalive") >= 3, lines  # 4 s and more without the next child
        [usage] = [json.loads(line[len("data: "):])["usage"] for line in lines
                   if line.startswith("data: {") and '"usage"' in line]
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage


def test_a_cut_streams_keepalives_come_every_stream_keepalive_s_and_none_at_0():
    """The supervisor's comments to a stream waiting for the next child follow ``[guardian]
    stream_keepalive_s`` (a constant second before): the first at once, then one a period."""
    ours, clients = socket.socketpair()
    clients.settimeout(5)
    received = bytearray()
    try:
        beats = StreamKeepAlive(ours, 0.05)
        started = time.monotonic()
        beats.start()
        poll(lambda: received.extend(clients.recv(4096)) or received.count(STREAM_KEEPALIVE) >= 4,
             5, interval=0, what="four keepalives")
        elapsed = time.monotonic() - started
        beats.stop()
        assert elapsed >= 0.15  # three periods after the first: no faster than the setting
        # What it sent before it stopped is all in the buffer now (its thread has ended).
        clients.setblocking(False)
        while True:
            try:
                assert clients.recv(4096)
            except BlockingIOError:
                break
        clients.settimeout(5)
        none = StreamKeepAlive(ours, 0.0)
        none.start()
        none.stop()
        ours.shutdown(socket.SHUT_WR)
        assert clients.recv(4096) == b""  # the end, and nothing before it
    finally:
        ours.close()
        clients.close()


def test_a_stream_through_a_stall_that_ends_its_child_keeps_a_2_s_read_timeout(start_supervisor, tmp_path):
    """Stock's step hangs 6 s under a stream, and the stall's rung is exit: the child's
    keepalives (a second into the silence) stop as it exits, and the supervisor's first
    came a second after that: 2.0-2.3 s of silence, and a client reading with a 2 s timeout
    (the openai SDK's timeout=2.0) gave up. The supervisor's first comes at once now."""
    armed = tmp_path / "slow-token"
    config = tmp_path / "stall-exit.toml"
    config.write_text('[guardian]\nplugins = ["tests.plugins.stock_step_faults:StockStepFaults"]\n'
                      f'[stock_step_faults]\ntoken_delay_s = 6.0\ntoken_delay_armed_by = "{armed}"\n'
                      # Steps of 10 ms at least: the stream is still under way when its first
                      # token arms the slow one (its 200 tokens take ~0.1 s unslowed).
                      'delay_s = 0.01\n'
                      '[watchdog]\nladder = ["exit"]\n')
    supervised = start_supervisor("--guardian-config", str(config))
    first_pid = supervised.wait_ready()
    lines = []
    with httpx.Client(timeout=httpx.Timeout(2.0)) as client, client.stream(
            "POST", supervised.url + COMPLETIONS, json=greedy_stream("Go on through a stall.", max_tokens=200)) \
            as response:
        for line in response.iter_lines():  # a read timeout here fails the test
            lines.append(line)
            if line.startswith("data: {") and not armed.exists() and not supervised.events("stock_step_slow_token"):
                armed.touch()  # the next step that makes a token hangs
    assert supervised.events("stock_step_slow_token") and supervised.events("engine_stalled")
    assert {e["dead_child_pid"] for e in supervised.supervisor_events("stream_continuing")} == {first_pid}
    assert [line for line in lines if line][-1] == "data: [DONE]" and '"error"' not in "".join(lines)
    assert sum(line.startswith(": keepalive") for line in lines) >= 3


@pytest.mark.parametrize("hand_off", [True, pytest.param(False, marks=RELAYED.marks)])
@pytest.mark.parametrize("dies_before", ['"finish_reason": "', '"usage"', '"object": "chat.completion"'])
def test_a_child_that_dies_at_an_answers_end_leaves_no_answer_without_its_end(start_supervisor, tmp_path,
                                                                              dies_before, hand_off):
    """The child dies just before its write that holds ``dies_before`` (planted in its
    socket writes by tests/supervisor_hooks): a stream's finish chunk (every token already
    sent), its usage, a whole answer's body. Each went out in a write of its own: the
    stream ended with an error event (a continuation had nothing left to generate), or
    without its usage and no word, and the whole answer was a 200 head with no body (found
    by a helper's LD_PRELOAD shim). A stream's end now goes out with its last token in one
    write, a head with its body: the client gets all of it, as an unfailed run's."""
    config = tmp_path / "guardian.toml"
    config.write_text("" if hand_off else "[supervisor]\nhand_off = false\n")
    armed = tmp_path / "die-armed"
    supervised = start_supervisor("--guardian-config", str(config), "--supervisor-quarantine", "0",
                                  env=with_supervisor_hooks(GUARDIAN_TEST_DIE_ARMED_BY=str(armed),
                                                            GUARDIAN_TEST_DIE_BEFORE_SEND=dies_before))
    first_pid = supervised.wait_ready()
    if dies_before == '"object": "chat.completion"':  # a whole answer's body (a chunk's says .chunk")
        body = chat_body("End cleanly.", max_tokens=4, temperature=0.0)
        reference = httpx.post(supervised.url + COMPLETIONS, json=body, timeout=60).json()
        armed.touch()
        answer = httpx.post(supervised.url + COMPLETIONS, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"] == reference["choices"] and answer.json()["usage"]["completion_tokens"] == 4
    else:
        body = greedy_stream("End cleanly.", max_tokens=4)
        reference = read_whole(supervised.url + COMPLETIONS, body)
        armed.touch()
        cut = read_whole(supervised.url + COMPLETIONS, body)
        assert cut.result["status"] == 200 and cut.result["done"] and not cut.result["errors"], cut.result
        assert streamed(cut.result) == streamed(reference.result)
        [finish] = [e["choices"][0]["finish_reason"] for e in cut.result["events"]
                    if e.get("choices") and e["choices"][0].get("finish_reason")]
        assert finish == "length"
        [usage] = [e["usage"] for e in cut.result["events"] if e.get("usage")]
        assert usage["completion_tokens"] == 4
    assert not armed.exists()  # the planted death happened
    assert supervised.wait_ready(not_pid=first_pid, timeout=60) != first_pid

"""Per-client limits: requests in flight, and tokens within any minute.

``ClientLimits`` alone with a fake clock, then a real server with API keys:
a client past a limit gets 429 ``rate_limit_exceeded`` with a Retry-After
computed from the limit, while another client is served.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from conftest import Server, chat_body, free_port, poll, spawn_guardian
from guardian.access.limits import CONCURRENCY_RETRY_AFTER_S, RATE_LIMITED, STATUS_CLIENTS, WINDOW_S, ClientLimits

pytestmark = [pytest.mark.one_version]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limits(max_concurrent: int = 0, tokens_per_minute: int = 0) -> tuple[ClientLimits, SimpleNamespace, Clock]:
    settings = SimpleNamespace(client_max_concurrent=max_concurrent, client_tokens_per_minute=tokens_per_minute)
    clock = Clock()
    return ClientLimits(settings, clock=clock), settings, clock


def test_requests_in_flight_past_the_limit_are_refused_until_one_ends():
    door, _, _ = limits(max_concurrent=2)
    assert door.admit("alice", 10) is None
    assert door.admit("alice", 10) is None
    refused = door.admit("alice", 10)
    assert (refused.status, refused.code, refused.retry_after_s) == (429, RATE_LIMITED, CONCURRENCY_RETRY_AFTER_S)
    assert door.admit("bob", 10) is None  # each client its own count
    door.release("alice")
    assert door.admit("alice", 10) is None
    assert door.status()["in_flight"] == {"alice": 2, "bob": 1}


def test_tokens_past_the_limit_are_refused_until_enough_leave_the_window():
    door, _, clock = limits(tokens_per_minute=100)
    error, reservation = door.take("alice", 30)  # at 0 s: 30 prompt tokens
    assert error is None
    door.release("alice")
    clock.now += 10
    door.charge(reservation, 40)  # at 10 s: 40 generated
    clock.now += 10
    refused = door.admit("alice", 40)  # 70 used + 40 > 100
    assert (refused.status, refused.code) == (429, RATE_LIMITED)
    # Room for 40 once the first 30 leave the window, 60 s after they came.
    assert refused.retry_after_s == 40
    assert door.admit("bob", 40) is None
    clock.now += 40
    assert door.admit("alice", 40) is None
    assert door.status()["tokens_last_minute"]["alice"] == 80


def test_clients_that_never_come_back_are_forgotten_once_their_window_has_passed():
    """Without keys a client is its address: a phone's changes, a scanner has many. Each
    was kept for good (its window pruned only when it came back, or a status read came)."""
    door, _, clock = limits(tokens_per_minute=1000)
    for n in range(500):
        error, reservation = door.take(f"10.0.{n // 256}.{n % 256}", 10)
        assert error is None
        door.release(f"10.0.{n // 256}.{n % 256}")
        door.charge(reservation, 5)
    assert door.clients_counted == 500
    clock.now += WINDOW_S / 2
    error, reservation = door.take("alice", 10)  # within the window: all are still counted
    assert error is None
    assert door.clients_counted == 501
    clock.now += WINDOW_S / 2 + 1
    door.charge(reservation, 5)  # a window after the first 500: they are swept out
    assert door.clients_counted == 1
    assert door.status()["tokens_last_minute"] == {"alice": 15}


def test_the_status_lists_the_clients_with_the_most_tokens_and_none_whose_window_passed():
    """5,000 addresses in a minute made /guardian/status 98 KB; the first read after the
    window listed every one of them again, with 0 tokens."""
    door, _, clock = limits(tokens_per_minute=1000)
    for n in range(3 * STATUS_CLIENTS):
        assert door.admit(f"10.0.{n // 256}.{n % 256}", n + 1) is None
        door.release(f"10.0.{n // 256}.{n % 256}")
    status = door.status()
    listed = status["tokens_last_minute"]
    assert status["clients_counted"] == 3 * STATUS_CLIENTS and len(listed) == STATUS_CLIENTS
    assert list(listed.values()) == list(range(3 * STATUS_CLIENTS, 2 * STATUS_CLIENTS, -1))  # the most first
    clock.now += WINDOW_S + 1
    assert door.status() == {"in_flight": {}, "tokens_last_minute": {}, "tokens_reserved": {}, "clients_counted": 0}


def test_retry_after_is_whole_seconds_between_one_and_the_window():
    door, _, clock = limits(tokens_per_minute=50)
    assert door.admit("alice", 50) is None
    clock.now += WINDOW_S - 0.3  # the tokens leave the window in 0.3 s
    refused = door.admit("alice", 0)  # the limit is used: even an empty prompt waits
    assert refused.retry_after_s == 1
    clock.now += 0.3
    assert door.admit("alice", 0) is None


def test_a_prompt_over_the_limit_is_let_in_when_nothing_was_used():
    door, _, _ = limits(tokens_per_minute=100)
    assert door.admit("alice", 500) is None  # refusing it would refuse it forever
    refused = door.admit("alice", 1)
    assert refused.retry_after_s == WINDOW_S


def test_limits_are_live_and_zero_turns_them_off():
    door, settings, _ = limits()
    for _ in range(5):
        assert door.admit("alice", 10_000) is None
    settings.client_max_concurrent = 5
    assert door.admit("alice", 1).code == RATE_LIMITED
    settings.client_max_concurrent = 0
    settings.client_tokens_per_minute = 10
    assert door.admit("alice", 5) is None  # tokens are counted from now on
    assert door.admit("alice", 6).code == RATE_LIMITED
    assert door.admit("bob", 6) is None


def test_a_refund_takes_back_the_tokens_of_a_request_that_never_ran():
    door, _, _ = limits(tokens_per_minute=100)
    error, receipt = door.take("alice", 90)
    assert error is None
    door.release("alice")
    door.refund(receipt)
    assert door.admit("alice", 90) is None
    assert door.status() == {"in_flight": {"alice": 1}, "tokens_last_minute": {"alice": 90}, "tokens_reserved": {},
                             "clients_counted": 1}


def test_a_refused_client_leaves_no_count_behind():
    """Each address refused once held an entry of 0 in flight for ever (a defaultdict read)."""
    door, _, _ = limits(max_concurrent=5, tokens_per_minute=10)
    for n in range(5):
        assert door.admit(f"client-{n}", 20) is None  # over the limit, but nothing was used yet
        door.release(f"client-{n}")
        assert door.admit(f"client-{n}", 1).code == RATE_LIMITED
    assert door.status()["in_flight"] == {}


def test_requests_in_flight_hold_their_max_tokens_against_the_limit():
    """Admission counted only prompts: requests sent at once all got in, and each generated
    max_tokens (ten of 12 + 200 tokens under a limit of 100 left 1,696 in the minute)."""
    door, _, _ = limits(tokens_per_minute=1000)
    for _ in range(4):
        assert door.admit("alice", 12, 200) is None  # 848 counted: 12 used and 200 held, four times
    refused = door.admit("alice", 12, 200)  # 848 + 212 > 1000
    assert (refused.status, refused.code) == (429, RATE_LIMITED)
    assert "800 more reserved" in refused.message and "up to 200 completion" in refused.message
    assert door.admit("alice", 12, 140) is None  # 848 + 152 fits
    assert door.status()["tokens_last_minute"] == {"alice": 1000}
    assert door.status()["tokens_reserved"] == {"alice": 940}


def test_the_unused_part_of_a_reservation_is_given_back_when_its_tokens_are_charged():
    door, _, _ = limits(tokens_per_minute=1000)
    error, reservation = door.take("alice", 12, 900)
    assert error is None and door.admit("alice", 12, 100).code == RATE_LIMITED
    door.release("alice")
    door.charge(reservation, 3)  # it stopped early
    assert door.status()["tokens_last_minute"] == {"alice": 15}
    assert door.admit("alice", 12, 900) is None


def test_a_request_over_before_the_engines_word_counts_its_hold_until_the_word_comes():
    """The word (on_request_finished) comes on another thread, after the HTTP side is done:
    given back at the end, a client's next request could come before it and find nothing counted."""
    door, _, _ = limits(tokens_per_minute=1000)
    _, reservation = door.take("alice", 12, 500)
    door.release("alice")
    door.end(reservation)
    assert door.status()["tokens_last_minute"] == {"alice": 512}  # now used, no longer reserved
    assert door.status()["tokens_reserved"] == {}
    door.charge(reservation, 20)
    assert door.status()["tokens_last_minute"] == {"alice": 32}
    # Word first, end after: the end changes nothing.
    _, reservation = door.take("alice", 12, 500)
    door.charge(reservation, 20)
    door.end(reservation)
    assert door.status()["tokens_last_minute"] == {"alice": 64}


def test_a_reservation_is_settled_once_whatever_comes_after():
    """A second settlement would give back what is used (a refund after a charge) or count
    it twice; either way the limit would be wrong."""
    door, _, _ = limits(tokens_per_minute=1000)
    _, refunded = door.take("alice", 12, 100)
    door.refund(refunded)
    door.refund(refunded)
    door.charge(refunded, 50)
    door.end(refunded)
    _, charged = door.take("alice", 12, 100)
    door.charge(charged, 30)
    door.charge(charged, 30)
    door.refund(charged)
    door.end(charged)
    assert door.status()["tokens_last_minute"] == {"alice": 42}


def test_a_request_over_the_whole_limit_is_let_in_only_when_nothing_is_counted():
    """Refused, it would be refused for ever (a client that sends no max_tokens reserves
    stock's --max-tokens, 512 by default): it passes the limit once, alone."""
    door, _, clock = limits(tokens_per_minute=100)
    error, reservation = door.take("alice", 12, 200)
    assert error is None
    refused = door.admit("alice", 12, 200)
    assert "more than the limit" in refused.message
    door.release("alice")
    door.charge(reservation, 200)
    assert door.admit("alice", 12, 200).retry_after_s == WINDOW_S  # until the 212 leave the window
    clock.now += WINDOW_S
    assert door.admit("alice", 12, 200) is None


def test_a_hold_follows_the_max_tokens_a_later_hook_lowers():
    """The door's hook runs first; the prompt guard's clamp to the context comes after it."""
    from guardian.plugins.access import completion_bound

    admission = SimpleNamespace(args=SimpleNamespace(max_tokens=100_000), limits=SimpleNamespace(context_length=2048),
                                carried_tokens=0)
    door, _, _ = limits(tokens_per_minute=10_000)
    # Past the context the engine generates nothing: the model's context bounds the hold at once.
    assert door.admit("alice", 48, completion_bound(admission, 48)) is None
    assert door.status()["tokens_reserved"] == {"alice": 2000}
    admission.args.max_tokens = 300  # a later hook's clamp
    assert door.status()["tokens_reserved"] == {"alice": 300}
    admission.args.max_tokens = -1  # stock's "no limit": up to the context
    assert door.status()["tokens_reserved"] == {"alice": 2000}


def test_a_word_on_an_id_two_requests_in_flight_share_corrects_neither():
    """A client's X-Request-ID is its request's id. A word for one of two such requests in
    flight that settled the other would free a hold still generating: neither is corrected,
    each counts its whole hold. An id used again after its request ended is no such case."""
    from guardian.admission.facts import Admission
    from guardian.plugins.access import Access

    door_plugin = Access()
    door, settings, _ = limits(tokens_per_minute=10_000)
    door_view = SimpleNamespace(limits=door, settings=settings)

    def admitted(request_id: str, max_tokens: int) -> Admission:
        admission = Admission(None, SimpleNamespace(max_tokens=max_tokens), limits=None,
                              tokenize=lambda request: ([1, 2], None), request_id=request_id, stream=False,
                              client="alice")
        assert door_plugin.admit_request(admission, door_view) is None
        return admission

    first, second = admitted("same", 1000), admitted("same", 10)
    second.finish()
    door_plugin.on_request_finished(request_id="same", generated_tokens=10)  # the second's word
    first.finish()
    door_plugin.on_request_finished(request_id="same", generated_tokens=1000)
    assert door.status()["tokens_last_minute"] == {"alice": 1014}  # 2 + 1000 and 2 + 10: each its hold
    assert door_plugin._charging == {}  # noqa: SLF001 - the bookkeeping itself is what is checked

    again = admitted("again", 500)
    again.finish()
    later = admitted("again", 500)  # the first's word still to come: its request is over
    door_plugin.on_request_finished(request_id="again", generated_tokens=7)
    assert door.status()["tokens_last_minute"] == {"alice": 1014 + 2 + 7 + 2 + 500}
    later.finish()
    door_plugin.on_request_finished(request_id="again", generated_tokens=9)
    assert door.status()["tokens_last_minute"] == {"alice": 1014 + 2 + 7 + 2 + 9}


# -- a real server ------------------------------------------------------------

KEYS = {name: f"sk-{name}-0123456789" for name in ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")}
CHAT = "/v1/chat/completions"
TOKENS_PER_MINUTE = 400
CONFIG = f"""\
[guardian]
plugins = ["tests.plugins.slow_request_end:SlowRequestEnd"]
[slow_request_end]
clients = ["erin"]
[watchdog]
probe_interval_s = 600
[access]
client_max_concurrent = 1
client_tokens_per_minute = {TOKENS_PER_MINUTE}
# Steps of 5 ms at least: alice's 2,000-token stream (~1 s unslowed) is still in flight when
# her second request comes, on a loaded machine too.
[fault_injection]
enabled = true
step_delay_s = 0.005
"""


# The shared server's [access], saved for the reservation tests: no limit on requests in
# flight (requests sent at once meet the tokens' limit alone), and room for a few of them.
RESERVING_TOKENS_PER_MINUTE = 1000
RESERVING_CONFIG = CONFIG.replace("client_max_concurrent = 1", "client_max_concurrent = 0").replace(
    f"client_tokens_per_minute = {TOKENS_PER_MINUTE}", f"client_tokens_per_minute = {RESERVING_TOKENS_PER_MINUTE}")
# The demo model's end of turn (<|im_end|>, id 2), forced: a request stops at its first token.
STOP_AT_ONCE = {"logit_bias": {"2": 100}}


def serve(tmp_path_factory, model_cache, config_text: str):
    folder = tmp_path_factory.mktemp("client-limits")
    keys = folder / "keys"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    config = folder / "guardian.toml"
    config.write_text(config_text)
    port = free_port()
    proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config), "--api-key-file", str(keys)],
                          folder / "server.log", model_cache)
    server = Server(proc, port, folder / "server.log")
    server.config = config
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_cache):
    yield from serve(tmp_path_factory, model_cache, CONFIG)


def save_and_wait(server: Server, text: str) -> None:
    """Save the server's file and wait until it runs that version ([access] is live)."""
    reloads = len(server.events("config_reloaded"))
    server.config.write_text(text)
    server.wait_for_event("config_reloaded", count=reloads + 1, timeout=30)


@pytest.fixture
def served_reserving(served):
    """The shared server, saved with ``RESERVING_CONFIG`` for the test; as before after it."""
    assert "client_max_concurrent = 0" in RESERVING_CONFIG and f"= {RESERVING_TOKENS_PER_MINUTE}" in RESERVING_CONFIG
    save_and_wait(served, RESERVING_CONFIG)
    yield served
    save_and_wait(served, CONFIG)


def chat(client: httpx.Client, server: Server, name: str, max_tokens: int = 4) -> httpx.Response:
    return client.post(server.url + CHAT, json=chat_body("Tell me a story.", max_tokens=max_tokens),
                       headers={"Authorization": f"Bearer {KEYS[name]}"})


def assert_rate_limited(response: httpx.Response) -> int:
    """A 429 rate_limit_exceeded that asks for a retry; its Retry-After in seconds."""
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == RATE_LIMITED
    assert response.headers["x-should-retry"] == "true"
    return int(response.headers["Retry-After"])


def test_a_second_request_in_flight_of_one_key_is_refused_while_another_key_is_served(served):
    body = chat_body("Tell me a long story.", max_tokens=2000, stream=True)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", served.url + CHAT, json=body,
                           headers={"Authorization": f"Bearer {KEYS['alice']}"}) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            poll(lambda: next(lines).startswith("data: {"), 10, interval=0, what="alice's stream under way")
            assert assert_rate_limited(chat(client, served, "alice")) == CONCURRENCY_RETRY_AFTER_S
            assert chat(client, served, "bob").status_code == 200
        # Alice's stream closed: her place comes back once the server sees her gone.
        poll(lambda: chat(client, served, "alice").status_code == 200, 10, interval=0.05,
             what="alice served again")


def test_tokens_past_the_limit_are_refused_until_the_minute_has_passed(served):
    started = time.monotonic()
    with httpx.Client(timeout=30) as client:
        for _ in range(20):  # about 120 tokens a request: the limit is reached within 4
            response = chat(client, served, "carol", max_tokens=100)
            if response.status_code != 200:
                break
        retry_after = assert_rate_limited(response)
        # Until the tokens of carol's first requests leave the minute.
        assert WINDOW_S - (time.monotonic() - started) - 1 <= retry_after <= WINDOW_S
        assert chat(client, served, "dave").status_code == 200


def test_a_client_sending_one_request_after_another_is_never_refused_for_concurrency(served):
    # Each request on a connection of its own, sent the moment the last answer is read,
    # while the thread that wrote that answer lingers (tests/plugins/slow_request_end.py):
    # the place of the request before is free by then, released as its tokens end, not
    # once the thread is done (CI once saw a 429 here).
    for _ in range(3):
        response = httpx.post(served.url + CHAT, json=chat_body("Hi.", max_tokens=2), timeout=30,
                              headers={"Authorization": f"Bearer {KEYS['erin']}"})
        assert response.status_code == 200, response.text


def test_a_request_refused_after_the_limits_costs_its_client_no_tokens(served):
    """A prompt the prompt guard refuses (longer than the context) was counted against its
    client's minute: one 400 locked the client out with a 429 for a minute."""
    too_long = chat_body(" ".join(f"word{i}" for i in range(600)), max_tokens=4)
    with httpx.Client(timeout=30) as client:
        refused = client.post(served.url + CHAT, json=too_long, headers={"Authorization": f"Bearer {KEYS['frank']}"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        assert chat(client, served, "frank").status_code == 200


def test_a_request_a_later_hook_refused_is_not_kept_for_its_tokens():
    """The built-in door keeps each request it let in until the engine says how many tokens
    it generated; one a later hook refused (context too long) never finishes there, and was
    kept until 10,000 newer ones pushed it out."""
    from guardian.admission.facts import Admission
    from guardian.plugins.access import Access

    door_plugin = Access()
    door, settings, _ = limits(tokens_per_minute=1000)
    for n in range(5):
        admission = Admission(None, SimpleNamespace(max_tokens=4), limits=None,
                              tokenize=lambda request: ([1, 2, 3], None),
                              request_id=f"req-{n}", stream=False, client="alice")
        assert door_plugin.admit_request(admission, SimpleNamespace(limits=door, settings=settings)) is None
        admission.refused = True  # as the prompt guard's 400 sets it
        admission.finish()
    assert len(door_plugin._charging) == 0  # noqa: SLF001 - the bookkeeping itself is what is checked
    assert door.status()["tokens_last_minute"] == {}  # and their reservations were given back


def tokens_counted(server: Server, name: str) -> int:
    """The client's tokens counted against its limit, as /guardian/status shows them."""
    status = httpx.get(server.url + "/guardian/status", headers={"Authorization": f"Bearer {KEYS[name]}"},
                       timeout=10).json()
    return status["access"]["clients"]["tokens_last_minute"].get(name, 0)


def test_requests_sent_at_once_cannot_take_a_client_past_its_tokens_per_minute(served_reserving):
    """The reviewer's run: admission counted only prompts, so ten requests sent at once of a
    12-token prompt and max_tokens 200 all got in under a limit of 100, and each generated
    200 (1,696 tokens in the minute). Each now holds its max_tokens from admission."""
    sent = 10
    at_once = threading.Barrier(sent)

    def send(_) -> httpx.Response:
        at_once.wait(10)
        return httpx.post(served_reserving.url + CHAT, json=chat_body("Tell me a story.", max_tokens=200),
                          headers={"Authorization": f"Bearer {KEYS['grace']}"}, timeout=60)

    with ThreadPoolExecutor(sent) as pool:
        responses = list(pool.map(send, range(sent)))
    served_ok = [r.json()["usage"]["total_tokens"] for r in responses if r.status_code == 200]
    for refused in (r for r in responses if r.status_code != 200):
        assert_rate_limited(refused)
    # 212 tokens each: four fit in 1,000. None of them passes the limit alone, so none may.
    assert served_ok and len(served_ok) < sent
    assert sum(served_ok) <= RESERVING_TOKENS_PER_MINUTE, served_ok
    # Once the engine's words on them are in, the status counts what they used, no more.
    poll(lambda: tokens_counted(served_reserving, "grace") == sum(served_ok), 10,
         what="grace's tokens charged")


def test_the_unused_part_of_a_reservation_is_given_back_when_the_request_ends(served_reserving):
    """A request that may generate 900 tokens but stops at its first holds 900 while it runs;
    once it has ended, the client has the rest of its minute again."""
    body = chat_body("Tell me a story.", max_tokens=900, **STOP_AT_ONCE)
    headers = {"Authorization": f"Bearer {KEYS['heidi']}"}
    with httpx.Client(timeout=30) as client:
        first = client.post(served_reserving.url + CHAT, json=body, headers=headers)
        assert first.status_code == 200, first.text
        used = first.json()["usage"]["total_tokens"]
        assert used < 100  # it stopped early
        poll(lambda: tokens_counted(served_reserving, "heidi") == used, 10, what="heidi's unused tokens given back")
        # Its prompt and 900 more fit beside what the first used, not beside its whole reservation.
        second = client.post(served_reserving.url + CHAT, json=body, headers=headers)
        assert second.status_code == 200, second.text

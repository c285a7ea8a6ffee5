"""The caps on memory that a client, or a child process, can fill: each one fires.

Every structure here grows with what arrives (requests let in, relays cut,
crash suspects, quarantined bodies, models named, SSE bytes without a blank
line); each has a module-level cap, and each test drives the real class past
it and checks what the code promises there: the oldest entry goes, the
newest stays, the count stays at the cap, or the bytes are passed on rather
than held. No model and no server: the classes alone, each filled for real.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import structlog

from conftest import poll
from guardian.quarantine.table import short

one_version = pytest.mark.one_version  # none but the tokenizer test touches mlx-lm


# -- guardian/plugins/access.py: MAX_TRACKED_REQUESTS -------------------------------------
@one_version
def test_the_door_forgets_the_oldest_request_it_was_never_told_finished():
    """The built-in door keeps each request it let in until the engine says how many tokens
    it generated. A request that never finishes there (a later hook refused it without its
    finish running, a path that lost it) would be kept for as long as the server runs: a
    client sending such requests grew the server without limit. Past MAX_TRACKED_REQUESTS,
    the oldest is forgotten (a late word on it charges nothing) and the newest is still
    charged."""
    from guardian.access.limits import ClientLimits
    from guardian.admission.facts import Admission
    from guardian.plugins.access import MAX_TRACKED_REQUESTS, Access

    door_plugin = Access()
    # Tokens per minute on, so that finished requests are charged; prompts of no tokens and
    # max_tokens of 0 (nothing reserved), so that only what on_request_finished charges shows
    # in the status.
    settings = SimpleNamespace(client_max_concurrent=0, client_tokens_per_minute=10**9)
    limits = ClientLimits(settings)
    door = SimpleNamespace(limits=limits, settings=settings)
    total = MAX_TRACKED_REQUESTS + 1
    for n in range(total):
        admission = Admission(None, SimpleNamespace(max_tokens=0), limits=None, tokenize=lambda request: ([], None),
                              request_id=f"req-{n}", stream=False, client=f"client-{n}")
        assert door_plugin.admit_request(admission, door) is None
        # Never finished: no admission.finish(), no on_request_finished.
    assert len(door_plugin._charging) == MAX_TRACKED_REQUESTS  # noqa: SLF001 - the bookkeeping is what is capped

    door_plugin.on_request_finished(request_id="req-0", generated_tokens=500)  # the oldest: forgotten
    door_plugin.on_request_finished(request_id=f"req-{total - 1}", generated_tokens=500)  # the newest: kept
    assert limits.status()["tokens_last_minute"] == {f"client-{total - 1}": 500}


# -- guardian/quarantine/crashes.py: MAX_RELAYS_PER_CHILD ---------------------------------
def lost_relays(quarantine, generation: int, bodies: list[bytes]) -> list[str]:
    """Relay each body to child ``generation`` and lose it there (a reset connection while
    the child lived on): each stays on the child's record until it is reaped. Their
    fingerprints, in order."""
    from guardian.quarantine.crashes import fingerprint

    fingerprints = []
    for body in bodies:
        fp = fingerprint("POST", "/v1/completions", body)
        with quarantine.relaying(generation, "POST", "/v1/completions", fp) as relay:
            relay.lost = True
        fingerprints.append(fp)
    return fingerprints


def bodies(count: int) -> list[bytes]:
    return [json.dumps({"model": "m", "prompt": f"request {n}"}).encode() for n in range(count)]


@one_version
def test_a_child_keeps_only_its_newest_lost_relays_on_record():
    """A relay cut while the child lived on waits on that child's record for its death, so
    that a crash can blame it. A child that lives long while its clients' connections keep
    being reset would grow the supervisor by one record per request without limit. Past
    MAX_RELAYS_PER_CHILD the oldest record goes: the crash blames the newest ones only."""
    from guardian.quarantine.crashes import MAX_RELAYS_PER_CHILD, CrashQuarantine

    quarantine = CrashQuarantine(quarantine_s=600, strike_window_s=300)
    fingerprints = lost_relays(quarantine, 1, bodies(MAX_RELAYS_PER_CHILD + 1))
    assert len(quarantine.relays[1]) == MAX_RELAYS_PER_CHILD

    suspects = quarantine.child_exited(1, crashed=True)
    blamed = {suspect["fingerprint"] for suspect in suspects}
    assert len(suspects) == MAX_RELAYS_PER_CHILD
    assert short(fingerprints[0]) not in blamed  # the oldest was dropped from the record
    assert short(fingerprints[-1]) in blamed and short(fingerprints[1]) in blamed
    assert quarantine.relays == {}  # the reaped child's record is gone


# -- guardian/quarantine/crashes.py: MAX_SUSPECTS ------------------------------------------
@one_version
def test_crash_suspects_past_the_cap_forget_the_oldest():
    """Every distinct body in flight at a crash becomes a suspect, remembered for its
    strike window. A client sending distinct bodies into a crash-looping engine would grow
    the supervisor by one suspect per body. Past MAX_SUSPECTS the oldest is forgotten: it
    no longer runs alone, while the newest still does."""
    from guardian.quarantine.crashes import MAX_SUSPECTS, CrashQuarantine

    quarantine = CrashQuarantine(quarantine_s=600, strike_window_s=300)
    fingerprints = lost_relays(quarantine, 1, bodies(MAX_SUSPECTS + 1))
    suspects = quarantine.child_exited(1, crashed=True)
    assert len(suspects) == MAX_SUSPECTS + 1  # every one was struck at the crash

    assert len(quarantine.suspects) == MAX_SUSPECTS
    assert quarantine.status()["suspects_count"] == MAX_SUSPECTS
    assert fingerprints[0] not in quarantine.suspects
    assert fingerprints[-1] in quarantine.suspects and fingerprints[1] in quarantine.suspects
    # What that means for the requests: the forgotten one is relayed beside others again,
    # the newest suspect still runs alone (nothing else is relayed, so neither waits).
    with quarantine.turn("POST", fingerprints[0]) as alone:
        assert alone is False
    with quarantine.turn("POST", fingerprints[-1]) as alone:
        assert alone is True


# -- guardian/quarantine/crashes.py: MAX_CANONICAL_BYTES -----------------------------------
def body_of_size(size: int, *, reordered: bool = False, last: str = "x") -> bytes:
    """A completion body of exactly ``size`` bytes (key order reversed if ``reordered``),
    its prompt ending with ``last``."""
    def encode(prompt: str) -> bytes:
        fields = [("model", "m"), ("max_tokens", 8), ("prompt", prompt)]
        return json.dumps(dict(reversed(fields) if reordered else fields)).encode()

    pad = size - len(encode(""))
    body = encode("x" * (pad - 1) + last)
    assert len(body) == size
    return body


@one_version
def test_a_body_past_the_canonical_limit_is_fingerprinted_as_sent():
    """A body is parsed to be made canonical on the supervisor's main loop, holding the GIL
    every relay shares (~9 ms a MiB): a client sending 100 MiB bodies would stall every
    other stream for a second each. Past MAX_CANONICAL_BYTES a body is hashed as sent: it
    still gets a fingerprint, a byte-for-byte retry matches it, two different bodies differ,
    and the same JSON in another key order is another request (it would be one below the
    limit)."""
    from guardian.quarantine.crashes import MAX_CANONICAL_BYTES, canonical_body, fingerprint

    def fp(body: bytes) -> str:
        return fingerprint("POST", "/v1/completions", body)

    # At the limit: parsed, so key order does not matter.
    at_limit = body_of_size(MAX_CANONICAL_BYTES)
    assert canonical_body(at_limit) != at_limit
    assert fp(at_limit) == fp(body_of_size(MAX_CANONICAL_BYTES, reordered=True))

    # One byte past it: hashed as sent.
    big = body_of_size(MAX_CANONICAL_BYTES + 1)
    assert canonical_body(big) is big
    assert len(fp(big)) == 64
    assert fp(big) == fp(bytes(bytearray(big)))  # a retry, byte for byte
    assert fp(big) != fp(body_of_size(MAX_CANONICAL_BYTES + 1, last="y"))  # another prompt
    assert fp(big) != fp(body_of_size(MAX_CANONICAL_BYTES + 1, reordered=True))  # not parsed


# -- guardian/quarantine/table.py: MAX_QUARANTINED -----------------------------------------
def quarantine_table():
    from guardian.quarantine.table import ExpiringTable

    return ExpiringTable(600.0, structlog.get_logger("test_bounded_memory"))


def quarantine(table, fingerprint: str) -> None:
    table.add(fingerprint, why="This request was in flight at 2 crashes of the engine process",
              shown={"method": "POST", "path": "/v1/completions", "strikes": 2})


@one_version
def test_the_quarantine_table_drops_the_oldest_entry_past_its_cap():
    """Each quarantined body is refused for quarantine_s. A client varying a poison body
    would grow the table by one entry per variant for as long as each is quarantined. Past
    MAX_QUARANTINED the oldest entry goes (its body is let in again) and the newest is
    still refused."""
    from guardian.quarantine.table import MAX_QUARANTINED

    table = quarantine_table()
    fingerprints = [f"{n:064x}" for n in range(MAX_QUARANTINED + 1)]
    for fp in fingerprints:
        quarantine(table, fp)

    assert table.status()["quarantined_count"] == MAX_QUARANTINED
    assert not table.holds(fingerprints[0])
    assert table.refusal(fingerprints[0]) is None
    assert table.holds(fingerprints[1])
    refused = table.refusal(fingerprints[-1])
    assert refused is not None and refused.code == "request_quarantined"


@one_version
def test_a_fingerprint_quarantined_again_is_the_newest_entry():
    """A body quarantined again (it crashed the engine twice more) starts its time over: it
    must not be the first to go when the table is full, or the poison body that keeps
    crashing the engine would be let in while bodies quarantined after it stay refused."""
    from guardian.quarantine.table import MAX_QUARANTINED

    table = quarantine_table()
    fingerprints = [f"{n:064x}" for n in range(MAX_QUARANTINED + 1)]
    for fp in fingerprints[:-1]:
        quarantine(table, fp)
    quarantine(table, fingerprints[0])  # again: now the newest
    quarantine(table, fingerprints[-1])  # one past the cap: the oldest goes, now the second

    assert table.status()["quarantined_count"] == MAX_QUARANTINED
    assert table.holds(fingerprints[0])
    assert not table.holds(fingerprints[1])
    assert table.holds(fingerprints[-1])


@one_version
def test_quarantine_entries_past_their_time_leave_the_table_so_bodies_are_fingerprinted_no_more():
    """While anything is quarantined every POST's body is fingerprinted (~9 ms a MiB). An
    entry past its time stayed until the same body came again or the cap pushed it out:
    one quarantine had every later body fingerprinted for the life of the process."""
    from guardian.quarantine.table import ExpiringTable

    table = ExpiringTable(2.0, structlog.get_logger("test_bounded_memory"))
    assert not table.has_entries()
    quarantine(table, "a" * 64)
    assert table.has_entries() and table.holds("a" * 64)
    poll(lambda: not table.has_entries(), 10, interval=0.05, what="the entry gone once past its time")


# -- guardian/admission/unloaded_models.py: MAX_REMEMBERED ---------------------------------
def tokenizer_only_model(path) -> str:
    """A model folder with what admission reads before the weights load: config.json and a
    tokenizer (no weights: admission counts their bytes, 0 here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir()
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<unk>"}))
    (path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "hidden_size": 64, "max_position_embeddings": 256, "vocab_size": 3}))
    return str(path)


def test_only_the_most_recently_used_tokenizers_of_unloaded_models_are_kept(tmp_path):
    """Admission reads the tokenizer of each allowed model a request names before it is
    loaded, and keeps it. A client naming one allowed model after another would keep every
    one of their tokenizers in memory (hundreds of MB for large vocabularies). Past
    MAX_REMEMBERED the least recently used goes, and is read from disk again when named."""
    from guardian.admission.unloaded_models import MAX_REMEMBERED, UnloadedModels

    keys = [(tokenizer_only_model(tmp_path / f"model-{n}"), None, None) for n in range(MAX_REMEMBERED + 1)]
    unloaded = UnloadedModels(SimpleNamespace(trust_remote_code=False, chat_template=None))
    first = {key: unloaded.get(key) for key in keys[:MAX_REMEMBERED]}
    assert all(entry is not None for entry in first.values())
    assert unloaded.get(keys[0]) is first[keys[0]]  # remembered: not read again; now the most recent
    first[keys[-1]] = unloaded.get(keys[-1])  # one past the cap: keys[1], least recently used, goes
    assert len(unloaded._remembered) == MAX_REMEMBERED  # noqa: SLF001 - the cache is what is capped

    for key in [keys[0], *keys[2:]]:
        assert unloaded.get(key) is first[key]
    again = unloaded.get(keys[1])  # read from disk again
    assert again is not first[keys[1]] and again[1].context_length == 256
    assert len(unloaded._remembered) == MAX_REMEMBERED  # noqa: SLF001


# -- guardian/relay_protocol.py: MAX_HELD_EVENT_BYTES --------------------------------------
@one_version
@pytest.mark.parametrize("continuable", [False, True], ids=["plain", "continuable"])
def test_an_event_past_the_held_limit_is_passed_on_not_held(continuable):
    """The supervisor holds a child's SSE bytes until a blank line ends the event, so that
    a client never gets half an event. A body that is not SSE framing (no blank line ever)
    would be held whole in the supervisor's memory, and its client would get nothing until
    it ended. Past MAX_HELD_EVENT_BYTES what is held is passed on; the events after it are
    passed whole as before."""
    from guardian.relay_protocol import MAX_HELD_EVENT_BYTES, EventRelay, RelayedStream

    relay = EventRelay(RelayedStream() if continuable else None)
    piece = 64 * 1024
    chunks = [b"data: " + b"x" * (piece - 6)] + [b"x" * piece] * (MAX_HELD_EVENT_BYTES // piece)
    sent, passed = b"", b""
    for n, chunk in enumerate(chunks):
        sent += chunk
        out = relay.pass_on(chunk)
        passed += out
        if len(sent) <= MAX_HELD_EVENT_BYTES:
            assert out == b"", n  # up to the limit: held, waiting for its blank line
            assert relay.held == sent
        assert len(relay.held) <= MAX_HELD_EVENT_BYTES
    assert len(sent) > MAX_HELD_EVENT_BYTES
    assert passed == sent and relay.held == b""  # past it: every byte passed on, none held

    end = b"\n\ndata: [DONE]\n\n"
    assert relay.pass_on(end) == end
    assert relay.done and relay.held == b""

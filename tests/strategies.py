"""Hypothesis strategies for hostile request bodies on the completion endpoints.

Shared by tests/test_fuzz.py (a bounded run against a live guardian) and
bench/fuzz_campaign.py (10,000 bodies against stock and the guardian). A
``FuzzCase`` starts from a small body that stock serves (a short prompt or
one user message, ``max_tokens`` of a few tokens) and applies 0 to 3
mutations to the fields stock's ``do_POST`` reads, or to the OpenAI fields it
does not: wrong types, extreme numbers, NaN and Infinity, empty and huge
strings and arrays, unicode (lone surrogates, NUL), unknown fields, nested
junk. A few cases replace the whole body with bytes that are not a JSON
object at all.

Every mutation has a label, ``field:kind``, so a body that kills a server can
be named as a class ("logit_bias:key_at_vocab") rather than only shown.

Bodies are serialized with Python's json, which writes NaN and Infinity as
bare literals (and Python's json, stock's parser, reads them back): the raw
bytes are what is sent, never re-encoded by a client.

No value names a real local path: ``model``, ``draft_model`` and
``adapters`` get names that do not exist, and image URLs are data URLs or a
closed port on 127.0.0.1, so nothing is loaded or fetched from the network.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"

# The demo model's vocabulary and context (tests/conftest.py's model).
VOCAB_SIZE = 1000
N_CTX = 2048

# Numbers that sit on an edge somewhere: C integer widths, float limits.
HUGE_INTS = [2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**12, 10**30, 10**400]
NEGATIVE_INTS = [-1, -2, -(2**31), -(2**63), -(2**64), -(10**12), -(10**400)]
ODD_FLOATS = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0, 1e-12]

# Names that cannot resolve to anything on disk or (offline) on the hub.
MISSING_MODELS = ["fuzz-no-such-model", "/nonexistent/fuzz-model", "fuzz-org/no-such-repo",
                  "../fuzz-no-such-dir", "gpt-4o", "mlx-community/fuzz-does-not-exist"]

# Text of every kind: printable, control characters, NUL, lone surrogates
# (which json writes as \\udXXX escapes and Python reads back as str).
UNICODE_TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)
SHORT_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=24)


@dataclass(frozen=True)
class FuzzCase:
    """One request: where it goes, the exact bytes, and what was done to it."""

    path: str
    raw: bytes
    mutations: tuple = ()
    body: Any = field(default=None, compare=False, repr=False)
    headers: tuple = ()  # (name, value) pairs sent beside Content-Type

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True

    @property
    def label(self) -> str:
        """The body's class: its mutations, sorted, or ``valid`` for none."""
        return " + ".join(sorted(self.mutations)) or "valid"

    def describe(self, limit: int = 300) -> str:
        text = self.raw[:limit].decode("utf-8", errors="backslashreplace")
        more = f"... ({len(self.raw)} bytes)" if len(self.raw) > limit else ""
        sent = "".join(f" {name}: {value[:60]!r}" for name, value in self.headers)
        return f"POST {self.path} [{self.label}]{sent} {text}{more}"


def encode(body: Any) -> bytes:
    """Python's json: NaN/Infinity as bare literals, lone surrogates as escapes."""
    return json.dumps(body, allow_nan=True).encode()


# -- values -----------------------------------------------------------------------
def labelled(kind: str, strategy) -> st.SearchStrategy:
    return strategy.map(lambda value: (kind, value))


def pick(options: list) -> st.SearchStrategy:
    """One of ``options``, by a uniformly drawn index (an option listed twice is twice as likely).

    Not ``st.one_of``: hypothesis favours its first branches (in a 10,000-body
    campaign the fourth of five options was never drawn), and a campaign
    needs the proportions it asks for.
    """
    return st.integers(0, len(options) - 1).flatmap(lambda i: options[i])


def choose(*options) -> st.SearchStrategy:
    """``(kind, strategy)`` pairs, or ``(kind, strategy, weight)``; picks a kind, then a value.

    A weight repeats an option, so a costly kind (a 2048-token completion)
    can be rare.
    """
    weighted = []
    for option in options:
        kind, strategy, weight = (*option, 1)[:3] if len(option) == 2 else option
        weighted += [labelled(kind, strategy)] * weight
    return pick(weighted)


def junk_json(max_leaves: int = 6) -> st.SearchStrategy:
    """Any JSON value, nested a few levels, NaN and surrogates included."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                       UNICODE_TEXT, st.sampled_from(HUGE_INTS + NEGATIVE_INTS))
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(UNICODE_TEXT, inner, max_size=3)),
        max_leaves=max_leaves)


def wrong_values(prompt: bool = False) -> list:
    """Kinds that fit no field well: every field gets some of these.

    ``prompt``: the field becomes the prompt, so a huge string is kept to a
    few times the context (stock prefills it all: ~1 s per 1000 tokens on
    this CPU) instead of up to a megabyte.
    """
    huge = (st.integers(2_500, 6_000) if prompt else st.integers(100_000, 1_000_000)).map(lambda n: "x" * n)
    return [
        ("null", st.none()),
        ("bool", st.booleans()),
        ("string", SHORT_TEXT),
        ("empty_string", st.just("")),
        ("unicode", UNICODE_TEXT),
        ("huge_string", huge),
        ("huge_int", st.sampled_from(HUGE_INTS)),
        ("negative_int", st.sampled_from(NEGATIVE_INTS)),
        ("zero", st.just(0)),
        ("odd_float", st.sampled_from(ODD_FLOATS)),
        ("empty_list", st.just([])),
        ("empty_dict", st.just({})),
        ("huge_list", (st.integers(1_000, 3_000) if prompt else st.integers(1_000, 50_000)).map(lambda n: [0] * n)),
        ("nested", junk_json()),
    ]


def numbers(valid: st.SearchStrategy, *extra) -> st.SearchStrategy:
    return choose(("valid", valid, 6), *extra, *wrong_values())


def probability() -> st.SearchStrategy:
    return numbers(st.floats(0, 1), ("above_one", st.floats(1.0001, 1e6)),
                   ("negative", st.floats(-1e6, -1e-9)), ("int_one", st.just(1)))


def context_size() -> st.SearchStrategy:
    return numbers(st.integers(0, 64), ("beyond_context", st.sampled_from([N_CTX, N_CTX + 1, 10**6])),
                   ("float", st.floats(0, 100)))


def token_id_key() -> st.SearchStrategy:
    return choose(
        ("key_in_vocab", st.integers(0, VOCAB_SIZE - 1).map(str), 4),
        ("key_at_vocab", st.just(str(VOCAB_SIZE))),
        ("key_past_vocab", st.sampled_from([VOCAB_SIZE + 1, 10**6, 2**31, 2**63, 10**30]).map(str)),
        ("key_negative", st.sampled_from([-1, -VOCAB_SIZE, -(VOCAB_SIZE + 1), -(2**31), -(10**9)]).map(str)),
        ("key_not_int", st.sampled_from(["abc", "1.5", "", " 7", "0x10", "1e3", "٣"])),
    )


def logit_bias() -> st.SearchStrategy:
    def build(pairs):
        kinds = sorted({kind for kind, _ in pairs})
        return (",".join(kinds), {key: value for (_, (key, value)) in pairs})

    bias_value = st.one_of(st.floats(-100, 100), st.integers(-100, 100), st.sampled_from(ODD_FLOATS),
                           st.just("1"), st.none())
    pairs = st.lists(st.tuples(token_id_key(), bias_value).map(lambda kv: (kv[0][0], (kv[0][1], kv[1]))),
                     min_size=1, max_size=4)
    return pick([pairs.map(build)] * 3 + [choose(*wrong_values())])


def stop_words() -> st.SearchStrategy:
    return choose(
        ("string", SHORT_TEXT, 3),
        ("list", st.lists(SHORT_TEXT, max_size=4), 3),
        ("empty_in_list", st.just([""])),
        ("int_in_list", st.lists(st.integers(-5, 5), min_size=1, max_size=3)),
        ("null_in_list", st.just([None])),
        ("nested_list", st.just([["a"]])),
        ("many", st.integers(100, 5000).map(lambda n: [f"s{i}" for i in range(n)])),
        # Past [guardian] max_stop_chars (256): stock builds its matcher from them on the shared loop.
        ("long", st.integers(257, 5000).map(lambda n: ["x" * n])),
        ("unicode_list", st.lists(UNICODE_TEXT, min_size=1, max_size=3)),
        *wrong_values(),
    )


def max_tokens() -> st.SearchStrategy:
    return choose(
        ("valid", st.integers(1, 8), 30),
        # Clamped to the context by the guard; 2048 decode steps on stock: rare.
        ("to_context", st.sampled_from([N_CTX - 16, N_CTX, 10**12])),
        ("float", st.sampled_from([1.0, 2.5])),
        ("string_number", st.just("4")),
        *[(kind, value) for kind, value in wrong_values() if kind not in ("huge_int",)],
        ("huge_int", st.sampled_from(HUGE_INTS)),
    )


# -- messages and prompts ------------------------------------------------------------
ROLES = ["user", "assistant", "system", "tool", "developer", "function", "", "USER", "bogus"]
IMAGE_URLS = ["data:image/png;base64,iVBORw0KGgo=", "data:,", "data:image/png;base64,@@@",
              "http://127.0.0.1:1/closed-port.png", "file:///nonexistent.png", ""]


def content_parts() -> st.SearchStrategy:
    part = st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, UNICODE_TEXT),
        st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, st.sampled_from(IMAGE_URLS)),
        st.builds(lambda u: {"type": "image_url", "image_url": u}, st.sampled_from(IMAGE_URLS)),
        st.builds(lambda t: {"type": t}, st.sampled_from(["text", "input_audio", "file", "bogus"])),
        st.just({"text": "no type"}),
        junk_json(3),
    )
    return st.lists(part, max_size=3)


def tool_calls() -> st.SearchStrategy:
    call = st.fixed_dictionaries(
        {"function": st.fixed_dictionaries({"name": st.one_of(SHORT_TEXT, st.none(), st.integers()),
                                            "arguments": st.one_of(st.just('{"city": "Paris"}'),
                                                                   st.just("{bad json"),
                                                                   st.just({"city": "Paris"}),
                                                                   junk_json(3))})},
        optional={"id": SHORT_TEXT, "type": st.sampled_from(["function", "bogus"])},
    )
    return st.one_of(st.lists(call, max_size=3), junk_json(3))


def message() -> st.SearchStrategy:
    return choose(
        ("user_text", st.builds(lambda t: {"role": "user", "content": t}, SHORT_TEXT), 6),
        ("any_role", st.builds(lambda r, t: {"role": r, "content": t}, st.sampled_from(ROLES), SHORT_TEXT), 2),
        ("unicode_content", st.builds(lambda t: {"role": "user", "content": t}, UNICODE_TEXT)),
        ("content_parts", st.builds(lambda p: {"role": "user", "content": p}, content_parts())),
        ("content_junk", st.builds(lambda c: {"role": "user", "content": c}, junk_json(3))),
        ("no_content", st.builds(lambda r: {"role": r}, st.sampled_from(ROLES))),
        ("no_role", st.builds(lambda t: {"content": t}, SHORT_TEXT)),
        ("tool_calls", st.builds(lambda c: {"role": "assistant", "content": None, "tool_calls": c}, tool_calls())),
        ("tool_result", st.fixed_dictionaries({"role": st.just("tool"), "content": SHORT_TEXT},
                                              optional={"tool_call_id": junk_json(2), "name": junk_json(2)})),
        ("named", st.builds(lambda n: {"role": "user", "content": "hi", "name": n}, junk_json(2))),
        ("extra_keys", st.builds(lambda k, v: {"role": "user", "content": "hi", k: v}, UNICODE_TEXT, junk_json(2))),
        ("not_a_dict", junk_json(2)),
    )


def messages() -> st.SearchStrategy:
    def build(labelled_messages):
        kinds = sorted({kind for kind, _ in labelled_messages})
        return (",".join(kinds) or "empty_list", [m for _, m in labelled_messages])

    # Prompts over the context are rare: stock prefills them (seconds each).
    return pick(
        [st.lists(message(), min_size=1, max_size=4).map(build)] * 12 + [
            st.just(("empty_list", [])),
            labelled("huge_content", st.integers(1_100, 3_000).map(
                lambda n: [{"role": "user", "content": "word " * n}])),
            labelled("many_messages", st.integers(200, 1_000).map(
                lambda n: [{"role": "user", "content": "hi"}] * n)),
            choose(*wrong_values(prompt=True)), choose(*wrong_values(prompt=True))])


def prompt() -> st.SearchStrategy:
    return choose(
        ("text", SHORT_TEXT, 8),
        ("empty", st.just("")),
        ("unicode", UNICODE_TEXT),
        ("token_ids", st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8)),
        ("token_ids_out_of_vocab", st.lists(st.sampled_from([VOCAB_SIZE, -1, 10**9]), min_size=1, max_size=3)),
        ("list_of_strings", st.lists(SHORT_TEXT, min_size=1, max_size=3)),
        ("huge_text", st.integers(1_100, 3_000).map(lambda n: "word " * n)),
        *wrong_values(prompt=True),
    )


def tools() -> st.SearchStrategy:
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
    return choose(
        ("valid", st.just([weather]), 3),
        ("no_function", st.just([{"type": "function"}])),
        ("bad_name", st.builds(lambda n: [{"type": "function", "function": {"name": n}}], junk_json(2))),
        ("many", st.integers(50, 2000).map(lambda n: [weather] * n)),
        *wrong_values(),
    )


# -- the fields ------------------------------------------------------------------------
def field_values() -> dict:
    """Every field stock reads (mlx-lm 0.31/0.32 do_POST), and OpenAI ones it ignores."""
    boolean = lambda: choose(("valid", st.booleans(), 4), *wrong_values())  # noqa: E731
    return {
        "stream": boolean(),
        "stream_options": choose(("valid", st.fixed_dictionaries({"include_usage": st.booleans()}), 4),
                                 ("include_usage_junk", st.builds(lambda v: {"include_usage": v}, junk_json(2))),
                                 *wrong_values()),
        "model": choose(("default", st.just("default_model"), 2), ("missing", st.sampled_from(MISSING_MODELS)),
                        *wrong_values()),
        "draft_model": choose(("default", st.just("default_model")), ("missing", st.sampled_from(MISSING_MODELS)),
                              *wrong_values()),
        "adapters": choose(("missing", st.sampled_from(MISSING_MODELS)), *wrong_values()),
        "num_draft_tokens": numbers(st.integers(0, 8)),
        "max_tokens": max_tokens(),
        "max_completion_tokens": max_tokens(),
        "temperature": numbers(st.floats(0, 2), ("large", st.floats(2, 1e300)), ("negative", st.floats(-1e6, -1e-9))),
        "top_p": probability(),
        "min_p": probability(),
        "top_k": numbers(st.integers(0, 100), ("at_vocab", st.sampled_from([VOCAB_SIZE, VOCAB_SIZE + 1, 10**9]))),
        "repetition_penalty": numbers(st.floats(0, 2), ("large", st.floats(2, 1e300))),
        "repetition_context_size": context_size(),
        "presence_penalty": numbers(st.floats(-2, 2), ("large", st.floats(2, 1e300))),
        "presence_context_size": context_size(),
        "frequency_penalty": numbers(st.floats(-2, 2), ("large", st.floats(2, 1e300))),
        "frequency_context_size": context_size(),
        "xtc_probability": probability(),
        "xtc_threshold": probability(),
        "logit_bias": logit_bias(),
        "logprobs": boolean(),
        "top_logprobs": numbers(st.integers(0, 11), ("above_max", st.sampled_from([12, 20, VOCAB_SIZE, 10**6])),
                                ("minus_one", st.just(-1))),
        "seed": numbers(st.integers(0, 2**32 - 1), ("above_uint32", st.sampled_from([2**32, 2**63, 2**64 - 1])),
                        ("float", st.floats(0, 1e6))),
        "chat_template_kwargs": choose(
            ("valid", st.fixed_dictionaries({"enable_thinking": st.booleans()}), 3),
            ("template_keys", st.builds(lambda k, v: {k: v}, st.sampled_from(
                ["tokenize", "add_generation_prompt", "messages", "tools", "conversation", "continue_final_message",
                 "return_dict", "chat_template"]), junk_json(2))),
            *wrong_values()),
        "stop": stop_words(),
        "tools": tools(),
        "role_mapping": choose(("valid", st.just({"user": "USER: ", "assistant": "ASSISTANT: "})),
                               ("values_junk", st.dictionaries(SHORT_TEXT, junk_json(2), max_size=3)),
                               *wrong_values()),
        # OpenAI fields stock does not read: a drop-in accepts them.
        "n": numbers(st.integers(1, 2)),
        "user": choose(("valid", SHORT_TEXT), *wrong_values()),
        "response_format": choose(("valid", st.just({"type": "json_object"})), *wrong_values()),
        "tool_choice": choose(("valid", st.sampled_from(["auto", "none", "required"])), *wrong_values()),
        "echo": boolean(),
        "suffix": choose(("valid", SHORT_TEXT), *wrong_values()),
        "best_of": numbers(st.integers(1, 2)),
    }


FIELDS = field_values()
ENDPOINT_FIELDS = {CHAT: {"messages": messages()}, TEXT: {"prompt": prompt()}}


@st.composite
def valid_body(draw, path: str) -> dict:
    """A small request stock serves: a few tokens, streamed or not."""
    if path == CHAT:
        body = {"messages": [{"role": "user", "content": draw(SHORT_TEXT)}]}
    else:
        body = {"prompt": draw(SHORT_TEXT)}
    body["max_tokens"] = draw(st.integers(1, 8))
    body["stream"] = draw(st.booleans())
    return body


def unknown_fields() -> st.SearchStrategy:
    return st.dictionaries(UNICODE_TEXT.filter(lambda k: k not in FIELDS and k not in ("messages", "prompt")),
                           junk_json(3), min_size=1, max_size=3)


@st.composite
def mutated_case(draw, path: str) -> FuzzCase:
    body = draw(valid_body(path))
    mutations = []
    names = sorted(FIELDS) + sorted(ENDPOINT_FIELDS[path])
    chosen = draw(st.lists(st.sampled_from(names), min_size=0, max_size=3, unique=True))
    for name in chosen:
        strategy = ENDPOINT_FIELDS[path][name] if name in ENDPOINT_FIELDS[path] else FIELDS[name]
        kind, value = draw(strategy)
        body[name] = value
        mutations.append(f"{name}:{kind}")
    # Not 0: hypothesis draws an interval's ends far more often than its middle.
    if draw(st.integers(0, 9)) == 5:
        body.update(draw(unknown_fields()))
        mutations.append("unknown_fields")
    if draw(st.integers(0, 19)) == 9:
        # The other endpoint's prompt field as well (or instead).
        other = TEXT if path == CHAT else CHAT
        [(name, strategy)] = ENDPOINT_FIELDS[other].items()
        kind, value = draw(strategy)
        body[name] = value
        mutations.append(f"{name}(other endpoint):{kind}")
    if draw(st.integers(0, 29)) == 13:
        missing = "messages" if path == CHAT else "prompt"
        body.pop(missing, None)
        mutations.append(f"{missing}:absent")
    return FuzzCase(path, encode(body), tuple(mutations), body)


def not_an_object() -> st.SearchStrategy:
    """Bodies stock's JSON check must refuse: 400 ``invalid_json`` at most."""
    return choose(
        ("array", junk_json(4).map(lambda v: encode([v]))),
        ("scalar", st.one_of(st.integers(), st.floats(), st.none(), st.booleans(), UNICODE_TEXT).map(encode)),
        ("truncated", st.integers(1, 30).map(lambda n: b'{"messages": [{"role": "user", "content": "hi"}]}'[:n])),
        ("not_utf8", st.binary(min_size=1, max_size=40).map(lambda b: b'{"prompt": "' + b + b'\xff\xfe"}')),
        ("empty", st.just(b"")),
        ("deep_nesting", st.sampled_from([500, 5_000, 100_000]).map(
            lambda n: b'{"prompt": "hi", "x": ' + b"[" * n + b"]" * n + b"}")),
        ("duplicate_keys", st.just(b'{"prompt": "hi", "max_tokens": 4, "max_tokens": -1}')),
        ("bare_nan", st.just(b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}')),
        ("utf8_bom", st.just(b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 4}')),
    )


@st.composite
def raw_case(draw, path: str) -> FuzzCase:
    kind, raw = draw(not_an_object())
    return FuzzCase(path, raw, (f"body:{kind}",), None)


# The relay key the fuzz target is started with (tests/test_fuzz.py): a case
# that carries it reaches the continuation header's parsing, as only the
# supervisor's requests do.
FUZZ_RELAY_KEY = "fuzz-relay-key"
# Latin-1, as HTTP/1.1 header bytes are read; h11, under httpx, refuses to
# send a value with whitespace at either end (fuzz_client sends the bytes).
HEADER_TEXT = st.text(st.characters(codec="latin-1", min_codepoint=32, exclude_characters="\x7f"),
                      max_size=300).filter(lambda v: not any(0x80 <= ord(c) < 0xa0 for c in v)).map(str.strip)
CONTINUE_FROM = st.one_of(
    HEADER_TEXT,
    st.lists(st.integers(min_value=-2, max_value=1 << 40), max_size=8).map(lambda ids: ",".join(map(str, ids))),
)


def request_headers() -> st.SearchStrategy:
    """Mostly none; else the headers a request may carry besides its body: a
    client's X-Request-ID, or the supervisor's continuation headers, or the name
    of the API key it says let the client in, or the request's age or hand-off time, with the right
    key (reaching their parsing) or a guess."""
    key = st.sampled_from([FUZZ_RELAY_KEY, FUZZ_RELAY_KEY, "guess"])
    relayed = st.tuples(key, CONTINUE_FROM).map(
        lambda pair: (("X-Guardian-Continue-From", pair[1]), ("X-Guardian-Relay-Key", pair[0])))
    key_named = st.tuples(key, HEADER_TEXT).map(
        lambda pair: (("X-Guardian-Key-Name", pair[1]), ("X-Guardian-Relay-Key", pair[0])))
    aged = st.tuples(key, st.one_of(HEADER_TEXT, st.integers(min_value=-1, max_value=1 << 40).map(str))).map(
        lambda pair: (("X-Guardian-Request-Age-Ms", pair[1]), ("X-Guardian-Relay-Key", pair[0])))
    handed = st.tuples(key, st.one_of(HEADER_TEXT, st.floats(allow_nan=True, allow_infinity=True).map(str))).map(
        lambda pair: (("X-Guardian-Handed-At", pair[1]), ("X-Guardian-Relay-Key", pair[0])))
    return pick([
        st.just(()),
        st.just(()),
        HEADER_TEXT.map(lambda value: (("X-Request-ID", value),)),
        relayed,
        key_named,
        aged,
        handed,
    ])


def cases(paths=(CHAT, TEXT)) -> st.SearchStrategy:
    """Mostly mutated bodies (1 in 25 is not a JSON object), on either endpoint,
    half of them with hostile headers."""
    path = st.sampled_from(list(paths))
    bodies = path.flatmap(lambda p: pick([mutated_case(p)] * 24 + [raw_case(p)]))
    return st.builds(lambda case, headers: dataclasses.replace(case, headers=headers), bodies, request_headers())


def first_cases(count: int, seed: int = 0, paths=(CHAT, TEXT)) -> list[FuzzCase]:
    """The same ``count`` cases for the same seed and hypothesis version: a campaign's list."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    drawn: list[FuzzCase] = []

    @with_seed(seed)
    @settings(max_examples=count, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(paths))
    def collect(case):
        drawn.append(case)

    collect()
    return drawn[:count]

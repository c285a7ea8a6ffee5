"""Every field of a completion request, checked at the door.

Stock reads a request's fields and checks some of their types; the rest
reaches the generation thread, or native code, unchecked. Measured on
mlx-lm 0.32.2 with the demo model: a ``logit_bias`` key at or past the
vocabulary kills the process (SIGSEGV, SIGABRT); ``"stop": [1]`` kills the
generation thread before the request counts as started; a context size of
10**12 or an empty prompt kills it during the step; a seed of -1 drops the
connection; NaN (Python's JSON accepts the literal) passes every range
check. ``check_body`` runs on the HTTP thread before anything is queued and
answers such a body 400 ``invalid_request_error`` with ``param`` naming the
field.

Drop-in first: a value is refused only where OpenAI's documented schema
refuses it too, or where stock would fail on it. Stock's own checks still
run after these (``GuardianHandler.validate_model_parameters``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from guardian.errors import GuardianError

# mlx slices token windows with 32-bit indices ("Slice indices must be
# 32-bit integers"): a penalty's context size past this kills the step.
MAX_CONTEXT_SIZE = 2**31 - 1
# The largest integer a float parameter may be given as (a signed 64-bit int).
MAX_INT64 = 2**63
# mx.random.seed takes an unsigned 64-bit integer; anything else raises.
MAX_SEED = 2**64 - 1
# OpenAI's range for a logit bias. Larger values overflow the logits to inf,
# and sampling from inf or NaN logits can return ids outside the vocabulary.
MAX_LOGIT_BIAS = 100.0
# Stock's most top_logprobs (0.31.3 and 0.32 alike; OpenAI's is 20): past it, the door's
# 400 names the field, where stock's own refusal named none.
MAX_TOP_LOGPROBS = 11
# Keys of chat_template_kwargs that stock passes itself (a second value is a TypeError).
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "add_generation_prompt", "tokenize"})
# Keys that take the template's answer away from a list of tokens unless they hold the value
# the tokenizer defaults to (the only one they may hold).
TEMPLATE_KWARGS_AT_DEFAULT = {
    "return_dict": False, "return_tensors": None,
    "return_assistant_tokens_mask": False, "tokenizer_kwargs": None,
}
# padding = "max_length" pads the prompt to max_length tokens on the HTTP thread, before
# the prompt guard can count them (10**9 of them: gigabytes); any other padding of one
# prompt is none. Truncation only shortens it.
TEMPLATE_PADDING_ALLOWED = (False, True, None, "do_not_pad", "longest")
# A template sent in the request (rather than the name of one of the model's) is code
# the HTTP thread runs with no bound on its time: jinja's sandbox caps a range at
# 100,000 items, not loops inside loops.
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Content parts stock reads as images (mlx_lm.server._image_url).
IMAGE_PART_TYPES = ("image_url", "input_image", "image")


@dataclass(frozen=True)
class RequestBounds:
    """What the model a request goes to can take."""

    # Rows of the model's logits: token ids must be below this. None: unknown.
    vocab_size: Optional[int]
    # Whether the model reads images (a vision processor was loaded).
    accepts_images: bool = False
    # Which of model / draft_model / adapters names something this server
    # does not serve (that field's name), or None when all are allowed.
    disallowed_model_field: Optional[str] = None
    # The served model's id as /v1/models lists it, for the refusal of another.
    served_model: Optional[str] = None
    # How many "stop" strings, of how many characters each ([guardian]
    # max_stop_sequences, max_stop_chars); None: no limit.
    max_stop_sequences: Optional[int] = None
    max_stop_chars: Optional[int] = None
    # The prompt guard's context limit in tokens (None: no guard): a conversation
    # of more messages cannot fit, as every message a template renders takes a token.
    context_length: Optional[int] = None
    # The least max_tokens (or max_completion_tokens) the installed stock serves.
    min_max_tokens: int = 0


class Invalid(Exception):
    """One field of the body is wrong: its path, why, and OpenAI's error code."""

    def __init__(self, param: str, message: str, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code
        self.status = status

    def error(self) -> GuardianError:
        return GuardianError(self.message, status=self.status, type="invalid_request_error",
                             param=self.param, code=self.code)


def check_body(body: dict, *, chat: bool, bounds: RequestBounds) -> Optional[GuardianError]:
    """The first thing wrong with a parsed request body, as the client's 400; None if nothing is."""
    try:
        check_models(body, bounds)
        check_generation_fields(body, bounds)
        if chat:
            check_chat_fields(body, bounds)
        else:
            check_prompt(body)
        check_strings_encodable(body)
    except Invalid as invalid:
        return invalid.error()
    return None


# -- which model ---------------------------------------------------------------------
def check_models(body: dict, bounds: RequestBounds) -> None:
    check_type(body, "model", str)  # stock loads a null model as a path: it fails
    # A null draft model or adapter is stock's "none" (clients that send every field send it).
    check_type(body, "draft_model", str, nullable=True)
    check_type(body, "adapters", str, nullable=True)
    field = bounds.disallowed_model_field
    if field is not None:
        served = f" `{bounds.served_model}` (listed by /v1/models)" if bounds.served_model else \
            " the model it was started with"
        raise Invalid(field, f"The model `{body.get(field)}` is not served here; this server serves{served}. "
                      "Name that, or leave `model` out.", code="model_not_found", status=404)


# -- sampling and generation -----------------------------------------------------------
def check_generation_fields(body: dict, bounds: RequestBounds) -> None:
    check_type(body, "stream", bool)
    check_stream_options(body)
    # Stock reads max_tokens only when max_completion_tokens is absent or null.
    if check_integer(body, "max_completion_tokens", low=bounds.min_max_tokens, nullable=True) is None:
        check_integer(body, "max_tokens", low=bounds.min_max_tokens)
    check_number(body, "temperature", low=0)
    check_number(body, "top_p", low=0, high=1)
    check_integer(body, "top_k", low=0)
    check_number(body, "min_p", low=0, high=1)
    check_integer(body, "num_draft_tokens", low=0, high=MAX_CONTEXT_SIZE)
    check_number(body, "repetition_penalty", low=0)
    for kind in ("presence", "frequency"):
        check_number(body, f"{kind}_penalty")
    for kind in ("repetition", "presence", "frequency"):
        check_integer(body, f"{kind}_context_size", low=0, high=MAX_CONTEXT_SIZE)
    check_number(body, "xtc_probability", low=0, high=1)
    check_number(body, "xtc_threshold", low=0, high=1)
    check_type(body, "logprobs", bool)
    check_top_logprobs(body, bounds)
    check_integer(body, "seed", low=0, high=MAX_SEED, nullable=True)
    check_logit_bias(body, bounds)
    check_stop(body, bounds)
    check_template_kwargs(body)


def check_stream_options(body: dict) -> None:
    options = check_type(body, "stream_options", dict, nullable=True)
    if options is None:
        return
    check_type(options, "include_usage", bool, path="stream_options.include_usage")
    # Stock reads stream_options["include_usage"] after the last token: a
    # missing key would cut the stream it ends. OpenAI's default is false.
    options.setdefault("include_usage", False)


def check_top_logprobs(body: dict, bounds: RequestBounds) -> None:
    high = MAX_TOP_LOGPROBS if bounds.vocab_size is None else min(MAX_TOP_LOGPROBS, bounds.vocab_size)
    value = check_integer(body, "top_logprobs", low=-1, high=high)
    # -1 is stock's "none"; OpenAI's range starts at 0.
    return value


def check_logit_bias(body: dict, bounds: RequestBounds) -> None:
    bias = check_type(body, "logit_bias", dict, nullable=True)
    if not bias:
        return
    vocab = bounds.vocab_size
    if vocab is None:
        raise Invalid("logit_bias", "logit_bias cannot be used with this model: its vocabulary "
                      "size is unknown, so token ids cannot be checked.")
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise Invalid("logit_bias", f"logit_bias keys must be token ids; got {key!r}.",
                          code="invalid_type") from None
        if not 0 <= token < vocab:
            raise Invalid("logit_bias", f"logit_bias key {key!r} is not a token id of this model "
                          f"(0 to {vocab - 1}).")
        bias_value = _as_float(value)
        if bias_value is None or not -MAX_LOGIT_BIAS <= bias_value <= MAX_LOGIT_BIAS:
            raise Invalid("logit_bias", f"logit_bias values must be numbers from -100 to 100; "
                          f"got {value!r} for token {key}.")


def _as_float(value) -> Optional[float]:
    """A finite float from a number or a numeric string (stock takes float(v)), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def check_stop(body: dict, bounds: RequestBounds) -> None:
    stop = body.get("stop")
    if stop is None:
        return
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list):
        raise Invalid("stop", "stop must be a string or an array of strings.", code="invalid_type")
    # Stock builds a matcher from them and runs it after every token, on the loop
    # every request shares: their number and length are what the others pay.
    if bounds.max_stop_sequences is not None and len(words) > bounds.max_stop_sequences:
        raise Invalid("stop", f"stop may hold at most {bounds.max_stop_sequences} strings; got {len(words)}.")
    for i, word in enumerate(words):
        param = "stop" if isinstance(stop, str) else f"stop[{i}]"
        if not isinstance(word, str):
            # Stock tokenizes stop words on the generation thread: a number there kills it.
            raise Invalid(param, "stop must be a string or an array of strings.", code="invalid_type")
        if bounds.max_stop_chars is not None and len(word) > bounds.max_stop_chars:
            raise Invalid(param, f"A stop string may be at most {bounds.max_stop_chars} characters; "
                                 f"got {len(word)}.")


def check_template_kwargs(body: dict) -> None:
    kwargs = check_type(body, "chat_template_kwargs", dict, nullable=True) or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise Invalid(f"chat_template_kwargs.{reserved[0]}",
                      f"chat_template_kwargs cannot set {reserved[0]!r}: the server sets it.")
    for key, default in TEMPLATE_KWARGS_AT_DEFAULT.items():
        # `is` for the booleans and None: JSON's 1 is not true here, nor 0 false.
        if key in kwargs and kwargs[key] is not default:
            raise Invalid(f"chat_template_kwargs.{key}",
                          f"chat_template_kwargs.{key} may only be {json.dumps(default)}: the server needs the "
                          "prompt's tokens.")
    padding = kwargs.get("padding")
    if not any(padding is allowed or (isinstance(padding, str) and padding == allowed)
               for allowed in TEMPLATE_PADDING_ALLOWED):
        raise Invalid("chat_template_kwargs.padding",
                      "chat_template_kwargs.padding may only be false, true, \"longest\" or \"do_not_pad\": "
                      "padding a prompt to a length is refused.")
    max_length = kwargs.get("max_length")
    if max_length is not None:
        if type(max_length) is not int:
            raise Invalid("chat_template_kwargs.max_length", "chat_template_kwargs.max_length must be an integer.",
                          code="invalid_type")
        if max_length < 1:
            raise Invalid("chat_template_kwargs.max_length", "chat_template_kwargs.max_length must be at least 1.")
    template = kwargs.get("chat_template")
    if template is not None and not (isinstance(template, str) and TEMPLATE_NAME.fullmatch(template)):
        raise Invalid("chat_template_kwargs.chat_template",
                      "chat_template_kwargs.chat_template may only name one of the model's chat templates: "
                      "a template sent in a request is refused (--chat-template sets the server's).")


# -- the prompt ------------------------------------------------------------------------
def check_prompt(body: dict) -> None:
    if "prompt" not in body:
        raise Invalid("prompt", "A prompt is required.", code="missing_required_parameter")
    # OpenAI also takes arrays of strings or token ids; stock serves one string.
    check_type(body, "prompt", str)


def check_chat_fields(body: dict, bounds: RequestBounds) -> None:
    messages = body.get("messages")
    if messages is None:
        raise Invalid("messages", "messages is required.", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise Invalid("messages", "messages must be an array of message objects.", code="invalid_type")
    if not messages:
        raise Invalid("messages", "messages must contain at least one message.")
    if bounds.context_length is not None and len(messages) > bounds.context_length:
        # Refused before any is read or rendered: 100,000 one-letter messages took ~8 s of
        # the HTTP thread's Python (checks, template, tokens), and the generation thread
        # waited on the GIL meanwhile, so every other request with it.
        raise Invalid("messages", f"The conversation has {len(messages)} messages; this model's context holds "
                                  f"{bounds.context_length} tokens, and each message takes at least one. "
                                  "Shorten the message history.", code="context_length_exceeded")
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]", bounds)
    check_tools(body)
    role_mapping = check_type(body, "role_mapping", dict, nullable=True)
    for role, prefix in (role_mapping or {}).items():
        if not isinstance(prefix, str):
            raise Invalid(f"role_mapping.{role}", "role_mapping values must be strings.",
                          code="invalid_type")


def check_message(message, path: str, bounds: RequestBounds) -> None:
    if not isinstance(message, dict):
        raise Invalid(path, "Each message must be an object.", code="invalid_type")
    if "role" not in message:
        raise Invalid(f"{path}.role", "Each message needs a role.", code="missing_required_parameter")
    check_type(message, "role", str, path=f"{path}.role")
    for key in ("name", "tool_call_id"):
        check_type(message, key, str, path=f"{path}.{key}", nullable=True)
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            check_content_part(part, f"{path}.content[{j}]", bounds)
    elif content is not None and not isinstance(content, str):
        raise Invalid(f"{path}.content", "content must be a string or an array of content parts.",
                      code="invalid_type")
    tool_calls = check_type(message, "tool_calls", list, path=f"{path}.tool_calls", nullable=True)
    for k, call in enumerate(tool_calls or ()):
        check_tool_call(call, f"{path}.tool_calls[{k}]")


def check_content_part(part, path: str, bounds: RequestBounds) -> None:
    if not isinstance(part, dict):
        raise Invalid(path, "Each content part must be an object.", code="invalid_type")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise Invalid(f"{path}.text", "A text part needs a text string.", code="invalid_type")
        return
    if kind not in IMAGE_PART_TYPES:
        raise Invalid(f"{path}.type", f"Content parts of type {kind!r} are not supported; "
                      "use 'text'" + (" or 'image_url'." if bounds.accepts_images else "."))
    if not bounds.accepts_images:
        # Refused before stock would fetch an http(s) image URL on this thread.
        raise Invalid(f"{path}.type", "This model does not accept images.")
    url = part.get("image_url", part.get("image"))
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
        raise Invalid(path, "An image part needs a data: or http(s) URL.", code="invalid_type")


def check_tool_call(call, path: str) -> None:
    if not isinstance(call, dict):
        raise Invalid(path, "Each tool call must be an object.", code="invalid_type")
    function = check_type(call, "function", dict, path=f"{path}.function", nullable=True)
    if function is None:
        return
    check_type(function, "name", str, path=f"{path}.function.name", nullable=True)
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, (str, dict)):
        raise Invalid(f"{path}.function.arguments", "Tool call arguments must be a JSON string.",
                      code="invalid_type")


def check_tools(body: dict) -> None:
    tools = check_type(body, "tools", list, nullable=True)
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise Invalid(f"tools[{i}]", "Each tool must be an object.", code="invalid_type")
        function = check_type(tool, "function", dict, path=f"tools[{i}].function", nullable=True)
        if function is not None:
            check_type(function, "name", str, path=f"tools[{i}].function.name")


def check_strings_encodable(body: dict) -> None:
    """No lone surrogate (a JSON escape like \\ud800) in any string the tokenizer will see.

    Iterative, not recursive: a body nested as deep as the JSON parser
    allows must not overflow the stack here.
    """
    pending: list[tuple[str, Any]] = [(key, body[key]) for key in
                                      ("prompt", "messages", "tools", "stop", "role_mapping") if key in body]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise Invalid(path, "Strings must be valid Unicode (no lone surrogates).") from None
        elif isinstance(value, dict):
            pending.extend((f"{path}.{key}", item) for key, item in value.items())
            pending.extend((f"{path}.<key>", key) for key in value)
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


# -- one field -----------------------------------------------------------------------------
_TYPE_NAMES = {bool: "a boolean", str: "a string", dict: "an object", list: "an array",
               int: "an integer"}


def check_type(body: dict, key: str, expected: type, *, path: Optional[str] = None,
               nullable: bool = False):
    """``body[key]`` if absent (None), null where allowed, or of the expected type."""
    value = body.get(key)
    if key not in body or (value is None and nullable):
        return None
    # JSON's true is not an integer, whatever Python says.
    if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
        raise Invalid(path or key, f"{path or key} must be {_TYPE_NAMES[expected]}.",
                      code="invalid_type")
    return value


def check_integer(body: dict, key: str, *, low=None, high=None, nullable: bool = False):
    value = check_type(body, key, int, nullable=nullable)
    if value is not None:
        check_range(key, value, low, high)
    return value


def check_number(body: dict, key: str, *, low=None, high=None):
    if key not in body:
        return None
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(key, f"{key} must be a number.", code="invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise Invalid(key, f"{key} must be a finite number.")
    if isinstance(value, int) and not -MAX_INT64 <= value < MAX_INT64:
        # mlx casts a Python int it cannot hold to a float's type and fails
        # (std::bad_cast) while the batch steps.
        raise Invalid(key, f"{key} is out of range; got {value}.")
    check_range(key, value, low, high)
    return value


def check_range(key: str, value, low, high) -> None:
    if low is not None and value < low:
        raise Invalid(key, f"{key} must be at least {low}; got {value}.")
    if high is not None and value > high:
        raise Invalid(key, f"{key} must be at most {high}; got {value}.")

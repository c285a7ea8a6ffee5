"""What the guardian carries on stock's own request objects: tokens made at the door, the fingerprint;
a probe's request.
"""

from __future__ import annotations

import types
from typing import Optional

import mlx_lm.server as server

from guardian.stock.contract import ResponseGenerator


def tokenize_as_stock(model_provider, tokenizer, request, args) -> tuple:
    """Stock's own ``_tokenize`` of a request, without a ResponseGenerator:
    (prompt, segments, segment types, state[, vision]).

    Stock's method reads nothing of its generator but ``model_provider``
    (its flags, and on 0.32 its image processor), so admission can run it on
    the HTTP thread knowing only the model provider.
    """
    return ResponseGenerator._tokenize(types.SimpleNamespace(model_provider=model_provider), tokenizer, request, args)


# Where admission leaves a request's tokens for the engine: an attribute of
# stock's CompletionRequest (a plain dataclass), with the model key they
# were made for, so a request served by another model is tokenized again.
_TOKENIZED_ATTRIBUTE = "_guardian_tokenized"


def attach_tokens(request, model_key, tokenized: tuple) -> None:
    setattr(request, _TOKENIZED_ATTRIBUTE, (model_key, tokenized))


def reused_tokens(request, model_key):
    """A fresh copy of the tokens attached for ``model_key``, or None.

    The loop edits the segment lists it is given, and a request re-run
    after an engine failure is tokenized again: each call gets new lists.
    """
    attached = getattr(request, _TOKENIZED_ATTRIBUTE, None)
    if attached is None or attached[0] != model_key:
        return None
    return tuple(_fresh(part) for part in attached[1])


def _fresh(part):
    if not isinstance(part, list):
        return part
    return [item[:] if isinstance(item, list) else item for item in part]


# Where the recovery plugin leaves a request's fingerprint, computed at the
# door before any hook changed the request: an attribute of stock's
# GenerationArguments (a plain dataclass), which the loop passes along.
_FINGERPRINT_ATTRIBUTE = "_guardian_fingerprint"


def attach_fingerprint(args, fingerprint: str) -> None:
    setattr(args, _FINGERPRINT_ATTRIBUTE, fingerprint)


def attached_fingerprint(args):
    """The fingerprint the door computed for ``args``, or None (not admitted)."""
    return getattr(args, _FINGERPRINT_ATTRIBUTE, None)


def make_request(prompt: str, *, max_tokens: int, cli_args, logit_bias: Optional[dict] = None) -> tuple:
    """A text-completion request and its arguments, built as stock's handler does
    (``logit_bias``: token id -> bias, as in OpenAI's field)."""
    request = server.CompletionRequest("text", prompt, [], None, None)
    args = server.GenerationArguments(
        model=server.ModelDescription(model="default_model", draft="default_model", adapter=None),
        sampling=server.SamplingArguments(
            temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0, xtc_threshold=0.1
        ),
        logits=server.LogitsProcessorArguments(
            logit_bias=logit_bias,
            repetition_penalty=0.0,
            repetition_context_size=20,
            presence_penalty=0.0,
            presence_context_size=20,
            frequency_penalty=0.0,
            frequency_context_size=20,
        ),
        stop_words=[],
        max_tokens=max_tokens,
        num_draft_tokens=cli_args.num_draft_tokens,
        logprobs=False,
        top_logprobs=-1,
        seed=None,
        chat_template_kwargs=None,
    )
    return request, args

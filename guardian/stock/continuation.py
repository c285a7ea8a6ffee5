"""Continuations: a request given to the restarted loop after the tokens its client has, and a failed
batch's KV kept for it.
"""

from __future__ import annotations

import copy
from typing import Optional

import mlx.core as mx
import mlx_lm.server as server
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from guardian.stock.contract import STOCK_DETOKENIZER, loop_thread, generate_module


# -- continuations: a request that had produced tokens when the engine failed --
#
# The restarted loop is given the request again, as a request whose prompt is
# the original prompt followed by the tokens its client already has (or holds,
# non-streaming), with the rest of its max_tokens. Stock builds three things
# from a request that depend on what came before: its prompt (above, in
# _tokenize), its stop matching (a stop sequence may span the seam) and its
# detokenizer (a word, a space or a UTF-8 character may span the seam). The
# last two are primed with the tokens already generated, so the continuation
# produces the very tokens and text the unfailed run would have.
_CONTINUED_ATTRIBUTE = "_guardian_continued"


def continuation_args(args, generated: list[int]):
    """A copy of a request's GenerationArguments that continues it after the
    tokens ``generated``: the rest of its ``max_tokens``, the same sampling
    and stop words; the attributes the guardian attached (its fingerprint)
    carried over. Continuing a continuation goes on after both runs' tokens."""
    continued = copy.copy(args)
    if args.max_tokens > 0:  # negative: no limit
        continued.max_tokens = args.max_tokens - len(generated)
    setattr(continued, _CONTINUED_ATTRIBUTE, [*(continued_tokens(args) or ()), *generated])
    return continued


_FRESH_ATTRIBUTE = "_guardian_fresh"


def fresh_args(args):
    """A copy of a request's GenerationArguments whose run takes no KV from before it:
    none from the prompt cache, none kept from a failed batch (``prefill_from_nothing``)."""
    fresh = copy.copy(args)
    setattr(fresh, _FRESH_ATTRIBUTE, True)
    return fresh


def note_fresh(args) -> None:
    """On the loop thread, as stock tokenizes a request: whether its run is a fresh one.
    Stock looks its prompt up in the prompt cache right after."""
    loop_thread.fresh = getattr(args, _FRESH_ATTRIBUTE, False)


def prefill_from_nothing() -> bool:
    """Whether the request stock looks up now is to take no KV from before it."""
    return getattr(loop_thread, "fresh", False)


def continuable(request) -> bool:
    """Whether a request can be continued: not one with images, whose prompt
    cache key (0.32's vision key) is made from the prompt as it came."""
    image_parts = getattr(server, "_image_parts", None)  # 0.32; 0.31 serves no images
    return image_parts is None or not any(image_parts(request.messages or []))


def continued_tokens(args) -> Optional[list[int]]:
    """The tokens a continuation's arguments go on from, or None (a first run)."""
    return getattr(args, _CONTINUED_ATTRIBUTE, None)


class _PrimedStopSequences:
    """0.32's StopSequences whose matchers start after ``tokens``."""

    def __init__(self, stop_sequences, tokens: list[int]):
        self._stop_sequences = stop_sequences
        self._tokens = tokens

    def matcher(self):
        matcher = self._stop_sequences.matcher()
        for token in self._tokens:
            matcher.advance(token)
        return matcher


if hasattr(generate_module, "SequenceStateMachine"):

    class _PrimedSequenceStateMachine(generate_module.SequenceStateMachine):
        """0.31's SequenceStateMachine whose states start after ``tokens``
        (also in the right one of normal, reasoning, tool)."""

        def __init__(self, machine, tokens: list[int]):
            self._initial = machine._initial
            self._states = machine._states
            self._tokens = tokens

        def make_state(self):
            state = super().make_state()
            for token in self._tokens:
                if state[0] is None:
                    break
                state, _, _ = self.match(state, token)
            return state


def primed_stop_matching(machine, tokens: list[int]):
    """Stock's stop matching for one request (0.32: StopSequences; 0.31:
    SequenceStateMachine), starting after ``tokens``."""
    if hasattr(machine, "matcher"):
        return _PrimedStopSequences(machine, tokens)
    return _PrimedSequenceStateMachine(machine, tokens)


def detokenizer_primed_for_continuation(tokenizer):
    """Stock's fresh detokenizer; on a loop thread preparing a continuation,
    one that has already read the tokens sent, so the next token's text is
    what it would have been without the failure (a leading space kept, a
    character split across the seam completed)."""
    detokenizer = STOCK_DETOKENIZER.fget(tokenizer)
    generated = getattr(loop_thread, "continued", None)
    if generated:
        loop_thread.continued = None  # one detokenizer per request
        for token in generated:
            detokenizer.add_token(token)
        detokenizer.last_segment  # the client has this text already
    return detokenizer


def rows_of_completed_steps(batch_generator) -> Optional[list[tuple[list[int], list]]]:
    """The KV cache of each request in an observed BatchGenerator (``step_observed``),
    copied out of the batch, with the tokens it holds: the prompt (as far as it
    was prefilled), then every token the request's steps produced, the last one
    possibly not yet sent. None when a step or a removal raised half way: its
    caches may be half written.

    The copies are evaluated here, so a step whose work failed after it returned
    (mlx raises such an error at the next evaluation) raises here too; the caller
    then keeps nothing. Call on the loop thread that made the batch, before its
    frames are released.
    """
    if not batch_generator._guardian_settled:
        return None
    with mx.stream(batch_generator.stream):
        extracted = batch_generator.extract_cache(sorted(batch_generator._guardian_rows))
        rows = [(list(tokens), cache) for cache, tokens in extracted.values() if len(tokens)]
        mx.eval([_arrays(cache) for _, cache in rows])
    return rows


def _arrays(cache: list) -> list:
    """The arrays of one request's KV cache (each layer's state may hold numbers and Nones too)."""
    return [leaf for layer in cache for _, leaf in tree_flatten(layer.state) if isinstance(leaf, mx.array)]


def cache_nbytes(cache: list) -> int:
    return sum(layer.nbytes for layer in cache)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (list slices compare in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    shared, differs = 0, n  # a[:shared] == b[:shared], a[:differs] != b[:differs]
    while differs - shared > 1:
        middle = (shared + differs) // 2
        if a[:middle] == b[:middle]:
            shared = middle
        else:
            differs = middle
    return shared


def reusable_length(prompt: list[int], kept_tokens: list[int], cache: list) -> int:
    """How many of ``prompt``'s leading tokens a KV cache holding ``kept_tokens``
    can spare the prefill (0: none). At least the prompt's last token is left
    to prefill, as stock's prompt cache leaves it: the request's next token is
    sampled from that prefill. A cache holding more than that must be cut back
    (``cut_cache``), which only trimmable caches allow."""
    usable = min(common_prefix_length(prompt, kept_tokens), len(prompt) - 1)
    if usable < len(kept_tokens) and not can_trim_prompt_cache(cache):
        return 0
    return max(usable, 0)


def with_a_token_to_prefill(found: tuple, tokens: list[int]) -> tuple:
    """Stock's prompt cache's answer (``found``: the cache, the tokens left to prefill) with
    at least the prompt's last token left, as its answer for a longer entry leaves it. For
    an entry of exactly the prompt it leaves none, and its loop inserts an empty sequence:
    "Sequence N has an empty prompt" (0.32), IndexError (0.31.3), and stock's generation
    thread dies. Such an entry is a cancelled stream's prompt less its last token (stock
    caches each segment but the last, and only a finished request's insert drops it), or
    a finished one's prompt and answer sent again as a prompt. The copy stock returned is
    cut back one token where it can be; else it is not used."""
    cache, rest = found
    if cache is None or len(rest) or not len(tokens):
        return found
    if can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, 1)
        return cache, list(tokens[-1:])
    return None, tokens


def cut_cache(cache: list, holds: int, keep: int) -> list:
    """A KV cache holding ``holds`` tokens, cut in place to its first ``keep``."""
    if holds > keep:
        trim_prompt_cache(cache, holds - keep)
    return cache

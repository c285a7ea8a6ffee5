"""The one place that touches mlx_lm's private or internal names.

mlx-guardian embeds stock ``mlx_lm.server`` instead of copying it. Embedding
needs a few seams that mlx_lm does not publish: the generation loop method,
module globals the loop looks up at call time, the flag parser built inside
``main()``. Every such seam is named here, checked at import, and covered by
``tests/test_stock_contract.py``, so an mlx-lm release that moves one fails
loudly with the name instead of misbehaving quietly.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import threading
import importlib
import importlib.metadata
import types
from typing import Callable, Iterator, Optional

import mlx.core as mx

from guardian.errors import EngineStepError
from guardian.open_files import never_lowered

# mlx_lm.utils sets the open-files limit to (2048, 4096) when imported, hard
# limit included: a server could then never hold more connections than that.
with never_lowered():
    import mlx_lm.sample_utils as sample_utils
    import mlx_lm.server as server
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from huggingface_hub.utils import CacheNotFound

# The module, not the function mlx_lm's package exports under the same name.
generate_module = importlib.import_module("mlx_lm.generate")

STOCK_VERSION = importlib.metadata.version("mlx-lm")
TESTED_VERSIONS = ("0.31.3", "0.32.2")

# Instance attributes set by stock's __init__ (checked by the contract test).
INSTANCE_ATTRIBUTES = {
    "_generation_thread": "replaced when a stuck loop is abandoned",
    "requests": "the engine's request queue, replaced by the ledger",
    "_stop": "set to make the loop leave at its next turn",
    "_time_budget": "the run of decode steps between looks at the queue; ended early when a request waits",
    "_is_distributed": "a rank of an mlx.launch group: a failed batch's KV is not kept (ranks must prefill alike)",
}

# (object, attribute) pairs the guardian relies on, with why. The contract
# test walks this table; so does ``check_stock()`` at start-up.
REQUIRED = {
    "ResponseGenerator._generate": "the generation loop the engine supervises",
    "ResponseGenerator._tokenize": "tokenize once on the HTTP thread, as stock does; a continuation's prompt",
    "ResponseGenerator.generate": "the HTTP thread's side of a request",
    "ResponseGenerator.stop_and_join": "clean shutdown of the generation thread",
    "ModelProvider.load_default": "load the --model weights before serving",
    "ModelProvider.load": "load a model the way stock does",
    "APIHandler.handle_completion": "wrapped to answer engine faults properly",
    "APIHandler.validate_model_parameters": "extended: every field checked at the door against the loaded model",
    "APIHandler.do_GET": "extended with /health, /livez, /readyz, /guardian/status",
    "GenerationContext.stop": "client-gone signal, linked across a re-run",
    "Response": "a token on a request's response queue",
    "BatchGenerator": "module global the loop instantiates; subclassed",
    "stream_generate": "module global the non-batched path calls; wrapped",
    "run": "module global main() calls; replaced by the guardian's",
    "main": "parses every stock flag with stock's own parser",
    "get_system_fingerprint": "the handler's system_fingerprint",
    "APIHandler._set_completion_headers": "status line with stock's CORS headers",
    "APIHandler._set_cors_headers": "replaced: the door decides which origin is granted (guardian.access)",
    "LRUPromptCache": "the prompt cache the engine owns",
    "LRUPromptCache.trim_to": "drop least recently used entries: under memory pressure (resources), after a stall",
    "LRUPromptCache.nbytes": "the prompt cache's bytes: how much a trim must drop; resource samples",
    "BatchGenerator.prompt_cache_nbytes": "the KV caches of the requests in the batch, for resource samples",
    "BatchGenerator.insert_segments": "how the loop adds a request to the batch: its row is tracked",
    "BatchGenerator.remove": "how the loop drops requests from the batch: their rows are forgotten",
    "BatchGenerator.extract_cache": "a failed batch's KV caches, kept for the requests it re-runs",
    "BatchGenerator.stream": "the stream a batch's arrays belong to, where its KV caches are copied",
    "LRUPromptCache.fetch_nearest_cache": "where the loop looks up a request's cached prefix: a re-run's kept KV first",
    "ModelProvider._load": "what load() calls with the model key it computed",
    "APIHandler.handle_models_request": "stock's /v1/models listing, extended",
    "scan_cache_dir": "module global the listing calls; made safe without a hub cache",
    "CompletionRequest": "built for synthetic probes",
    "GenerationArguments": "built for synthetic probes",
    "ModelDescription": "built for synthetic probes",
    "SamplingArguments": "built for synthetic probes",
    "LogitsProcessorArguments": "built for synthetic probes",
    "TimeBudget": "subclassed to end a run of decode steps when a request waits",
    "ResponseGenerator._make_state_machine": "where tests/plugins/request_faults.py plants a fault "
                                             "while stock prepares a request; overridden so a "
                                             "continuation's stop matching starts after the tokens sent",
    "_make_sampler": "module global the loop calls per request; wrapped so a sampler that raises fails its request alone",
    "_make_logits_processors": "module global the loop calls per request; wrapped so a processor that raises fails its request alone",
}

class StockChanged(RuntimeError):
    """The installed mlx-lm no longer has a name the guardian embeds."""


# Outside mlx_lm.server: a property replaced once for the process, so a
# continuation's detokenizer starts primed with the tokens already sent.
REQUIRED_PROPERTIES = {
    "mlx_lm.tokenizer_utils.TokenizerWrapper.detokenizer": (TokenizerWrapper, "detokenizer"),
}


def missing_names() -> list[str]:
    """Full names from REQUIRED (and REQUIRED_PROPERTIES) that the installed mlx_lm lacks."""
    missing = [name for name, (owner, attribute) in REQUIRED_PROPERTIES.items()
               if not isinstance(owner.__dict__.get(attribute), property)]
    for dotted in REQUIRED:
        obj = server
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"mlx_lm.server.{dotted}")
                break
    return missing


def check_stock() -> None:
    """Raise StockChanged naming every seam the installed mlx-lm moved."""
    missing = missing_names()
    if missing:
        raise StockChanged(
            f"mlx-lm {STOCK_VERSION} lacks " + ", ".join(missing)
            + f"; mlx-guardian is tested with mlx-lm {', '.join(TESTED_VERSIONS)}"
        )


check_stock()

# The originals, kept before anything swaps the module globals.
STOCK_BATCH_GENERATOR = server.BatchGenerator
STOCK_STREAM_GENERATE = server.stream_generate
STOCK_SCAN_CACHE_DIR = server.scan_cache_dir
STOCK_MAKE_SAMPLER = server._make_sampler
STOCK_MAKE_LOGITS_PROCESSORS = server._make_logits_processors

ResponseGenerator = server.ResponseGenerator
ModelProvider = server.ModelProvider
APIHandler = server.APIHandler
GenerationContext = server.GenerationContext
Response = server.Response
LRUPromptCache = server.LRUPromptCache
get_system_fingerprint = server.get_system_fingerprint


class RequestAwareTimeBudget(server.TimeBudget):
    """Stock's budget for a run of decode steps, ended as soon as a request waits.

    Stock's loop takes what is queued, then decodes for up to half a second
    before it looks at the queue again. A request that arrives just after
    the look waits out the run, and so does the batch it would have joined:
    measured with 8 streaming clients, one request often decoded alone for
    its whole completion while seven others waited. Ending the run at the
    next step instead lets the loop take the request the way stock does at
    the end of every run.
    """

    def __init__(self, request_waiting: Callable[[], bool]):
        super().__init__()
        self._request_waiting = request_waiting
        self._stepped = False

    def __iter__(self):
        self._stepped = False
        return super().__iter__()

    def __next__(self):
        # Every run makes at least one step: while stock drains its batch
        # for a request it cannot batch (a seed, images), it takes nothing
        # from the queue, and runs that ended at once would never drain it.
        # The ranks of a distributed server must end every run on the same
        # step (stock counts steps there): leave those runs to stock.
        if self._stepped and not self._is_distributed and self._request_waiting():
            raise StopIteration
        self._stepped = True
        return super().__next__()


class SupervisableResponseGenerator(ResponseGenerator):
    """Stock ResponseGenerator whose thread runs ``supervise(stock_loop)``.

    0.31 starts ``Thread(target=self._generate)``, 0.32 ``_run_generate``
    which calls ``self._generate()``: overriding ``_generate`` reaches both.
    """

    def _generate(self):
        self.supervise(super()._generate)

    def supervise(self, run_stock_loop: Callable[[], None]) -> None:
        raise NotImplementedError

    def request_waiting(self) -> bool:
        """Whether the loop would get a request if it looked now (called between steps)."""
        return False

    # Stock's __init__ assigns its own TimeBudget; the engine's ends a run of
    # decode steps when a request waits.
    @property
    def _time_budget(self):
        return self._request_aware_time_budget

    @_time_budget.setter
    def _time_budget(self, stock_budget):
        self._request_aware_time_budget = RequestAwareTimeBudget(self.request_waiting)

    def _tokenize(self, tokenizer, request, args):
        """Stock's tokenization, unless admission already did it for this request;
        a continuation's prompt goes on with the tokens its client already has."""
        generated = continued_tokens(args)
        # Read by the next _make_state_machine and detokenizer on this thread:
        # stock's loop builds both for this request right after its tokens.
        _this_loop.continued = generated
        tokenized = reused_tokens(request, self.model_provider.model_key)
        if tokenized is None:
            tokenized = super()._tokenize(tokenizer, request, args)
        if not generated:
            return tokenized
        prompt, segments, *rest = tokenized
        return (prompt + generated, [*segments[:-1], segments[-1] + generated], *rest)

    def _make_state_machine(self, *args, **kwargs):
        """Stock's stop matcher (0.31: its state machine), which for a
        continuation starts where the tokens already sent left it: a stop
        sequence that spans the seam still stops the request."""
        made = super()._make_state_machine(*args, **kwargs)
        generated = getattr(_this_loop, "continued", None)
        if not generated:
            return made
        return (primed_stop_matching(made[0], generated), *made[1:])


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


def sampling_kind(args) -> tuple[str, ...]:
    """The samplers and logits processors a request's GenerationArguments turn
    on, by name. mlx compiles their kernels at first use (on CUDA with a cold
    kernel cache a first sampled token took 25 s), so the watchdog gives a
    kind's first token the long stall limit (guardian.health.pace)."""
    sampling, logits = getattr(args, "sampling", None), getattr(args, "logits", None)

    def number(owner, name, default):
        value = getattr(owner, name, None)
        return default if value is None else value

    flags = {
        "temperature": number(sampling, "temperature", 0) > 0,
        "top_p": 0 < number(sampling, "top_p", 1) < 1,
        "top_k": number(sampling, "top_k", 0) > 0,
        "min_p": number(sampling, "min_p", 0) > 0,
        "xtc": number(sampling, "xtc_probability", 0) > 0,
        "logit_bias": bool(getattr(logits, "logit_bias", None)),
        "repetition_penalty": number(logits, "repetition_penalty", 0) not in (0, 1),
        "presence_penalty": number(logits, "presence_penalty", 0) != 0,
        "frequency_penalty": number(logits, "frequency_penalty", 0) != 0,
        "logprobs": bool(getattr(args, "logprobs", False)) or number(args, "top_logprobs", 0) > 0,
    }
    return tuple(name for name, on in flags.items() if on)


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


STOCK_DETOKENIZER = TokenizerWrapper.detokenizer


def _detokenizer_primed_for_continuation(tokenizer):
    """Stock's fresh detokenizer; on a loop thread preparing a continuation,
    one that has already read the tokens sent, so the next token's text is
    what it would have been without the failure (a leading space kept, a
    character split across the seam completed)."""
    detokenizer = STOCK_DETOKENIZER.fget(tokenizer)
    generated = getattr(_this_loop, "continued", None)
    if generated:
        _this_loop.continued = None  # one detokenizer per request
        for token in generated:
            detokenizer.add_token(token)
        detokenizer.last_segment  # the client has this text already
    return detokenizer


# Where the recovery plugin leaves a request's fingerprint, computed at the
# door before any hook changed the request: an attribute of stock's
# GenerationArguments (a plain dataclass), which the loop passes along.
_FINGERPRINT_ATTRIBUTE = "_guardian_fingerprint"


def attach_fingerprint(args, fingerprint: str) -> None:
    setattr(args, _FINGERPRINT_ATTRIBUTE, fingerprint)


def attached_fingerprint(args):
    """The fingerprint the door computed for ``args``, or None (not admitted)."""
    return getattr(args, _FINGERPRINT_ATTRIBUTE, None)


def requested_model_key(model_provider, model) -> tuple:
    """The key stock's ``ModelProvider.load()`` computes for a request's model.

    ``load()`` maps "default_model" and friends to the served paths, and the
    mapping differs between mlx-lm versions; rather than copy it, run stock's
    own ``load()`` on a shallow copy whose ``_load`` only records the key.
    """
    recorded = []
    probe = copy.copy(model_provider)
    probe.model_key = _NEVER_LOADED
    probe._load = lambda *model_key: recorded.append(model_key)
    # The class's load(): an instance may carry a wrapper that really loads.
    ModelProvider.load(probe, model.model, model.adapter, model.draft)
    return recorded[0]


_NEVER_LOADED = object()


def loaded_tokenizer(model_provider, args):
    """(model_key, tokenizer) when the request asks for the loaded model, else None.

    Another model would be loaded by the engine thread when the request gets
    there; its tokenizer does not exist before.
    """
    model_key, tokenizer = model_provider.model_key, model_provider.tokenizer
    if model_key is None or tokenizer is None:
        return None  # a load is under way
    if requested_model_key(model_provider, args.model) != model_key:
        return None
    return model_key, tokenizer


class _EmptyHubCache:
    repos = frozenset()


def _scan_cache_dir_or_empty(*args, **kwargs):
    """Stock's scan, but no hub cache folder means no hub models, not a crash."""
    try:
        return STOCK_SCAN_CACHE_DIR(*args, **kwargs)
    except CacheNotFound:
        return _EmptyHubCache()


def models_listing(handler) -> dict:
    """The JSON stock's /v1/models handler would send, not yet sent.

    Stock writes its 200 status line before it scans the hub cache, then
    raises when there is none: run it against a buffer, with the scan made
    safe, and let the caller send the result.
    """
    server.scan_cache_dir = _scan_cache_dir_or_empty
    wfile, handler.wfile = handler.wfile, io.BytesIO()
    log_request = handler.log_request
    handler.log_request = lambda *args: None  # the caller's response is logged
    try:
        handler.handle_models_request()
        written = handler.wfile.getvalue()
    finally:
        handler.wfile = wfile
        handler.log_request = log_request
    return json.loads(written.partition(b"\r\n\r\n")[2])


def stop_generation_thread(response_generator) -> None:
    """Ask the stock loop to leave at its next turn, without joining it."""
    response_generator._stop = True


def reset_model_provider(model_provider) -> None:
    """Make the next ``load()`` read the weights again (0.31 has no reset())."""
    model_provider.model_key = None


def guard_model_loads(model_provider, check_owner: Callable[[], None]) -> None:
    """Let a model that stock's ``_load`` read land only while its loading thread owns the engine.

    Stock's ``_load`` drops the loaded model, reads the next one (on the loop
    thread: a reload, a switch), then assigns it to the provider. A loop
    thread abandoned while it reads (a hung disk) would assign it behind the
    loop that replaced it, with no contact with the guardian before. Here it
    reads into a shallow copy of the provider, and the copy's loaded
    attributes are assigned only if ``check_owner()`` passes (it raises
    otherwise). The served model is still dropped first, as stock drops it,
    so two models are never held at once. One engine per provider.
    """

    def load_while_owner(*model_key):
        _drop_loaded_model(model_provider)
        shadow = copy.copy(model_provider)
        vars(shadow).pop("_load", None)
        ModelProvider._load(shadow, *model_key)
        check_owner()
        for name, value in vars(shadow).items():
            if getattr(model_provider, name, None) is not value:
                setattr(model_provider, name, value)

    model_provider._load = load_while_owner


def _drop_loaded_model(model_provider) -> None:
    """What stock's ``_load`` does first: forget the loaded model (0.32: reset(); 0.31 by hand)."""
    reset = getattr(model_provider, "reset", None)
    if reset is not None:
        reset()
    else:
        model_provider.model_key = model_provider.model = model_provider.tokenizer = None
        model_provider.draft_model = None


def step_observed(stock_class, observe: Callable[[], None], returned: Callable[[], None] = lambda: None):
    """A subclass of stock BatchGenerator calling ``observe()`` before each step
    and ``returned()`` after it, which knows its requests' rows and whether
    their KV caches are those of a completed step (``rows_of_completed_steps``)."""

    class ObservedBatchGenerator(stock_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # The uids of the requests inserted and not yet finished or removed.
            self._guardian_rows: set[int] = set()
            # False while a step or a removal changes the KV caches: one that
            # raised may have left them half written.
            self._guardian_settled = True
            # The engine whose loop made it may read its requests' KV caches.
            made: Optional[Callable[[object], None]] = getattr(_this_loop, "batch_made", None)
            if made is not None:
                made(self)

        def insert_segments(self, *args, **kwargs):
            uids = super().insert_segments(*args, **kwargs)
            self._guardian_rows.update(uids)
            return uids

        def remove(self, uids, *args, **kwargs):
            self._guardian_settled = False
            removed = super().remove(uids, *args, **kwargs)
            self._guardian_rows.difference_update(uids)
            self._guardian_settled = True
            return removed

        def next(self):
            observe()  # a fault planted here leaves the last step's KV as it was
            self._guardian_settled = False
            responses = super().next()
            self._guardian_settled = True
            _forget_finished_rows(self._guardian_rows, responses)
            # A stuck step may return long after the watchdog replaced its loop:
            # what stock does next with the responses evaluates arrays
            # (logprobs[token].item()), GPU work beside the live loop's.
            returned()
            return responses

    ObservedBatchGenerator.__name__ = f"Observed{stock_class.__name__}"
    return ObservedBatchGenerator


def _forget_finished_rows(rows: set[int], responses) -> None:
    """Drop the rows whose request ended at this step (stock drops them from its batch)."""
    _, generated = responses  # (prompt responses, generation responses), 0.31 and 0.32
    for response in generated:
        if response.finish_reason is not None:
            rows.discard(response.uid)


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


def cut_cache(cache: list, holds: int, keep: int) -> list:
    """A KV cache holding ``holds`` tokens, cut in place to its first ``keep``."""
    if holds > keep:
        trim_prompt_cache(cache, holds - keep)
    return cache


def is_distributed(response_generator) -> bool:
    """Whether stock serves as one rank of an mlx.launch group (its ranks must prefill alike)."""
    return bool(getattr(response_generator, "_is_distributed", False))


def stream_observed(stock_stream_generate, observe: Callable[[], None], returned: Callable[[], None] = lambda: None):
    """Stock stream_generate calling ``observe()`` before each token and ``returned()`` after it."""

    def observed_stream_generate(*args, **kwargs) -> Iterator:
        tokens = stock_stream_generate(*args, **kwargs)
        while True:
            try:
                observe()
                item = next(tokens)
            except StopIteration:
                return
            except Exception as e:
                # Stock's non-batched path catches everything and blames the
                # request; mark a failed step as the engine's.
                raise EngineStepError(e) from e
            returned()
            yield item

    return observed_stream_generate


# Pins a failure on the request with these GenerationArguments: (args,
# exception, where) -> whether it could (else the exception is the engine's).
PinOnRequest = Callable[[object, BaseException, str], bool]

# The seams below are module globals of mlx_lm.server, one set for the whole
# process, while a process may run several engines (stock allows several
# ResponseGenerators, and its own server tests make two). So they are
# swapped once, and each call is routed to the engine whose loop runs on the
# calling thread: each engine's loop thread says which one it is.
_this_loop = threading.local()
_routing_installed = False
_routing_lock = threading.Lock()


def route_loop_thread(*, observe: Callable[[], None], pin: PinOnRequest,
                      batch_made: Optional[Callable[[object], None]] = None,
                      returned: Optional[Callable[[], None]] = None) -> None:
    """Route the stock loop's steps and sampling failures on the calling thread
    to one engine's ``observe`` (before a step), ``returned`` (after it) and
    ``pin``. Installs the seams the first time."""
    _install_routing()
    _this_loop.observe = observe
    _this_loop.returned = returned
    _this_loop.pin = pin
    _this_loop.batch_made = batch_made
    _this_loop.continued = None


def _install_routing() -> None:
    """Swap the module globals once for the process (an abandoned loop never undoes it)."""
    global _routing_installed
    with _routing_lock:
        if not _routing_installed:
            observe_engine_steps(_observe_this_loop, _returned_on_this_loop)
            guard_request_sampling(_pin_on_this_loop)
            TokenizerWrapper.detokenizer = property(_detokenizer_primed_for_continuation)
            _routing_installed = True


def _observe_this_loop() -> None:
    """An engine step on the calling thread: its engine observes it (no engine: stock's own use)."""
    observe: Optional[Callable[[], None]] = getattr(_this_loop, "observe", None)
    if observe is not None:
        observe()


def _returned_on_this_loop() -> None:
    """An engine step on the calling thread returned: its engine looks (no engine: nothing)."""
    returned: Optional[Callable[[], None]] = getattr(_this_loop, "returned", None)
    if returned is not None:
        returned()


def _pin_on_this_loop(args, exc: BaseException, where: str) -> bool:
    """A request's sampling failed on the calling thread: its engine pins it, if any."""
    pin: Optional[PinOnRequest] = getattr(_this_loop, "pin", None)
    return pin is not None and pin(args, exc, where)


def observe_engine_steps(observe: Callable[[], None], returned: Callable[[], None] = lambda: None) -> None:
    """Route every engine step of the stock loop through ``observe()`` (before
    it) and ``returned()`` (after it).

    The loop looks ``BatchGenerator`` and ``stream_generate`` up in the
    server module's globals at call time, so swapping those globals is how
    a step can be observed without touching the loop's code. Called once for
    the process, by ``route_loop_thread``.
    """
    server.BatchGenerator = step_observed(STOCK_BATCH_GENERATOR, observe, returned)
    server.stream_generate = stream_observed(STOCK_STREAM_GENERATE, observe, returned)


def _argmax(logprobs):
    """The greedy token of each row: what a failed request's row samples
    until stock drops it from the batch."""
    return mx.argmax(logprobs, axis=-1)


def guarded_sampler(sampler, args, pin: PinOnRequest):
    """A request's sampler whose exception fails that request only."""
    failed = False

    def sampler_of_one_request(logprobs):
        nonlocal failed
        if not failed:
            try:
                return sampler(logprobs)
            except Exception as e:
                if not pin(args, e, "sampler"):
                    raise
                failed = True
        return _argmax(logprobs)

    return sampler_of_one_request


def guarded_logits_processor(processor, args, pin: PinOnRequest):
    """One of a request's logits processors whose exception fails that request only."""
    failed = False

    def processor_of_one_request(tokens, logits):
        nonlocal failed
        if not failed:
            try:
                return processor(tokens, logits)
            except Exception as e:
                if not pin(args, e, "logits_processor"):
                    raise
                failed = True
        return logits  # unchanged: the row is dropped at the step's end

    return processor_of_one_request


class AlwaysTruthyProcessors(list):
    """One request's logits processors, truthy even when there are none.

    mlx-lm 0.31's ``GenerationBatch.filter`` drops finished rows from its
    per-row list of processors only ``if any(self.logits_processors)``: after
    a request without processors finishes in a batch where no row has any,
    the list is left longer than the batch, and a request that joins later
    is paired with another row's processors (its ``logit_bias`` acts on
    nobody, or on another client). Truthy lists keep the rows in step; the
    cost is 0.31 stepping each row's (empty) processors separately. 0.32
    filters the list unconditionally and keeps plain lists.
    """

    def __bool__(self) -> bool:
        return True


ROW_PROCESSORS = AlwaysTruthyProcessors if STOCK_VERSION.startswith("0.31.") else list


def guard_request_sampling(pin: PinOnRequest) -> None:
    """Make each request's sampler and logits processors fail that request alone.

    Stock's loop builds them per request with the module functions
    ``_make_sampler(args, tokenizer)`` and ``_make_logits_processors(args)``,
    looked up in the server module's globals at call time, and
    ``BatchGenerator`` calls them row by row (0.31 always, 0.32 when the
    rows' samplers differ). An exception there, while building them or at a
    step, belongs to the request whose ``args`` they were built from:
    ``pin`` ends that request and stops its context, so stock drops it from
    the batch the way it drops a finished one, and the row gets a harmless
    value for the rest of the step. When ``pin`` cannot find the request,
    the exception propagates: an engine failure, as before. Called once
    for the process, by ``route_loop_thread``.
    """
    # 0.32's sampler for temperature 0 is one function shared by every such
    # request, which BatchGenerator calls once for the whole batch: it holds
    # nothing of a request, and wrapping it would sample row by row.
    shared_sampler = getattr(sample_utils, "greedy_sampler", None)

    def make_sampler(args, tokenizer):
        try:
            sampler = STOCK_MAKE_SAMPLER(args, tokenizer)
        except Exception as e:
            if not pin(args, e, "make_sampler"):
                raise
            return _argmax
        if sampler is shared_sampler:
            return sampler
        return guarded_sampler(sampler, args, pin)

    def make_logits_processors(args):
        try:
            processors = STOCK_MAKE_LOGITS_PROCESSORS(args)
        except Exception as e:
            if not pin(args, e, "make_logits_processors"):
                raise
            processors = []
        return ROW_PROCESSORS([guarded_logits_processor(p, args, pin) for p in processors])

    server._make_sampler = make_sampler
    server._make_logits_processors = make_logits_processors


def start_generation_thread(response_generator) -> Optional[threading.Thread]:
    """Run the stock loop on a fresh thread, as stock's __init__ does; return the
    thread it replaces.

    Used to replace a loop thread that is stuck in a step; the old thread
    cannot be killed, only abandoned. Daemon, so a thread stuck in native
    code never holds the process open.
    """
    replaced = getattr(response_generator, "_generation_thread", None)
    thread = threading.Thread(
        target=response_generator._generate, name="generation", daemon=True
    )
    response_generator._generation_thread = thread
    thread.start()
    return replaced


def make_request(prompt: str, *, max_tokens: int, cli_args) -> tuple:
    """A text-completion request and its arguments, built as stock's handler does."""
    request = server.CompletionRequest("text", prompt, [], None, None)
    args = server.GenerationArguments(
        model=server.ModelDescription(model="default_model", draft="default_model", adapter=None),
        sampling=server.SamplingArguments(
            temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, xtc_probability=0.0, xtc_threshold=0.1
        ),
        logits=server.LogitsProcessorArguments(
            logit_bias=None,
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


class DoorCorsHandler(APIHandler):
    """Stock's handler, its CORS grant decided by the subclass's ``cors_origin()``.

    Stock grants ``Access-Control-Allow-Origin: *`` unless ``--allowed-origins``
    says otherwise; the guardian grants only what the door allows (by default
    pages on this machine). The other two headers are stock's, plus
    Authorization, which a browser never covers by "*".
    """

    def cors_origin(self):  # pragma: no cover - the subclass's
        raise NotImplementedError

    def _set_cors_headers(self):
        origin = self.cors_origin()
        if origin is not None:
            self.send_header("Access-Control-Allow-Origin", origin)
            if origin != "*":
                self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", "*")
        self.send_header("Access-Control-Allow-Headers", "*, Authorization")


def set_completion_headers(handler, status_code: int) -> None:
    """Status line, JSON content type and stock's CORS headers."""
    handler._set_completion_headers(status_code)


def run_stock_main(
    run: Callable,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    after_parse: Callable[[argparse.Namespace], None],
):
    """Run stock ``main()``: stock parses its flags, then calls ``run``.

    Stock builds its parser inside ``main()``; the guardian adds its own
    flags to that very parser just before it parses, so ``--help`` shows
    both and every stock flag keeps its name, default and meaning.
    ``after_parse`` sees the flags before stock builds its ModelProvider.
    """
    stock_parse_args = argparse.ArgumentParser.parse_args
    extended = set()

    def parse_args_with_guardian_flags(parser, *args, **kwargs):
        if id(parser) not in extended:
            extended.add(id(parser))
            add_arguments(parser)
        namespace = stock_parse_args(parser, *args, **kwargs)
        after_parse(namespace)
        return namespace

    saved_run = server.run
    server.run = run
    argparse.ArgumentParser.parse_args = parse_args_with_guardian_flags
    try:
        return server.main()
    finally:
        argparse.ArgumentParser.parse_args = stock_parse_args
        server.run = saved_run


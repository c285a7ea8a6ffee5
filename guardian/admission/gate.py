"""The gate: ``admit_request`` hooks, run before a request is enqueued.

A request's path reads one way: HTTP handler -> admission -> the engine's
queue -> the loop -> the response. ``AdmittingGenerator`` is what stock's
handler calls its response generator: it runs the gate on the HTTP thread,
then hands the admitted request to the engine's ``generate()``, so a refusal
reaches the client before any byte (a stream's included). The prompt is
tokenized here, once, with stock's own code; the engine reuses the tokens.
The engine knows nothing of admission.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Optional

import structlog

from guardian import stock
from guardian.admission.facts import (
    LARGE_PROMPT_CHARS,
    Admission,
    ModelLimits,
    private_tokenizer,
    prompt_chars,
    served_model_config,
    vocab_size_of,
)
from guardian.request_context import (add_response_headers, at_request_end, bind_log_fields, current_request,
                                      request_ended)
from guardian.errors import AbortRequest, ClientGoneAbort, GuardianError, from_stock_exception
from guardian.plugin_manager import call_each, notify
from guardian.admission.unloaded_models import UnloadedModels
from guardian.admission.validation import RequestBounds, check_body
from guardian.config.tables import CoreSettings
from guardian.observability.logs import loggable_line

log = structlog.get_logger("guardian.gate")


def gave_up_waiting() -> None:
    """For a request waiting for a tokenizer (``TokenizerPool.borrow``): ends the wait once
    its client left (``ClientGoneAbort``) or its deadline passed (its 504)."""
    error = request_ended()
    if error is not None:
        raise AbortRequest(error)


class AdmittingGenerator:
    """Stock's response generator as its handler sees it: the gate, then the engine."""

    def __init__(self, gate: "AdmissionGate", engine):
        self.gate = gate
        self.engine = engine

    # What stock's handler reads of its response generator besides generate().
    @property
    def cli_args(self):
        return self.engine.cli_args

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    def generation_available(self) -> bool:
        return self.engine.generation_available()

    def error_for(self, exc: Exception) -> GuardianError:
        return self.engine.error_for(exc)

    def generate(self, request, generation_args, progress_callback=None):
        """Admit the request (or raise AbortRequest), then queue it on the engine."""
        engine = self.engine
        engine.check_available()
        # Until the engine queues it, the loop may wait a moment for it.
        with engine.arriving():
            if self.gate.model_access is not None:
                self.gate.model_access.name_served_model(generation_args)
            admission = self.gate.admit(request, generation_args, engine=engine.plugin_view)
            if admission is not None:
                request = admission.request  # a hook may have dropped messages
            try:
                ctx, tokens = engine.generate(request, generation_args, progress_callback)
            except BaseException:
                if admission is not None:
                    admission.refused = True
                    admission.finish()
                raise
        # However the HTTP thread's work on the request ends, nothing goes on
        # generating for it: a client that reset its connection fails stock's
        # first write (its stream headers) before the try/finally that would
        # stop the request.
        at_request_end(ctx.stop)
        if admission is not None:
            # Over once its tokens end, before the handler writes the answer's last
            # bytes: a client that sends its next request as soon as it has this
            # one's finds its place free ([access] client_max_concurrent = 1 is a
            # client sending one after another). And however the HTTP thread's
            # work ends (a client gone mid-stream): finish() runs its callbacks once.
            at_request_end(admission.finish)
            tokens = finish_after(tokens, admission)
        return ctx, tokens


class AdmissionGate:
    def __init__(self, model_provider, pm, *, model_access=None, live=None, door=None,
                 on_client_left: Optional[Callable[[], None]] = None):
        self.model_provider = model_provider
        self.pm = pm
        # Told of a client that left while an admit_request hook waited (for KV memory):
        # the engine counts it with the requests cancelled (it was in no count).
        self.on_client_left = on_client_left
        # The server's AccessPolicy (guardian.access): admit_request hooks get it
        # for its per-client limits. None: no door (a bench, a unit test).
        self.door = door
        # The live configuration (guardian.config.live): a request is admitted
        # under one version of it, pinned for the whole admission.
        self.live = live
        # The guard's context limit for the served model, for /v1/models; set
        # by the prompt_guard plugin at start-up (None: the model's config).
        self.served_context_length: Optional[int] = None
        # HTTP bodies longer than this get a 413 unread (None: no limit); set
        # by the prompt_guard plugin at start-up.
        self.max_body_bytes: Optional[int] = None
        self._limits: Optional[tuple] = None  # (model_key, ModelLimits)
        # Which models requests may name (None: any, as stock).
        self.model_access = model_access
        self._unloaded_models: Optional[UnloadedModels] = None  # made on first need

    def check_body(self, body: dict, *, chat: bool) -> Optional[GuardianError]:
        """The door's check of every field (guardian.admission.validation), against the model it names."""
        error = check_body(body, chat=chat, bounds=self.request_bounds(body))
        if error is not None:
            self._decided(error)
        return error

    def _decided(self, error: Optional[GuardianError]) -> None:
        """Tell the plugins a request was let in (None) or turned away."""
        notify(self.pm.hook.on_admission_decision, error=error)

    @property
    def cli_args(self):
        return self.model_provider.cli_args

    def warm_tokenizer(self) -> None:
        """Make the first private tokenizer copy now, not on the first request."""
        tokenizer = self.model_provider.tokenizer
        if tokenizer is None:
            return  # a load is under way: the first request makes the copy
        with private_tokenizer(tokenizer):
            pass

    def request_bounds(self, body: dict) -> RequestBounds:
        access = self.model_access
        provider = self.model_provider
        loaded_key = provider.model_key
        # Stock's model key for the body, computed once for both questions.
        requested_key = access.requested_key(body) if access is not None else loaded_key
        field_limits = self.field_limits()
        if requested_key is None or requested_key == loaded_key:
            # The loaded model (or model fields of the wrong type, refused anyway).
            limits = self.served_limits()
            return RequestBounds(limits.vocab_size if limits else None,
                                 accepts_images=getattr(provider, "processor", None) is not None,  # 0.31: none
                                 context_length=self.served_context_length, **field_limits)
        # Another model: what its config says, before its weights are loaded.
        return RequestBounds(vocab_size_of(requested_key[0]) if isinstance(requested_key[0], str) else None,
                             accepts_images=False,
                             disallowed_model_field=access.disallowed_field(requested_key) if access else None,
                             served_model=(access.listed_name or access.served_key[0]) if access else None,
                             **field_limits)

    def field_limits(self) -> dict:
        """[guardian] max_stop_sequences and max_stop_chars as they stand (0: None, no limit),
        and the least max_tokens stock serves."""
        core = self.live.config.core if self.live is not None else CoreSettings()
        return {"max_stop_sequences": core.max_stop_sequences or None, "max_stop_chars": core.max_stop_chars or None,
                "min_max_tokens": stock.contract.MIN_MAX_TOKENS}

    def admit(self, request, args, *, engine) -> Optional[Admission]:
        """Run the admit_request hooks; raise AbortRequest if one turns the request away.

        ``engine`` is only handed to the hooks (their ``engine`` argument).
        Returns None when the request names a model that is not loaded
        (stock loads it on the engine thread; its tokenizer does not exist yet).
        """
        with self.live.pinned() if self.live is not None else contextlib.nullcontext():
            return self._admit(request, args, engine=engine)

    def _admit(self, request, args, *, engine) -> Optional[Admission]:
        target = self._target_model(args)
        if target is None:
            log.info("admission_skipped", reason="model_not_local", model=loggable_line(str(args.model.model)))
            self._decided(None)
            return None
        model_key, tokenizer, limits = target
        info = current_request()
        admission = Admission(
            request,
            args,
            limits=limits,
            tokenize=functools.partial(self._tokenize, tokenizer, args=args),
            request_id=info.request_id,
            stream=info.stream,
            client=info.client,
            carried_tokens=len(stock.continuation.continued_tokens(args) or ()),
        )
        try:
            error = self._hooks_verdict(admission, engine)
            if error is None:
                # Tokenized here whether or not a hook asked: the engine reuses
                # the tokens, and it must never see a prompt it cannot run.
                error = self._check_prompt_tokens(admission)
        except GuardianError as e:  # tokenizing failed here (a template's error: the client's)
            error = e
        except BaseException as e:  # ClientGoneAbort: its client left while it waited (KV memory, a tokenizer)
            admission.refused = True
            admission.finish()  # what the hooks before it took (a client's place, its tokens) is given back
            if isinstance(e, ClientGoneAbort) and self.on_client_left is not None:
                self.on_client_left()
            raise
        if admission.tokenized is not None:
            admission.log_fields.setdefault("n_prompt_tokens", admission.n_prompt_tokens)
        bind_log_fields(**admission.log_fields)
        self._decided(error)
        if error is not None:
            admission.refused = True
            admission.finish()
            raise AbortRequest(error)
        stock.requests.attach_tokens(admission.request, model_key, admission.tokenized)
        add_response_headers(admission.response_headers)
        return admission

    def _target_model(self, args) -> Optional[tuple]:
        """(model key, tokenizer, ModelLimits) of the model the request goes to.

        The loaded model's own; for another (an allowed switch), or while a
        load is under way, what its files on disk say. None when it is not
        on this machine: stock would download it.
        """
        provider = self.model_provider
        loaded = stock.models.loaded_tokenizer(provider, args)
        if loaded is not None:
            model_key, tokenizer = loaded
            return model_key, tokenizer, self.model_limits(model_key)
        model_key = stock.models.requested_model_key(provider, args.model)
        if self._unloaded_models is None:
            self._unloaded_models = UnloadedModels(self.cli_args)
        unloaded = self._unloaded_models.get(model_key)
        return None if unloaded is None else (model_key, *unloaded)

    def _hooks_verdict(self, admission: Admission, engine) -> Optional[GuardianError]:
        """The admit_request hooks' answer, as pluggy's first-result call gives it (the first
        that is not None; one that raises ends it), each plugin's called on its own so that
        a bug is logged with its plugin's name: a 500 in OpenAI's shape."""
        for plugin, answer, error in call_each(self.pm.hook.admit_request, admission=admission, engine=engine,
                                               door=self.door):
            if isinstance(error, GuardianError):
                return error
            if error is not None:
                log.error("admission_failed", plugin=plugin, exc_info=error)
            elif answer is None:
                continue
            elif isinstance(answer, GuardianError):
                return answer
            else:  # the client got stock's 404 with an AttributeError's words
                log.error("admission_failed", plugin=plugin, returned_type=type(answer).__name__,
                          reason="an admit_request hook returned neither None nor a GuardianError")
            return GuardianError("The server failed to admit the request.", status=500, code="internal_error")
        return None

    def _check_prompt_tokens(self, admission: Admission) -> Optional[GuardianError]:
        """An empty prompt kills stock's step; a token id past the model's
        embeddings reads outside it (a tokenizer with more tokens than the model)."""
        try:
            tokens = admission.prompt_tokens
        except GuardianError as e:
            return e
        param = "messages" if admission.is_chat else "prompt"
        if not tokens:
            return GuardianError("The prompt is empty: it must have at least one token.", status=400,
                                 type="invalid_request_error", param=param, code="invalid_value")
        vocab_size = admission.limits.vocab_size
        try:
            ids_fit = min(tokens) >= 0 and (vocab_size is None or max(tokens) < vocab_size)
        except TypeError:  # not token ids at all (a template kwarg changed the output)
            ids_fit = False
        if not ids_fit:
            return GuardianError("The prompt has tokens this model cannot read.", status=400,
                                 type="invalid_request_error", param=param, code="invalid_value")
        return None

    def _tokenize(self, tokenizer, request, *, args) -> tuple:
        """Stock's tokenization of ``request``, on a private copy of the tokenizer (a large
        prompt kept off the last copy: ``TokenizerPool``)."""
        chars = prompt_chars(request)
        large = chars > LARGE_PROMPT_CHARS
        waited_since = time.monotonic()
        try:
            with private_tokenizer(tokenizer, large=large, gave_up=gave_up_waiting) as private:
                if large:  # seconds of a copy: worth a line (and a test's cue)
                    log.info("large_prompt_tokenizing", prompt_chars=chars,
                             waited_ms=round((time.monotonic() - waited_since) * 1000, 1))
                return stock.requests.tokenize_as_stock(self.model_provider, private, request, args)
        except Exception as e:
            # What stock would have put on the request's queue: its fault.
            raise from_stock_exception(e) from e

    def served_limits(self) -> Optional[ModelLimits]:
        """The loaded model's limits; None while no model is loaded: stock's ``_load``
        drops the served model before it reads one (a reload, a switch)."""
        provider = self.model_provider
        model_key, model = provider.model_key, provider.model
        if model_key is None or model is None:
            return None
        return self.model_limits(model_key, model)

    def model_limits(self, model_key, model=None) -> ModelLimits:
        """Context length and KV cache sizes of the loaded model, read once per model."""
        if self._limits is None or self._limits[0] != model_key:
            cli = self.cli_args
            model = model if model is not None else self.model_provider.model
            limits = ModelLimits.of(
                model,
                served_model_config(model_key[0], model),
                kv_bits=getattr(cli, "kv_bits", None),  # 0.31 has no --kv-bits
                kv_group_size=getattr(cli, "kv_group_size", 64),
                quantized_kv_start=getattr(cli, "quantized_kv_start", 0),
            )
            self._limits = (model_key, limits)
        return self._limits[1]


def finish_after(tokens, admission):
    """Stock's token iterator, ending the admission with it."""
    try:
        yield from tokens
    finally:
        admission.finish()

"""A request's sampler and logits processors, made to fail that request alone."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx_lm.sample_utils as sample_utils
import mlx_lm.server as server

from guardian.stock.contract import STOCK_MAKE_LOGITS_PROCESSORS, STOCK_MAKE_SAMPLER, STOCK_VERSION


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


# Pins a failure on the request with these GenerationArguments: (args,
# exception, where) -> whether it could (else the exception is the engine's).
PinOnRequest = Callable[[object, BaseException, str], bool]


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

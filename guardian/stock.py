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
import contextlib
import importlib.metadata
from typing import Callable, Iterator

import mlx_lm.server as server

from guardian.errors import EngineStepError

STOCK_VERSION = importlib.metadata.version("mlx-lm")
TESTED_VERSIONS = ("0.31.3", "0.32.2")

# (object, attribute) pairs the guardian relies on, with why. The contract
# test walks this table; so does ``check_stock()`` at start-up.
REQUIRED = {
    "ResponseGenerator._generate": "the generation loop the engine supervises",
    "ResponseGenerator._tokenize": "tokenize once on the HTTP thread, as stock does",
    "ResponseGenerator.generate": "the HTTP thread's side of a request",
    "ResponseGenerator.stop_and_join": "clean shutdown of the generation thread",
    "ModelProvider.load_default": "load the --model weights before serving",
    "ModelProvider.load": "load a model the way stock does",
    "APIHandler.handle_completion": "wrapped to answer engine faults properly",
    "APIHandler.do_GET": "extended with /health, /livez, /readyz, /guardian/status",
    "GenerationContext.stop": "client-gone signal, linked across a re-run",
    "Response": "a token on a request's response queue",
    "BatchGenerator": "module global the loop instantiates; subclassed",
    "stream_generate": "module global the non-batched path calls; wrapped",
    "run": "module global main() calls; replaced by the guardian's",
    "main": "parses every stock flag with stock's own parser",
    "get_system_fingerprint": "the handler's system_fingerprint",
    "APIHandler._set_completion_headers": "status line with stock's CORS headers",
    "LRUPromptCache": "the prompt cache the engine owns",
}

class StockChanged(RuntimeError):
    """The installed mlx-lm no longer has a name the guardian embeds."""


def missing_names() -> list[str]:
    """Names from REQUIRED that the installed mlx_lm.server lacks."""
    missing = []
    for dotted in REQUIRED:
        obj = server
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(dotted)
                break
    return missing


def check_stock() -> None:
    """Raise StockChanged naming every seam the installed mlx-lm moved."""
    missing = missing_names()
    if missing:
        raise StockChanged(
            f"mlx-lm {STOCK_VERSION} lacks mlx_lm.server."
            + ", mlx_lm.server.".join(missing)
            + f"; mlx-guardian is tested with mlx-lm {', '.join(TESTED_VERSIONS)}"
        )


check_stock()

# The originals, kept before anything swaps the module globals.
STOCK_BATCH_GENERATOR = server.BatchGenerator
STOCK_STREAM_GENERATE = server.stream_generate

ResponseGenerator = server.ResponseGenerator
ModelProvider = server.ModelProvider
APIHandler = server.APIHandler
GenerationContext = server.GenerationContext
Response = server.Response
LRUPromptCache = server.LRUPromptCache
get_system_fingerprint = server.get_system_fingerprint


class SupervisableResponseGenerator(ResponseGenerator):
    """Stock ResponseGenerator whose thread runs ``supervise(stock_loop)``.

    0.31 starts ``Thread(target=self._generate)``, 0.32 ``_run_generate``
    which calls ``self._generate()``: overriding ``_generate`` reaches both.
    """

    def _generate(self):
        self.supervise(super()._generate)

    def supervise(self, run_stock_loop: Callable[[], None]) -> None:
        raise NotImplementedError

    def tokenize(self, tokenizer, request, args) -> list[int]:
        """The prompt tokens stock would compute for this request."""
        return self._tokenize(tokenizer, request, args)[0]


def stop_generation_thread(response_generator) -> None:
    """Ask the stock loop to leave at its next turn, without joining it."""
    response_generator._stop = True


def reset_model_provider(model_provider) -> None:
    """Make the next ``load()`` read the weights again (0.31 has no reset())."""
    model_provider.model_key = None


def step_observed(stock_class, observe: Callable[[], None]):
    """A subclass of stock BatchGenerator calling ``observe()`` before each step."""

    class ObservedBatchGenerator(stock_class):
        def next(self):
            observe()
            return super().next()

    ObservedBatchGenerator.__name__ = f"Observed{stock_class.__name__}"
    return ObservedBatchGenerator


def stream_observed(stock_stream_generate, observe: Callable[[], None]):
    """Stock stream_generate calling ``observe()`` before each token."""

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
            yield item

    return observed_stream_generate


@contextlib.contextmanager
def observed_engine_steps(observe: Callable[[], None]):
    """Route every engine step of the stock loop through ``observe()``.

    The loop looks ``BatchGenerator`` and ``stream_generate`` up in the
    server module's globals at call time, so swapping those globals is how
    a step can be observed without touching the loop's code.
    """
    saved = server.BatchGenerator, server.stream_generate
    server.BatchGenerator = step_observed(STOCK_BATCH_GENERATOR, observe)
    server.stream_generate = stream_observed(STOCK_STREAM_GENERATE, observe)
    try:
        yield
    finally:
        server.BatchGenerator, server.stream_generate = saved


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


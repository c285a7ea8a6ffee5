"""The seams into stock mlx_lm, named and checked at import.

mlx-guardian embeds stock ``mlx_lm.server`` instead of copying it. Embedding
needs a few seams that mlx_lm does not publish: the generation loop method,
module globals the loop looks up at call time, the flag parser built inside
``main()``. Every such seam is named here (``REQUIRED``), checked at import,
and covered by ``tests/test_stock_contract.py``, so an mlx-lm release that
moves one fails loudly with the name instead of misbehaving quietly; the
other modules of guardian.stock use them. Stock's originals of what the
guardian swaps are kept here before anything swaps them.
"""

from __future__ import annotations

import threading
import importlib
import importlib.metadata

from guardian.stock.import_guard import never_lowered

# mlx_lm.utils sets the open-files limit to (2048, 4096) when imported, hard
# limit included: a server could then never hold more connections than that.
with never_lowered():
    import mlx_lm.server as server
    from mlx_lm.tokenizer_utils import TokenizerWrapper


# The module, not the function mlx_lm's package exports under the same name.
generate_module = importlib.import_module("mlx_lm.generate")

STOCK_VERSION = importlib.metadata.version("mlx-lm")
TESTED_VERSIONS = ("0.31.3", "0.32.2")
# The least max_tokens stock's handler takes (its validate_model_parameters): 0 until
# 0.32, 1 since. The door says so first, naming the field the client sent (stock names
# max_tokens for a max_completion_tokens of 0, with no param).
MIN_MAX_TOKENS = 0 if tuple(int(p) for p in STOCK_VERSION.split(".")[:2] if p.isdigit()) < (0, 32) else 1

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
    "ModelProvider.load_default": "load the --model weights before serving; a stock child whose thread "
                                  "dies in it could not load them (guardian.supervise.stock_child)",
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


STOCK_DETOKENIZER = TokenizerWrapper.detokenizer


# The seams below are module globals of mlx_lm.server, one set for the whole
# process, while a process may run several engines (stock allows several
# ResponseGenerators, and its own server tests make two). So they are
# swapped once, and each call is routed to the engine whose loop runs on the
# calling thread: each engine's loop thread says which one it is.
loop_thread = threading.local()

"""Models as stock loads and lists them: the key a request names, loads guarded against an abandoned
loop.
"""

from __future__ import annotations

import copy
import io
import json
from typing import Callable

import mlx_lm.server as server
from huggingface_hub.utils import CacheNotFound

from guardian import long_lived
from guardian.stock.contract import ModelProvider, STOCK_SCAN_CACHE_DIR


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
    safe, and let the caller send the result. Run as for ``/v1/models``: stock
    filters by what follows it in the path, and ``/v1/models/`` listed none.
    """
    server.scan_cache_dir = _scan_cache_dir_or_empty
    wfile, handler.wfile = handler.wfile, io.BytesIO()
    path, handler.path = handler.path, "/v1/models"
    log_request = handler.log_request
    handler.log_request = lambda *args: None  # the caller's response is logged
    try:
        handler.handle_models_request()
        written = handler.wfile.getvalue()
    finally:
        handler.wfile = wfile
        handler.path = path
        handler.log_request = log_request
    return json.loads(written.partition(b"\r\n\r\n")[2])


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
        # The model about to go was frozen at start (guardian.long_lived): thawed, a cycle
        # in it is collected. Every path that drops it comes here: a reload (the ladder's,
        # a failure's) and a switch to another model.
        long_lived.thaw()
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

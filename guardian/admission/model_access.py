"""Which models a request may name, and the served model kept when a switch fails.

Stock loads whatever a request names in ``model``, ``draft_model`` or
``adapters``: any local path or hub id, on the generation thread, after
dropping the served model. A client can run the machine out of memory that
way (the incident's own class of failure), and when the load fails stock is
left with no model at all: the next request skips the prompt guard, since
there is no tokenizer to count with. By default a request may name only
what the server was started with; ``[guardian] allowed_models`` adds more,
and ``allow_any_model = true`` restores stock's behaviour.

Stock's own /v1/models lists a local ``--model`` by its resolved path, which
is not the name it was started with: a client that names the model it was
listed is given the served model, without the reload stock would make of it
(``listed_name``), and the listing shows only models a request may name.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import structlog

from guardian import stock
from guardian.observability.logs import loggable_line

log = structlog.get_logger("guardian.model_access")

# The request fields that name something to load, in the order of stock's
# model key (model path, adapter path, draft model path).
MODEL_FIELDS = ("model", "adapters", "draft_model")


class ModelAccess:
    def __init__(self, model_provider, *, allowed_models: list, allow_any_model: bool):
        self.model_provider = model_provider
        # The key load_default() gave: what "default_model" and the served paths map to.
        self.served_key = stock.models.requested_model_key(model_provider, describe({}))
        self.allowed = frozenset(allowed_models)
        self.allow_any_model = allow_any_model
        self.listed_name = listed_name(model_provider.cli_args.model)

    def as_served(self, model):
        """The served model's listed name read as the name it was started with (so stock loads
        nothing more, and an adapter named beside it is still a switch); others as they are."""
        return self.served_key[0] if model is not None and model == self.listed_name else model

    def name_served_model(self, args) -> None:
        """Make stock's request arguments name the served model as it was started where they
        name it as the listing does; the answer still echoes the body's name."""
        args.model.model = self.as_served(args.model.model)

    def may_name(self, model: str) -> bool:
        """Whether a request may name ``model`` (an id of stock's /v1/models)."""
        return (self.allow_any_model or model in self.allowed
                or model in (self.served_key[0], self.listed_name))

    def requested_key(self, body: dict) -> Optional[tuple]:
        """The (model, adapter, draft) key stock would load for this body; None
        while a model field is not a string (validation names it)."""
        description = describe(body)
        description.model = self.as_served(description.model)
        names = (description.model, description.adapter, description.draft)
        if not all(name is None or isinstance(name, str) for name in names):
            return None
        return stock.models.requested_model_key(self.model_provider, description)

    def disallowed_field(self, key: tuple) -> Optional[str]:
        """The field naming a model this server does not serve, in ``key``'s order; or None."""
        if self.allow_any_model:
            return None
        for field, requested, served in zip(MODEL_FIELDS, key, self.served_key):
            # No adapter or draft model is always allowed: it loads nothing more.
            if requested not in (served, None) and requested not in self.allowed:
                return field
        return None

    def keep_served_model(self) -> None:
        """Make a failed switch to another model load the served model back.

        Stock drops the loaded model before it loads the next one, so a
        failed load would leave the server with nothing to serve and no
        tokenizer to admit requests with.
        """
        provider = self.model_provider
        stock_load = provider.load

        def load(model_path, adapter_path=None, draft_model_path=None):
            try:
                return stock_load(model_path, adapter_path, draft_model_path)
            except Exception as e:
                log.warning("model_switch_failed", model=loggable_line(str(model_path)), error_type=type(e).__name__,
                            error_message=loggable_line(str(e)))
                if provider.model_key != self.served_key:
                    stock_load("default_model", None, "default_model")
                    log.info("served_model_reloaded", model=self.served_key[0])
                raise

        provider.load = load


def listed_name(model: Optional[str]) -> Optional[str]:
    """The id stock's /v1/models gives a local model path (resolved); None for a hub id."""
    if not model or not Path(model).exists():
        return None
    return str(Path(model).resolve())


def describe(body: dict) -> SimpleNamespace:
    """The model fields of a body as stock's ModelDescription has them."""
    return SimpleNamespace(model=body.get("model", "default_model"),
                           adapter=body.get("adapters"),
                           draft=body.get("draft_model", "default_model"))

"""The engine: stock's generation loop, guarded, and the one lifecycle it moves through.

``generator``: the engine (stock's ResponseGenerator, its loop guarded); its
collaborators ``failures`` (what follows a failure), ``memory`` (the prompt
cache, a failed batch's KV, trims) and ``probes``; ``lifecycle``: every state
change; ``ledger``: the queue and each request's record; ``blame``: who is
blamed after a failure; ``restart``: freeing the dead loop, the backoff;
``kept_kv``: the KV kept for re-runs.
"""

"""The prompt guard's settings ([prompt_guard]), apart from the guard itself
(guardian.plugins.prompt_guard): the supervisor reads ``max_body_bytes`` too, and
imports no mlx.
"""

from __future__ import annotations

from guardian.config.registry import Bool, Float, Int, OneOf, Setting, Table

MiB = 1024 * 1024


class PromptGuardSettings(Table, name="prompt_guard"):
    enabled = Setting(Bool(), True, """
        Count every request's prompt tokens exactly, on the HTTP thread, before
        anything reaches the engine (stock's own tokenization, reused by the
        engine), and turn away what cannot fit with a 4xx the client can act on.""", live=True)
    max_context_tokens = Setting(Int(min=0), 0, """
        Longest prompt plus completion, in tokens. 0: the model's own context
        length from its config.json (max_position_embeddings or the architecture's
        equivalent); when there is none, the start-up log says so
        (context_length_unknown) and only max_prompt_tokens is checked.
        /v1/models reports this as the served model's context_length.""", live=True)
    max_prompt_tokens = Setting(Int(min=0), 0, """
        Longest prompt alone, in tokens. 0: no limit beyond the context. A prompt
        over either limit gets 400 context_length_exceeded.""", live=True)
    on_overflow = Setting(OneOf("clamp", "reject"), "clamp", """
        When prompt + max_tokens exceeds the context: "clamp" lowers max_tokens to
        what fits and says so in the X-Guardian-Clamped-Max-Tokens header;
        "reject" answers 400 context_length_exceeded.""", live=True)
    truncate_messages = Setting(Bool(), False, """
        Drop the oldest non-system messages, whole turns at a time, until the
        prompt fits; never the last user message. The X-Guardian-Truncated-Messages
        header says how many were dropped. For agent clients that fall back to a
        smaller-context server.""", live=True)
    kv_budget_bytes = Setting(Int(min=0), 0, """
        Bytes of KV cache the admitted, unfinished requests may hold together,
        estimated from the model config (layers, KV heads, head dim, dtype,
        --kv-bits, sliding-window layers), as stock's decode batch holds them:
        as many as decode at once, each at the largest one's length (its cache
        pads every sequence to the longest). One request over it gets 400
        kv_cache_budget_exceeded. 0: the device memory mlx reports, minus the
        weights, less kv_budget_margin.""", live=True)
    kv_budget_margin = Setting(Float(min=0.0, max=0.95), 0.25, """
        Fraction of (device memory - weights) kept out of the default budget for
        activations, the prompt cache and everything else.""", live=True)
    memory_cap_hold_s = Setting(Float(min=0.0), 60.0, """
        After the engine ran out of device memory the KV budget is capped at what
        the device could give; where mlx cannot measure free memory (Metal, the
        CPU) the cap is lifted once this many seconds pass without another memory
        failure. A request over the cap but within the budget runs alone until
        then: it waits its turn (max_queue_wait_s) for nothing else to hold KV.
        (Where free memory is measured, it gets 503 memory_shortage with
        Retry-After until the device has the memory.)""", live=True)
    max_queued = Setting(Int(min=0), 16, """
        Requests that arrive while the budget is full wait first come, first
        served: at most max_queued of them, each at most max_queue_wait_s; then
        429 kv_cache_budget_busy with Retry-After: retry_after_s. One whose
        deadline passes meanwhile gets its 504, and one whose client leaves gives
        its place up, within 0.1 s.""", live=True)
    max_queue_wait_s = Setting(Float(min=0.0), 30.0, """
        How long a request may wait for KV cache budget before its 429.""", live=True)
    retry_after_s = Setting(Float(min=0.0), 2.0, """
        The Retry-After of this guard's 429 kv_cache_budget_busy, and of its 503
        memory_shortage while the device is short of memory.""", live=True)
    max_body_bytes = Setting(Int(min=0), 32 * MiB, """
        Request bodies over this many bytes get 413 request_too_large, answered
        from the Content-Length header without reading the body. 0: no limit.""", live=True)

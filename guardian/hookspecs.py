"""Every hook mlx-guardian calls, and the markers plugins use.

Hooks are called with keyword arguments; an implementation may accept any
subset of them, so arguments can be added later without breaking plugins.
Each implementation is called on its own, and what it raises is contained
to it, logged with its plugin's name (``plugin_hook_failed``; ``admission_failed``
and ``access_check_failed`` for the two that refuse): an observer's
(no return value) is passed over, and each deciding hook says below what
its exception means (a probe's is a failed result, a resource sample's is
left out, a recovery decision's is passed over for the built-in's, an
``admit_request`` or ``check_access`` exception refuses the request with a
500). One hook is not contained: ``on_engine_step`` runs inside the
engine's step, and what it raises is an engine failure at that step.

Wherever a hook takes ``engine``, it is an ``EngineView``
(guardian/engine_view.py): the engine's status, the served model's
limits, probes, and memory set aside, and nothing else. The engine's own
objects stay behind it, so they can change without breaking plugins.
"""

import pluggy

PROJECT_NAME = "mlx_guardian"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- lifecycle ---------------------------------------------------------------
@hookspec
def guardian_startup(engine, config):
    """The model is loaded and the engine is about to serve.

    Main thread, once. ``engine`` is the EngineView, ``config`` the
    parsed GuardianConfig. Return value ignored.
    """


@hookspec
def guardian_shutdown(engine, exit_code):
    """The server is stopping; ``exit_code`` is what the process will return.

    Main thread, once. Return value ignored.
    """


# -- the door ---------------------------------------------------------------------
@hookspec(firstresult=True)
def check_access(request, door):
    """Decide who sent a request, and whether it may come in.

    Once for every request on every path, before it is routed and before its
    body is read: on the connection layer's reader thread, from the head, when
    the body is still to come (so a refused client's body is never held: keep
    this quick, it holds every connection's reads meanwhile); else on the HTTP
    thread serving it. ``request`` is a
    ``guardian.access.policy.AccessRequest`` (method, path, headers, the
    client's address); ``door`` is the server's
    ``guardian.access.policy.AccessPolicy`` (its keys, mode and origins; the
    built-in ``access`` plugin returns ``door.check(request)``).

    Return an ``AccessDecision``: its ``client`` (an API key's name, or an
    address) names the client in logs, per-client limits and fair admission;
    with an ``error``, the request is answered with it. None: no opinion.
    Stops at first non-None result; the built-in answers last (trylast), so
    a plugin of yours decides first. In a child of ``--supervise`` the relay
    key decides before any plugin: a request the supervisor did not send is
    refused, and the supervisor's own checks are let in; a client's request
    it relayed comes to the plugins (without the client's API key, which stops
    at the supervisor's port, and without the supervisor's relay key). A hook
    that raises, or returns anything else than an AccessDecision or None,
    refuses the request (500; ``access_check_failed`` names the plugin): the
    door never opens on a plugin's bug. To refuse with your own status,
    return ``AccessDecision(client, GuardianError(...))``.
    ``request.headers`` are the request's as sent: an API key in them is the
    client's, in clear.
    """


@hookspec
def on_access_decision(request, decision):
    """The door decided on a request (``check_access``): let in, or refused.

    The HTTP thread serving it, every request on every path. ``decision`` is
    the AccessDecision (``decision.error`` is what a refused client gets;
    ``decision.key_name`` which API key let it in, if any; the decision never
    holds the key, though ``request.headers`` do, as sent). Return value ignored.
    """


# -- admission -------------------------------------------------------------------
@hookspec(firstresult=True)
def admit_request(admission, engine, door):
    """Let a completion request in, adjust it, or turn it away.

    The HTTP thread serving the request, after stock parsed it and before
    anything is enqueued, so a refusal reaches the client before any byte
    (a stream's included). For a request naming another model (a switch
    the configuration allows), ``limits`` and the tokenizer come from that
    model's files on disk, before its weights load; not called when the
    model is not on this machine (stock would download it).

    ``admission`` is a ``guardian.admission.facts.Admission``: the request and its
    GenerationArguments, ``prompt_tokens`` (tokenized on first use with
    stock's own code; the engine reuses them, so a request is tokenized
    once), ``limits`` (the model's context length and KV cache sizes). An
    implementation may adjust it: lower ``admission.args.max_tokens``,
    ``adopt()`` a variant with fewer messages, add ``response_headers`` and
    ``log_fields``, or hold a resource and give it back through
    ``on_finish()``, which runs when the request ends or is turned away.
    ``admission.client`` names who sent it (``check_access``); ``door`` is
    the server's AccessPolicy, whose ``limits`` are the per-client limits.

    Return a ``GuardianError`` (or raise one) to turn the request away with
    its status and OpenAI-shaped body; None lets it in. Stops at first
    non-None result.
    """


@hookspec
def on_admission_decision(error):
    """A completion request was let in (``error`` None) or turned away at the door.

    The HTTP thread serving it. ``error`` is the GuardianError its client
    receives: a field the validation refused, an ``admit_request`` hook's
    refusal (context length, KV budget, quarantine), or a prompt the model
    cannot read. Bodies refused before their fields are read (413, JSON
    that does not parse) are not reported. Return value ignored.
    """


# -- engine --------------------------------------------------------------------
@hookspec
def on_engine_step(step, engine):
    """Called before every engine step: a BatchGenerator step or a token of
    the non-batched path.

    Generation thread, on the hot path: keep it cheap; a plugin object with
    ``active = False`` (read once at start) is not called. ``step`` counts steps
    since the process started. An exception raised here is an engine failure
    at that step (this is how the fault-injection plugin works). Return value
    ignored.
    """


@hookspec(firstresult=True)
def classify_engine_error(error):
    """Name the kind of an exception that killed the stock loop.

    Generation thread. Return a snake_case string such as
    ``metal_resource_limit``, ``out_of_memory`` or ``unknown``; None means
    no opinion. Stops at first non-None result; one that raises or returns
    something else than a non-empty string is logged and passed over.
    """


@hookspec(firstresult=True)
def on_engine_error(error, classification, failures_in_window, engine):
    """Decide what to do after the stock loop raised.

    Generation thread, after ``engine_error`` is logged and before any
    request is answered. ``failures_in_window`` counts failures without
    progress (no token generated, no request completed since the previous
    failure), this one included if it is one, within the recovery plugin's
    window, less those forgiven because a request was blamed for them (see
    ``guardian.engine.blame``). Return ``"restart"`` (a
    fresh loop on the loaded weights), ``"reload"`` (read the weights again,
    then restart) or ``"exit"`` (answer every request and exit the process
    with EXIT_ENGINE_FAILED). Stops at first non-None result; the built-in
    ``recovery`` plugin always answers. An implementation that raises or
    returns anything else than those three (or None) is logged
    (``plugin_hook_failed``, ``plugin_hook_answer_invalid``, naming the plugin)
    and passed over: the next one decides.
    """


@hookspec
def on_engine_restarted(duration_s, classification, restarts):
    """A restarted loop is polling for work again.

    The new generation thread; after a stall, the probe thread that proved the
    replacement, whichever saw it first. ``duration_s`` runs from the failure to now;
    ``restarts`` counts restarts since start. Return value ignored.
    """


@hookspec
def on_request_failed(request_id, error, engine):
    """A user's request the engine had queued ended with a GuardianError instead
    of a completion: a failure, its deadline, a refusal as the engine stopped
    (refusals at the door and probes are not reported here).

    Any thread. ``error`` is the GuardianError the client receives.
    Return value ignored.
    """


@hookspec
def on_request_finished(request_id, outcome, prompt_tokens, cached_prompt_tokens, generated_tokens,
                        time_to_first_token_s, time_between_tokens_s, queue_time_s, engine):
    """A user's request the engine had queued ended; probes are not reported.

    A thread of its own (``request-reports``), after the request ended (on the
    generation thread, or an HTTP thread when the client left or an error
    answered it), in the order requests ended. ``outcome`` is
    ``"completed"`` (it had its last token), ``"failed"`` (answered with an
    error; ``on_request_failed``, told first, says which) or ``"cancelled"`` (its client
    left). ``prompt_tokens``: the prompt's length as the engine first ran it
    (0 if it never started), ``cached_prompt_tokens`` of them taken from the
    prompt cache. ``generated_tokens``: tokens the engine generated for it,
    those of a run a failure discarded included. ``time_to_first_token_s``:
    from when the handler took the request (admission and queueing
    included) to its first token; None without one.
    ``time_between_tokens_s``: the gaps between its tokens, in order (a
    restart's included). ``queue_time_s``: from when the engine queued it
    (let in at the door) to when stock's loop first took it; None if
    it never did. A plugin object with ``active = False`` (read once
    at start) is not called. A slow one delays the reports after it, not the
    engine. Return value ignored.
    """


# -- watchdog ------------------------------------------------------------------
@hookspec
def probe(engine, timeout_s):
    """Run a synthetic check of the engine and report how it went.

    A probe thread of the watchdog (periodic, while the engine is idle) or an
    HTTP thread (``GET /readyz?deep=1``). ``timeout_s`` is the deadline the
    probe must keep. Return a dict ``{"name": str, "ok": bool, "duration_ms":
    float, "error": str | None}`` plus any fields of your own; None means this
    plugin has no probe. Every plugin's result is collected. A probe that
    raises, or returns anything but a dict with a bool ``ok``, is a failed
    result named after its plugin (``plugin_hook_failed``). Each runs on a
    thread of its own: one still running a second past ``timeout_s`` is a
    failed result (``probe_overran``) and is left to finish, and until it
    does, that plugin's later probes fail at once without being called.
    """


@hookspec
def on_probe_result(results, engine):
    """A round of probes finished; ``results`` is the list of their dicts.

    The thread that ran the probes. Return value ignored.
    """


@hookspec
def on_stall(engine, heartbeat_age_s, action):
    """Work was waiting and the engine made no progress for too long.

    Watchdog thread, before the action is taken. ``action`` is the ladder's
    rung: ``"restart"`` (abandon the stuck loop thread, start a fresh one on
    the loaded weights), ``"reload"`` (the same after reading the weights
    again) or ``"exit"`` (answer everything, exit with EXIT_ENGINE_STALLED).
    Return value ignored.
    """


@hookspec
def on_process_paused(engine, paused_s):
    """The whole process did not run for ``paused_s`` seconds (SIGSTOP, a
    debugger, swapping, a frozen cgroup or VM): the watchdog's look came that
    much late. No engine is blamed for the time; its heartbeat's clock restarts.

    Watchdog thread, after the pause. Return value ignored.
    """


@hookspec
def sample_resources(engine):
    """Contribute gauges to a resource sample.

    Watchdog thread, every ``resource_interval_s``. Return a flat dict of
    numbers (for example ``{"active_memory_bytes": ...}``); None contributes
    nothing. Every plugin's dict is merged into one sample. One that raises,
    or returns something else, is left out of the sample (``plugin_hook_failed``,
    logged once until it works again); the others' gauges are kept. A gauge
    that is not a number (or None: unknown now), or whose name a plugin called
    before named (the built-ins come first), is left out the same way.
    """


@hookspec
def on_resource_sample(sample, engine):
    """A resource sample was taken; a plugin may act on it.

    Watchdog thread. ``sample`` is the merged dict. Return value ignored.
    """


# -- configuration -----------------------------------------------------------------
@hookspec
def on_config_reloaded(engine, changed):
    """A new version of the ``--guardian-config`` file is in force.

    The thread that reloaded it (the file watcher, or SIGHUP's), between
    requests. ``changed`` lists the live settings it changed, as
    ``"table.key"``. A plugin reads its settings through ``self.settings`` at
    each use, so the new values apply by themselves; one that derived state
    from them at start (a budget, a limit set on the engine) derives it again
    here. Return value ignored.
    """

"""Every hook mlx-guardian calls, and the markers plugins use.

Hooks are called with keyword arguments; an implementation may accept any
subset of them, so arguments can be added later without breaking plugins.
An exception raised by an observer hook (``on_*`` without a return value)
is logged and contained; one raised by a deciding hook propagates.
"""

import pluggy

PROJECT_NAME = "mlx_guardian"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -- lifecycle ---------------------------------------------------------------
@hookspec
def guardian_startup(engine, config):
    """The model is loaded and the engine is about to serve.

    Main thread, once. ``engine`` is the GuardianEngine, ``config`` the
    parsed GuardianConfig. Return value ignored.
    """


@hookspec
def guardian_shutdown(engine, exit_code):
    """The server is stopping; ``exit_code`` is what the process will return.

    Main thread, once. Return value ignored.
    """


# -- engine --------------------------------------------------------------------
@hookspec
def on_engine_step(step, engine):
    """Called before every engine step: a BatchGenerator step or a token of
    the non-batched path.

    Generation thread, on the hot path: keep it cheap. ``step`` counts steps
    since the process started. An exception raised here is an engine failure
    at that step (this is how the fault-injection plugin works). Return value
    ignored.
    """


@hookspec(firstresult=True)
def classify_engine_error(error):
    """Name the kind of an exception that killed the stock loop.

    Generation thread. Return a snake_case string such as
    ``metal_resource_limit``, ``out_of_memory`` or ``unknown``; None means
    no opinion. Stops at first non-None result.
    """


@hookspec(firstresult=True)
def on_engine_error(error, classification, failures_in_window, engine):
    """Decide what to do after the stock loop raised.

    Generation thread, after ``engine_error`` is logged and before any
    request is answered. ``failures_in_window`` counts failures, this one
    included, within the recovery plugin's window. Return ``"restart"`` (a
    fresh loop on the loaded weights), ``"reload"`` (read the weights again,
    then restart) or ``"exit"`` (answer every request and exit the process
    with EXIT_ENGINE_FAILED). Stops at first non-None result; the built-in
    ``recovery`` plugin always answers.
    """


@hookspec
def on_engine_restarted(duration_s, classification, restarts):
    """A restarted loop is polling for work again.

    Generation thread. ``duration_s`` runs from the failure to now;
    ``restarts`` counts restarts since start. Return value ignored.
    """


@hookspec
def on_request_failed(request_id, error, engine):
    """A request ended with a GuardianError instead of a completion.

    Any thread. ``error`` is the GuardianError the client receives.
    Return value ignored.
    """

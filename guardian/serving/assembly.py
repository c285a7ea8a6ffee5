"""Serve: load the model, start the engine and the HTTP server, exit cleanly.

The main thread only waits. Signal handlers and the engine ask for an exit
through ``ExitRequest``; the main thread then drains requests in flight,
stops the HTTP server and the engine, and returns the exit code.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional, Union

import structlog

from guardian import stock
from guardian.access import announce, make_door
from guardian.access.policy import AccessDecision
from guardian.access.tls import ServerCertificate, load_certificate
from guardian.config.tables import AccessSettings
from guardian.config.registry import ConfigError
from guardian.config.loading import GuardianConfig
from guardian.serving.connection import HeldConnections, check_can_listen
from guardian.serving.exit_request import ExitRequest
from guardian.serving.limits import HANDLER_HEADROOM, LiveLimits
from guardian.observability import metrics
from guardian.observability.counting import ActiveCount
from guardian.admission.facts import served_model_config
from guardian.admission.gate import AdmissionGate, AdmittingGenerator
from guardian.engine.generator import GuardianEngine
from guardian.errors import SERVER_STOPPING, AbortRequest, GuardianError
from guardian.exit_codes import EXIT_BOOT_ERROR, EXIT_OK, EXIT_UNCAUGHT, EXIT_USAGE
from guardian.serving.handler import GuardianHandler, decide_access
from guardian.config.live import LiveConfig
from guardian.admission.model_access import ModelAccess
from guardian.admission.startup_checks import impossible_flags
from guardian.health.parent_watch import die_with_parent, supervisor_pid
from guardian.health.stall_detection import StallDetector
from guardian.health.thread_stack import stack_of
from guardian.engine_view import EngineView
from guardian.plugin_manager import notify
from guardian import handoff, long_lived
from guardian.relay_protocol import HEADER_BYTES_ADDED_FOR_CHILD, HEADERS_ADDED_FOR_CHILD, started_by_supervisor

log = structlog.get_logger("guardian.server")


def which_model_failed(cli_args) -> tuple[str, Optional[str]]:
    """("model", --model), or the adapter or draft model when that one is a path that is not
    there while the model's is (a missing draft model was said as the model's failure)."""
    model = cli_args.model
    if model and Path(model).expanduser().is_dir():
        for what, flag in (("adapter", "adapter_path"), ("draft model", "draft_model")):
            name = getattr(cli_args, flag, None)
            if name and (os.sep in name or name.startswith((".", "~"))) and not Path(name).expanduser().exists():
                return what, name
    return "model", model


def why_no_model(model: Optional[str], error: Exception) -> str:
    """Why ``--model`` could not load, in a few words: a path that is not a model folder
    said as such (stock's loader took it for a hub id: "Repo id must be in the form...")."""
    if model and (os.sep in model or model.startswith((".", "~"))):
        path = Path(model).expanduser()
        if not path.exists():
            return "no such folder (give a folder holding config.json and the weights, or a Hugging Face id)"
        if not path.is_dir():
            return "it is a file; give the folder holding config.json and the weights"
    return f"{type(error).__name__}: {error}"


# After the drain, how long the requests still in flight get to write their 503 or error event.
ANSWER_REST_S = 1.0


def cannot_listen(host: str, port: int, error: OSError) -> int:
    """The port taken, a host with no such address: nothing will ever serve. Exit 2."""
    log.critical("http_bind_failed", host=host, port=port, error_message=str(error))
    print(f"mlx-guardian: cannot listen on {host}:{port}: {error}", file=sys.stderr)
    return EXIT_USAGE


def serve(host: str, port: int, model_provider, config: Union[GuardianConfig, LiveConfig], pm,
          group=None) -> int:
    """Serve until asked to exit; the exit code. ``group``: this process is
    rank 0 of an mlx.launch group (guardian.distributed)."""
    live = config if isinstance(config, LiveConfig) else LiveConfig(config)
    exit_request = ExitRequest()
    member = None
    if group is not None:
        # Under mlx.launch: every rank joins before the model loads (together).
        from guardian.distributed.member import GroupMember

        member = GroupMember(group, live.config.watchdog.peer_timeout_s, exit_request,
                             live.config.watchdog.join_timeout_s)
        member.join(pm)
    try:  # before the model loads: a certificate that does not load is a usage error
        # A supervised child serves only its supervisor, in plain HTTP on loopback:
        # the supervisor's public port terminates TLS (the file's [access] is its).
        tls = None if started_by_supervisor() else load_certificate(live.config.access)
    except ConfigError as e:
        log.critical("config_invalid", error_message=str(e))
        print(f"mlx-guardian: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:  # and the port, which a supervised child is given bound
        if not started_by_supervisor():
            check_can_listen(host, port)
    except OSError as e:
        return cannot_listen(host, port, e)
    try:
        model_provider.load_default()
    except Exception as e:
        cli_args = model_provider.cli_args
        # A path or id that names no model is the operator's to mend: one line says so.
        # Anything else may be a bug of a loader's: its traceback goes to the log.
        log.critical("model_load_failed", model=cli_args.model, draft_model=getattr(cli_args, "draft_model", None),
                     error_type=type(e).__name__, error_message=str(e), exc_info=not isinstance(e, (OSError, ValueError)))
        what, name = which_model_failed(cli_args)
        print(f"mlx-guardian: cannot load the {what} {name}: {why_no_model(name, e)}", file=sys.stderr)
        return EXIT_BOOT_ERROR

    problems = impossible_flags(model_provider.cli_args,
                                served_model_config(model_provider.model_key[0], model_provider.model))
    if problems:
        log.critical("flags_invalid", problems=problems)
        print("mlx-guardian: " + "\nmlx-guardian: ".join(problems), file=sys.stderr)
        return EXIT_USAGE

    door = make_door(live.view("access"), bound_host=host,
                     allowed_origins=model_provider.cli_args.allowed_origins,
                     supervised_child=started_by_supervisor(),
                     keys=getattr(model_provider.cli_args, "guardian_keys", None))
    # The engine's give-up (exit 4, 5; 7 in a group) wins over a SIGTERM that came just before it:
    # launchd and systemd read what happened from the code.
    served = ServedModel(model_provider, live, pm, on_exit=exit_request.fail,
                      engine_class=GuardianEngine if member is None else member.engine_class, door=door)
    engine = served.engine
    if member is not None:
        member.watch(engine)
    try:
        httpd = make_http_server(host, port, served, door, tls)
    except OSError as e:  # taken while the model loaded
        stock.loop.stop_generation_thread(engine)  # its thread would keep the process alive
        return cannot_listen(host, port, e)
    registry = metrics.registry_of(pm)
    if registry is not None:  # the connection layer's counts, beside the engine's
        registry.register(metrics.ConnectionCollector(httpd.connection_status))
    channel = handoff.child_channel()
    if channel is not None:  # our supervisor hands us its clients' connections
        httpd.take_handoffs(channel)
    # Before the loop starts: what exists now (the model, every module) lives
    # as long as the process, and no full collection need walk it again.
    frozen_objects = long_lived.freeze()
    served.start()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: exit_request(EXIT_OK))
    if member is None and started_by_supervisor():
        # A supervisor's child (it gave us its relay key) never outlives it: serving now, it
        # drains (until now it left at once: guardian.cli's leave_with_supervisor_before_serving).
        die_with_parent(lambda: exit_request(EXIT_OK), parent=supervisor_pid())
    # Said again when a save opens or closes the door (protected_mode is live); before any
    # reload, so that no save goes unsaid.
    live.on_change(lambda change: announce(door) if {"access.protected_mode", "access.public_paths"}
                   & set(change.applied) else None)
    # SIGHUP re-reads --guardian-config, the key file and the certificate (its default would end
    # the process), on the main thread: the reload starts threads, which a handler may not.
    reload = functools.partial(reload_on_sighup, live, door, tls)
    held = signal.signal(signal.SIGHUP, lambda *_: exit_request.run_on_main_thread(reload))
    if getattr(held, "pending", False):  # one came while the model loaded (guardian.cli.HeldSighup)
        exit_request.run_on_main_thread(reload)
    live.follow()
    door.keys.follow()

    httpd.on_reader_crash = lambda: exit_request.fail(EXIT_UNCAUGHT)
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    log.info(
        "server_started",
        host=host,
        port=httpd.server_address[1],
        scheme=httpd.scheme,
        model=model_provider.cli_args.model,
        mlx_lm_version=stock.contract.STOCK_VERSION,
        access=door.mode,
        api_keys=len(door.keys.names),
        allowed_origins=door.origins.describe(),
        frozen_objects=frozen_objects,
    )
    announce(door)
    code = exit_request.wait()
    log.info("server_stopping", exit_code=code, hint="a second SIGINT (Ctrl-C) or SIGTERM stops without draining")
    served.stop_admitting()
    live.stop()
    door.keys.stop()
    drain(httpd, engine, live.config.core.exit_grace_s, cut_short=lambda: exit_request.asked_again)
    # What is left is answered here, in one process; a supervisor's child leaves it to its
    # supervisor, which sends it again to the next child (or answers it, when stopping too).
    answer = not started_by_supervisor()
    served.end_drain(answer=answer)
    if answer:  # a child's exit gives them to its supervisor at once: a second more generated for nothing
        answer_the_rest(httpd)
    httpd.shutdown()
    httpd.server_close()
    stock.loop.stop_generation_thread(engine)
    # The engine gave up during the drain (exit 4, 5), or, in a group, a rank was lost
    # meanwhile (mlx.launch signals the others as a rank dies): that failure is the code
    # (ExitRequest.fail), not the clean stop asked for before it.
    code = exit_request.code
    if member is not None:
        member.leave(code)
    # Contained: a plugin failing here must not turn exit 4 into exit 1.
    notify(pm.hook.guardian_shutdown, engine=engine.plugin_view, exit_code=code)
    log.info("server_stopped", exit_code=code)
    return code


class ServedModel(AdmittingGenerator):
    """One served model: its engine, admission and watchdog, wired as ``serve`` runs them.

    What the HTTP handler calls its response generator: ``generate`` admits a
    request, then queues it on the engine (guardian.admission.gate). The
    handler's own endpoints read ``engine``, ``gate`` and ``watchdog`` here.
    A process may hold several (each engine routes stock's seams on its own
    loop thread).
    """

    def __init__(self, model_provider, config: Union[GuardianConfig, LiveConfig], pm, *, on_exit,
                 engine_class=GuardianEngine, door=None):
        # Every component reads its settings through the live configuration.
        live = self.live = config if isinstance(config, LiveConfig) else LiveConfig(config)
        config = live.config
        engine = engine_class(model_provider, model_provider.cli_args.prompt_cache_size,
                              pm=pm, core=live.view("guardian"), on_exit=on_exit, access=live.view("access"),
                              watchdog=live.view("watchdog"))
        model_access = ModelAccess(model_provider, allowed_models=config.core.allowed_models,
                                   allow_any_model=config.core.allow_any_model)
        model_access.keep_served_model()
        gate = AdmissionGate(model_provider, pm, model_access=model_access, live=live, door=door,
                             on_client_left=engine.ledger.count_left_at_admission)
        # Hooks see the engine and admission through this facade only.
        engine.plugin_view = EngineView(engine, gate)
        super().__init__(gate, engine)
        self.stall_detector = StallDetector(engine, pm, live.view("watchdog"), core=live.view("guardian"))
        self.pm = pm
        live.on_change(self._config_changed)

    @property
    def config(self) -> GuardianConfig:
        """The configuration in force now."""
        return self.live.config

    def _config_changed(self, change) -> None:
        """A new version of the file applied live settings: tell what derives state from them."""
        self.stall_detector.settings_changed()
        notify(self.pm.hook.on_config_reloaded, engine=self.engine.plugin_view, changed=list(change.applied))

    def start(self) -> None:
        """Run the start-up hooks, then the watchdog."""
        notify(self.pm.hook.guardian_startup, engine=self.engine.plugin_view, config=self.config)
        self.stall_detector.start()  # with [watchdog] enabled = false, it neither judges nor probes

    @property
    def stopping(self) -> bool:
        """Set once the process is exiting (``stop_admitting``); requests in flight drain meanwhile."""
        return self.stall_detector.stopped

    def stop_admitting(self) -> None:
        """From now on /readyz says 503 (a load balancer takes this replica out,
        see config/haproxy/) and a new request gets 503 + Retry-After (one that
        retries on 503 sends it to another replica) instead of lengthening the drain."""
        self.stall_detector.stop()

    def stopping_error(self) -> GuardianError:
        return GuardianError("The server is stopping; send the request again.", status=503, code=SERVER_STOPPING,
                             retry_after_s=self.config.core.retry_after_s)

    def end_drain(self, answer: bool = True) -> None:
        """The drain is over: the watchdog stops; with ``answer``, each request still in flight
        ends now with ``stopping_error`` (a stream's error event, else a 503), not a
        connection cut by the exit."""
        self.stall_detector.end()
        if not answer:
            return
        error = self.stopping_error()
        for record in self.engine.ledger.unfinished():
            record.stop_generation()
            record.fail(error)

    def generate(self, request, generation_args, progress_callback=None):
        if self.stopping:
            raise AbortRequest(self.stopping_error())
        return super().generate(request, generation_args, progress_callback)


def reload_on_sighup(live: LiveConfig, door, tls: Optional[ServerCertificate] = None) -> None:
    """SIGHUP, on the main thread: read --guardian-config, the key file and the certificate
    again (each on a thread of its own)."""
    live.request_reload("sighup")
    door.keys.request_reload("sighup")
    if tls is not None:
        threading.Thread(target=tls.reload, args=("sighup",), name="tls-reload", daemon=True).start()


class GuardianHTTPServer(HeldConnections, ThreadingHTTPServer):
    """Stock's threading HTTP server behind the connection layer (guardian.serving.connection):
    requests read under deadlines, handler threads bounded, HTTPS when given a certificate."""

    # The served model's plugins (the check_access hook); None: the door alone (a test's server).
    pm = None
    served: Optional[ServedModel] = None

    def body_limit(self) -> Optional[int]:
        """The prompt guard's ``max_body_bytes`` (live): a longer body is refused unread."""
        return self.served.gate.max_body_bytes if self.served is not None else None

    def decide_at_head(self, incoming):
        """The door on the head of a request whose body is still to come: a refused
        client's body is never held (its handler answers it, with this decision)."""
        request = self.head_request(incoming)
        decision = decide_access(self.pm, self.door, request)
        return decision if decision is not None else AccessDecision(incoming.address[0])


def make_http_server(host: str, port: int, served: Optional[ServedModel], door=None,
                     tls: Optional[ServerCertificate] = None) -> ThreadingHTTPServer:
    """The HTTP server; its handler lets a request in through ``door`` (an AccessPolicy,
    guardian.access) and reaches the engine only through admission. ``tls``: serve HTTPS."""
    fingerprint = stock.contract.get_system_fingerprint()

    def handler(*args, **kwargs):
        return GuardianHandler(served, *args, system_fingerprint=fingerprint, **kwargs)

    httpd = GuardianHTTPServer((host, port), handler)
    httpd.tls = tls
    if served is not None:
        # A supervised child also answers its supervisor's checks, and reads what it adds to a head.
        child = started_by_supervisor()
        httpd.limits = LiveLimits(served.live.view("http"), functools.partial(auto_max_handlers, served),
                                  lambda: served.config.core.retry_after_s,
                                  extra_handlers=HANDLER_HEADROOM if child else 0,
                                  extra_headers=HEADERS_ADDED_FOR_CHILD if child else 0,
                                  extra_header_bytes=HEADER_BYTES_ADDED_FOR_CHILD if child else 0)
    # Handler threads must not keep a failed process alive past its exit.
    httpd.daemon_threads = True
    # Completion requests HTTP threads are answering now, for drain().
    httpd.completions = ActiveCount()
    # Without one (tests that build a server by hand): the default door for the address.
    httpd.door = door or make_door(AccessSettings(), bound_host=host, allowed_origins=None)
    httpd.pm = served.pm if served is not None else None
    httpd.served = served
    return httpd


def auto_max_handlers(served: ServedModel) -> int:
    """Handler threads when [http] max_handlers is 0: the engine's decode concurrency,
    the prompt guard's queue (live: the version in force), and headroom (guardian.serving.connection)."""
    guard = served.config.plugin_settings.get("prompt_guard")
    queued = getattr(guard, "max_queued", 0) if getattr(guard, "enabled", False) else 0
    return getattr(served.cli_args, "decode_concurrency", 32) + queued + HANDLER_HEADROOM


def answer_the_rest(httpd, within_s: float = ANSWER_REST_S) -> None:
    """Give the requests ``end_drain`` failed a moment to write their answers."""
    deadline = time.monotonic() + within_s
    while httpd.completions.active and time.monotonic() < deadline:
        time.sleep(0.01)


def drain(httpd, engine, grace_s: float, cut_short: Callable[[], bool] = lambda: False) -> None:
    """Give requests in flight until ``grace_s`` to reach their clients, or until ``cut_short()``."""
    def busy() -> bool:
        return engine.ledger.has_work() or bool(httpd.completions.active)

    deadline = time.monotonic() + grace_s
    while busy() and time.monotonic() < deadline:
        if cut_short():
            log.warning("drain_cut_short", requests_in_flight=httpd.completions.active,
                        seconds_left=round(deadline - time.monotonic(), 1))
            return
        time.sleep(0.02)
    if busy():
        # Said before they are answered (or left to a supervisor): which requests the grace
        # ended on, where each stood, and where the engine's loop was. A drain that ended
        # silently at its grace left an operator (and a test) nothing to tell a slow
        # request from one the engine never took.
        reader = httpd.reader_state()
        log.warning("drain_timed_out", grace_s=grace_s, requests_in_flight=httpd.completions.active,
                    unfinished=[{"request_id": record.request_id, "stage": record.stage.value,
                                 "tokens": len(record.generated), "probe": record.synthetic}
                                for record in engine.ledger.unfinished()],
                    loop_stack=stack_of(engine.lifecycle.owner), reader_stack=reader.get("stack", []),
                    reader_timers_overdue_s=reader.get("timers_overdue_s", 0.0),
                    hint="raise [guardian] exit_grace_s for longer answers")

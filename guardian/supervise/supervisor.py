"""Subprocess mode: ``mlx-guardian --supervise [any other flag]``.

A small supervisor process owns the public host:port and runs the engine
as a child on 127.0.0.1 and a private port: the in-process guardian
(``python -m guardian``) by default, or stock ``mlx_lm server`` unchanged
with ``--engine stock``. It relays every request to the child
(``guardian.supervise.proxy``), checks the child's health, and replaces a child that
died, crashed in native code, or stopped answering (even SIGSTOPped).
A request in flight at two crashes is refused at the door for a while
(``guardian.quarantine.crashes``), so one body that crashes the engine
natively cannot crash-loop the service.

Modelled on gunicorn's Arbiter: signal handlers only enqueue; the main
loop waits with a timeout and dispatches; soft kill, then hard kill; the
log says why a child died; a crash loop makes the supervisor give up with
a documented exit code. It imports neither mlx nor mlx_lm, so nothing that
kills an engine can take it down with it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
import structlog

from guardian.config.tables import CoreSettings, HttpSettings, SupervisorSettings
from guardian.config import in_force
from guardian.config.registry import ConfigError
from guardian.config.live import bytes_read, file_sha256, merge, read_once
from guardian.config.loading import GuardianConfig
from guardian.observability.counting import ActiveCount, RecentEvents, StoppedClock
from guardian.quarantine.crashes import CrashQuarantine
from guardian.supervise.metrics import SupervisorMetrics
from guardian.distributed.launch import (LauncherProcess, dying_with_parent, group_command, kill_leftovers,
                                        starts_its_ranks)
from guardian.errors import BUSY_STEP_REASON, SERVER_STOPPING, STOPPING_REASON, GuardianError
from guardian.exit_codes import (EXIT_BOOT_ERROR, EXIT_OK, EXIT_SUPERVISOR_GAVE_UP, EXIT_UNCAUGHT, EXIT_USAGE,
                                 GROUP_EXIT_CODE_ENV)
from guardian.observability.logs import configure_logging, set_log_level
from guardian.access import announce
from guardian.access.tls import ServerCertificate, load_certificate
from guardian import handoff, long_lived
from guardian.relay_protocol import KEY_HEADER, RELAY_KEY_ENV, new_relay_key
from guardian.health.parent_watch import PARENT_PID_ENV
from guardian.serving.exit_request import SAME_STOP_S
from guardian.serving.sockets import LISTEN_FD_ENV, reserve_port
from guardian.supervise.fast_handoff import CHILD_HOST
from guardian.supervise.proxy import DEEP_READINESS_MARGIN_S, PublicServer
from guardian.supervise.upstream import CHILD_CONNECT_TIMEOUT_S
from guardian.health.sd_notify import SystemdNotifier
from guardian.supervise.child import (Child, DemoModelUnavailable, child_command, close_quietly, copy_of_a_pipe,
                                      crashed, demo_model, exit_reason, free_port, loggable_command, names_a_model,
                                      private_folder, signal_quietly)
from guardian.supervise.oom_kills import killed_for_memory, note_memory_group
from guardian.supervise.settings import (abbreviated_flag, acted_on_here, check_stock_tables, child_body_limit,
                                         make_parser, public_door, public_limits, read_file, read_settings)
from guardian.supervise.state import HOLDING, OVER_CLIENT_SHARE, SERVING, State


log = structlog.get_logger("guardian.supervisor")

# Put on the signal queue by the public port's reader as it crashes (no signal's number).
READER_CRASHED = -1
# Put there by a request that finds no child by [supervisor] idle_stop_s: start one.
WAKE_CHILD = -2
# serve_forever's poll: how long closing the public port can take at exit.
HTTP_POLL_S = 0.1
# When stopping: past the child's drain (exit_grace_s), time for the answers it and the
# supervisor write to requests still in flight (the child's own wait is 1 s), and its exit.
LAST_ANSWERS_S = 2.0
# systemd talks to the supervisor (the unit's main pid), never to the child.
SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# Restarting cannot fix bad flags: the child's parser said so.
NOT_RESTARTABLE = {EXIT_USAGE}
# What ``child_refused`` says of a ready child that did not say in time.
NO_VERDICT = object()
# A change of [access] asks the ready guardian child this often whether it runs the file's
# new version or refused it, for [supervisor] child_verdict_wait_s at most.
CHILD_VERDICT_POLL_S = 0.05
CHILD_VERDICT_POLL_TIMEOUT_S = 1.0
# The main loop woke this much later than due: the supervisor did not run, nor, most
# likely, its child (SIGSTOP of the process group, Ctrl-Z, a frozen cgroup or VM). That
# time is no child's fault. (A pause inside a health check is not seen: a check's own
# time cannot tell a pause from a child slow to answer, which is the child's.)
PAUSE_NOTICED_S = 1.0


# Checks in a row that get no answer before a child takes no new request (``Supervisor.answered``).
MISSED_CHECKS_NOT_ANSWERING = 2
# How long a reaped child's last words may take to be read before its requests are struck.
REAP_READ_WORDS_TIMEOUT_S = 1.0
# /health's and /readyz's 503 from the supervisor itself, in words (``unavailable_health``).
STATE_REASONS = {State.READY: "the engine process changed while it answered",
                 State.STARTING: "the engine process is starting",
                 State.RESTARTING: "the engine process is restarting",
                 State.UNHEALTHY: "the engine process does not answer its health checks",
                 State.STOPPING: STOPPING_REASON,
                 State.FAILED: "the engine is not running and will not be restarted",
                 State.IDLE: "no request for [supervisor] idle_stop_s: the next starts the engine process"}
# While a stock child drains, how often the main loop looks whether its requests ended.
STOCK_DRAIN_LOOK_S = 0.05


def said_since(failure: dict, since: float) -> bool:
    """Whether a child's ``last_failure`` was said at ``since`` (epoch seconds) or later."""
    try:
        return datetime.datetime.fromisoformat(failure["at"]).timestamp() >= since
    except (KeyError, TypeError, ValueError):
        return False


class Supervisor:
    """Owns the public port and one engine child; replaces it when it fails."""

    def __init__(self, options: argparse.Namespace, child_args: list[str],
                 settings: Optional[SupervisorSettings] = None, core: Optional[CoreSettings] = None,
                 door=None):
        self.options = options
        # [supervisor] and [guardian] from --guardian-config, flags winning.
        self.settings = settings or SupervisorSettings().with_flags(options)
        self.core = core or CoreSettings().with_flags(options)
        self.child_args = child_args
        # Only this user reads it: each child keeps the version of the file it runs here
        # (guardian.config.in_force), so that one saved broken does not stop the next.
        self.private_dir: Optional[tempfile.TemporaryDirectory] = None
        self.signals: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()  # state and child, read by HTTP threads
        # Notified whenever the state or the child changes: held requests wait on it.
        self.changed = threading.Condition(self.lock)
        self.holding = 0  # requests waiting for a ready child now
        self.held_by_client: dict[Optional[str], int] = {}  # of those, by client (the door's name)
        self.state = State.STARTING
        self.child: Optional[Child] = None
        self.generation = 0
        # The crash loop's window leaves out the time children spent starting (from a spawn
        # to a child ready, children that never were included): with a large model's
        # minute-long loads, six children that crashed at once after each took longer than
        # the window's 300 s, and a crash loop restarted them for ever.
        self.children_starting = StoppedClock()
        self.restart_times = RecentEvents(self.settings.window_s, clock=self.children_starting)
        self.restarts = 0
        self.boot_failures = 0  # children in a row that could not load the model
        self.pauses = 0
        self.pause_watch = PauseWatch()
        self.paused_s = 0.0
        self.paused_until = 0.0  # when the last pause counted ended (monotonic): counted once
        self.last_exit: Optional[dict] = None
        self.outage_started = time.monotonic()
        self.exit_code: Optional[int] = None
        # When a SIGTERM or SIGINT asked for the stop; a later one gives up the drain.
        self.stopping_since: Optional[float] = None
        self.asked_again = False
        # A stock child has no drain (SIGTERM ends it at once): the supervisor holds its
        # SIGTERM while its requests in flight finish, until then (monotonic), and why.
        self.stock_drain_until: Optional[float] = None
        self.stock_drain_reason = ""
        # Requests the public side is relaying now.
        self.in_flight = ActiveCount()
        # Requests in flight at crashes; the twice-struck are refused at the door.
        self.quarantine = CrashQuarantine(self.settings.quarantine_s, self.settings.window_s,
                                          self.settings.isolation_wait_s)
        self.httpd: Optional[PublicServer] = None
        self.tls: Optional[ServerCertificate] = None  # HTTPS on the public port (run() loads it)
        self.metrics = SupervisorMetrics(self)  # GET /metrics on the public port
        self.notifier = SystemdNotifier()
        self.ready_sent = False
        self.watchdog_interval = self.notifier.watchdog_interval_s()
        self.next_watchdog_ping = time.monotonic()
        # Proves to each child that a request comes from here (guardian.relay_protocol).
        self.relay_key = new_relay_key()
        # Who may come in at the public port (guardian.access): the same door as one process'.
        self.door = door or public_door(options, child_args)
        self.config_watcher = None  # the file's watch (``follow_config``)
        # A check answers fast or not at all (a SIGSTOPped child accepts the connection
        # in the kernel and never replies): it fails past --supervisor-health-timeout (5 s
        # at most, the setting's bound: it runs on the main loop, which signals, reaps and kills).
        self.health_timeout = self.settings.health_timeout_s
        # The file as in force here, flags winning (live settings follow its saves), and as
        # it was at start (what the others stay bound to).
        try:
            self.config = self.started_config = read_file(options)
        except ConfigError:  # the file broke since it was read: the child will say so
            self.config = self.started_config = GuardianConfig()
        self.child_body_limit = child_body_limit(self.config, self.settings.engine)
        self.config_sha256: Optional[str] = self.config.sha256  # the version in force (status)
        self.refused_sha256: Optional[str] = None  # the last version of the file refused
        # Why it was refused, as a guardian's /guardian/status says under config.last_failure;
        # None once a version is in force again.
        self.config_last_failure: Optional[dict] = None
        self.sighup_at = 0.0  # when the last SIGHUP came (epoch seconds)
        # Settings the file changed that the supervisor reads at start only.
        self.pending_restart: tuple = ()

    @property
    def http(self) -> HttpSettings:
        """The public port's [http] (live here as in a child)."""
        return self.config.http

    @property
    def deep_readiness_timeout_s(self) -> float:
        """How long a deep readiness check may take: the child's probes' deadline, and a margin."""
        return self.config.watchdog.probe_timeout_s + DEEP_READINESS_MARGIN_S

    # -- main loop ----------------------------------------------------------
    def run(self) -> int:
        """Serve until stopped or given up; return the exit code."""
        self.install_signal_handlers()
        try:  # the public port's certificate, from [access] or the flags
            self.tls = load_certificate(self.door.settings)
        except ConfigError as e:
            log.critical("config_invalid", error_message=str(e))
            print(f"mlx-guardian: {e}", file=sys.stderr)
            return EXIT_USAGE
        try:
            self.httpd = PublicServer((self.options.host, self.options.port), self, self.tls,
                                      public_limits(self.options, self.child_args, self.settings, self.core,
                                                    self.http))
        except OSError as e:
            log.critical("supervisor_bind_failed", host=self.options.host, port=self.options.port,
                         error_message=str(e))
            print(f"mlx-guardian: cannot listen on {self.options.host}:{self.options.port}: {e}", file=sys.stderr)
            return EXIT_USAGE
        frozen_objects = long_lived.freeze()  # as a served model's process does
        self.httpd.on_reader_crash = lambda: self.signals.put(READER_CRASHED)
        threading.Thread(target=self.httpd.serve_forever, args=(HTTP_POLL_S,), name="http",
                         daemon=True).start()
        self.door.keys.follow()
        self.follow_config()
        log.info("supervisor_started", host=self.options.host, port=self.httpd.server_address[1],
                 engine=self.settings.engine, pid=os.getpid(), scheme=self.httpd.scheme, access=self.door.mode,
                 api_keys=len(self.door.keys.names), allowed_origins=self.door.origins.describe(),
                 passing=self.passing(), frozen_objects=frozen_objects)
        announce(self.door)
        # Its children's private files: the configuration in force (guardian.config.in_force),
        # a group's exit codes and its TMPDIR (guardian.distributed.launch); a stock group's
        # TMPDIR alone.
        if self.settings.launch_args or (self.settings.engine == "guardian"
                                         and self.options.guardian_config is not None):
            self.private_dir = private_folder()
        try:
            return self.serve()
        finally:
            if self.private_dir is not None:
                self.private_dir.cleanup()

    def passing(self) -> str:
        """How requests reach a child, for the start line: ``hand_off`` is on by default
        and silently cannot be everywhere (guardian.handoff)."""
        if self.settings.engine != "guardian" or self.settings.launch_args:
            return "relayed (the child is stock, or a group)"
        if not self.settings.hand_off:
            return "relayed ([supervisor] hand_off = false)"
        if not handoff.supported():
            return f"relayed (no hand-off on {sys.platform}: no count of the bytes a socket took)"
        if self.httpd.scheme == "https":
            return "relayed (TLS: the session stays in this process)"
        return "handed off"

    def serve(self) -> int:
        """Run children until stopped or given up; return the exit code."""
        self.spawn_child()
        while not (self.exit_code is not None and self.child is None):
            wait_s = self.seconds_to_next_duty()
            due = time.monotonic() + max(wait_s, 0.0)
            signals = self.wait_for_signals(wait_s)
            self.notice_pause(time.monotonic() - due)
            for signum in signals:
                self.handle_signal(signum)
            self.reap_child()
            self.tend_child()
            self.ping_systemd_watchdog()
        return self.finish()

    def install_signal_handlers(self) -> None:
        """Handlers only enqueue; the main loop does the work."""
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            held = signal.signal(signum, lambda signum, frame: self.signals.put(signum))
            if getattr(held, "pending", False):  # one came while starting (guardian.cli.HeldSighup)
                self.signals.put(signum)

    def follow_config(self) -> None:
        """Watch --guardian-config for the live settings the supervisor acts on (``reload_config``),
        as a guardian child watches the rest."""
        if self.options.guardian_config is not None:
            from guardian.config.live import ConfigFileWatcher

            self.config_watcher = ConfigFileWatcher(Path(self.options.guardian_config), self.reload_config)
            self.config_watcher.start()

    def reload_config(self, reason: str) -> None:
        """The file's settings the supervisor acts on, read again: [access] and [http] (its
        public port's door and connection layer), of [guardian] ``SUPERVISOR_CORE_SETTINGS``,
        [watchdog] probe_timeout_s (how long a deep readiness check may take). Live ones
        apply; others that changed ([supervisor]'s, the certificate's) are logged as
        waiting for a restart of the supervisor. A version a guardian child refuses (its
        plugins' tables, which the supervisor does not load) changes nothing here either,
        as it changes nothing there."""
        if self.options.guardian_config is None:
            return
        before = file_sha256(self.options.guardian_config)
        try:
            fresh = read_file(self.options, still=True)
            check_stock_tables(fresh, self.settings.engine)
        except ConfigError as e:
            return self.config_refused(reason, str(e), bytes_read(self.options.guardian_config, before))
        if reason == "file_changed" and fresh.sha256 == self.config_sha256:
            self.refused_sha256 = None  # back to the version in force: one refused before is said again
            self.config_in_force(fresh.sha256)
            return None
        if reason == "file_changed" and fresh.sha256 == self.refused_sha256:
            return None  # refused already (by the child: not asked again)
        self.refused_sha256 = None  # another version: one refused before is said again
        merged, change = merge(self.config, fresh, self.started_config)
        changed = [key for key in change.applied if acted_on_here(key)]
        body_limit = child_body_limit(fresh, self.settings.engine)
        if body_limit != self.child_body_limit:  # a plugin's table: no setting of the supervisor's
            changed.append("prompt_guard.max_body_bytes")
        waiting = [key for key in change.needs_restart if acted_on_here(key)]
        newly_waiting = sorted(set(waiting) - set(self.pending_restart))
        asked_at = time.monotonic()
        # Asked even where nothing it acts on changed: config_sha256 named a version the
        # child refused, which nothing ran (a hunt). After a signal, which the child reads
        # the file again for too, only its new word counts: its refusal from before the
        # signal was taken for the answer, where the signal was sent to retry.
        refused = self.child_refused(fresh.sha256, since=self.sighup_at if reason == "sighup" else None)
        if refused is not None and refused is not NO_VERDICT:
            return self.config_refused(reason, f"the child refused this version of the file, so the "
                                               f"supervisor keeps its settings too: {refused}", fresh.sha256)
        if not changed and not newly_waiting:
            self.pending_restart = tuple(sorted(waiting))
            self.config_in_force(fresh.sha256)  # nothing it acts on changed: in force as it stands
            return
        if refused is NO_VERDICT:
            # Its own file watch decides on its own: the user's new door is put in force here
            # rather than none at all (a paused or busy child may never say, or say late).
            log.warning("supervisor_config_applied_without_child_verdict", reason=reason,
                        waited_s=round(time.monotonic() - asked_at, 3),
                        hint="the child did not say whether it runs this version; its own "
                             "config_reloaded or config_reload_failed will")
        self.pending_restart = tuple(sorted(waiting))
        if newly_waiting:
            log.warning("supervisor_config_change_needs_restart", settings=newly_waiting,
                        pending_restart=list(self.pending_restart),
                        hint="the supervisor reads these at start; restart it (its child restarts with it)")
        if not changed:
            self.config_in_force(fresh.sha256)
            return
        self.config = merged
        self.child_body_limit = body_limit
        self.door.use_settings(merged.access)
        if {"access.protected_mode", "access.public_paths"} & set(changed):
            announce(self.door)  # the door opened or closed: said as at start
        self.core = merged.core
        if "guardian.log_level" in changed:  # as at start: the file's, else the flag's
            set_log_level(merged.core.log_level or self.options.log_level or "INFO")
        if self.httpd is not None:  # the public port's connection layer reads its limits at each use
            self.httpd.limits = public_limits(self.options, self.child_args, self.settings, self.core, self.http)
        self.config_in_force(fresh.sha256)  # last: a script that waits for it finds the version in force
        log.info("supervisor_config_reloaded", reason=reason, changed=sorted(changed))

    def config_refused(self, reason: str, message: str, sha256: Optional[str]) -> None:
        """Say that a version of the file was refused: once a version, as a child says it,
        however many events one save comes as (a rename and a late event, the watch's
        poll); a signal asks again and is answered again."""
        if reason == "file_changed" and sha256 is not None and sha256 == self.refused_sha256:
            return None
        self.refused_sha256 = sha256
        self.config_last_failure = {"at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    "reason": reason, "error_message": message, "sha256": sha256}
        log.error("supervisor_config_reload_failed", reason=reason, error_message=message)
        return None

    def config_in_force(self, sha256: str) -> None:
        """The file's version ``sha256`` is the one the supervisor acts on (status), none refused."""
        self.config_last_failure = None
        self.config_sha256 = sha256

    def child_refused(self, sha256: Optional[str], since: Optional[float] = None):
        """Why a ready guardian child refused the file's version ``sha256`` (its
        ``config_reload_failed``, at ``since`` (epoch seconds) or later where given); None
        once it runs that version, or with none to ask (no child, a stock child);
        NO_VERDICT if a ready one did not say within ``child_verdict_wait_s`` (busy, or its
        answers failed), or one cannot be asked (not answering, or starting).
        (On the file watch's thread: the main loop goes on meanwhile.)"""
        deadline = time.monotonic() + self.settings.child_verdict_wait_s
        while True:
            with self.lock:  # asked each time: it may be replaced meanwhile
                child = None if self.holds() else self.serving()
                held = self.child
            if child is None:
                # One that answers no more (paused), or starting (it reads the file as it
                # stands, and may refuse it), cannot say now; with none at all, the next
                # starts from the version in force here.
                return NO_VERDICT if held is not None and held.has_readyz else None
            if not child.has_readyz:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return NO_VERDICT
            try:
                config = child.client.get("/guardian/status",
                                          timeout=min(CHILD_VERDICT_POLL_TIMEOUT_S, left)).json()["config"]
            except Exception:  # noqa: BLE001 - any failure (a reaped child's client is closed): asked again
                config = {}
            if config.get("sha256") == sha256:
                return None
            failure = config.get("last_failure") or {}
            if failure.get("sha256") == sha256 and (since is None or said_since(failure, since)):
                return failure.get("error_message") or "refused"
            threading.Event().wait(CHILD_VERDICT_POLL_S)  # the child's own watch reads the file meanwhile

    def wait_for_signals(self, timeout: float) -> list[int]:
        """Every queued signal, waiting up to ``timeout`` for the first."""
        try:
            received = [self.signals.get(timeout=max(timeout, 0.0))]
        except queue.Empty:
            return []
        while not self.signals.empty():
            received.append(self.signals.get_nowait())
        return received

    def seconds_to_next_duty(self) -> float:
        """Until the next health check, hard kill or systemd watchdog ping."""
        child = self.child
        now = time.monotonic()
        due = now + self.settings.interval_s
        # No health checks while a child is being stopped: a check that came due meanwhile
        # (its time never moves on) made every wait 0, a loop spinning through the grace.
        if child is not None and child.hard_kill_at is not None:
            if not child.hard_killed:  # once it is, its SIGCHLD wakes the loop
                due = min(due, child.hard_kill_at)
        elif child is not None and self.stock_drain_until is not None:  # its requests' ends are looked at often
            due = min(due, self.stock_drain_until, now + STOCK_DRAIN_LOOK_S)
        elif child is not None:
            due = child.next_check_at(self.settings.interval_s)
        if self.watchdog_interval is not None:
            due = min(due, self.next_watchdog_ping)
        return due - time.monotonic()

    def ping_systemd_watchdog(self) -> None:
        """WATCHDOG=1 from the main loop itself: systemd's WatchdogSec watches the supervisor.

        Only after READY=1: systemd's watchdog starts with the service, and
        the child's health is the supervisor's business, not systemd's.
        """
        if not self.ready_sent or self.watchdog_interval is None:
            return
        if time.monotonic() >= self.next_watchdog_ping:
            self.notifier.notify("WATCHDOG=1")
            self.next_watchdog_ping = time.monotonic() + self.watchdog_interval

    def handle_signal(self, signum: int) -> None:
        """SIGCHLD only wakes the loop; SIGHUP re-reads the public port's key file and
        certificate, and goes to a guardian child (it re-reads --guardian-config);
        SIGTERM/SIGINT stop, a second one hard-kills. Not signals: ``WAKE_CHILD`` starts a
        child for a request that came while idle; ``READER_CRASHED`` stops."""
        if signum == signal.SIGHUP:
            self.sighup_at = time.time()  # the child's word on the file counts from here (reload_config)
            if self.config_watcher is not None:  # on its thread: it may wait for the child's verdict
                self.config_watcher.kick("sighup")
            else:
                self.reload_config("sighup")
            self.door.keys.request_reload("sighup")  # once a writer has it closed
            if self.tls is not None:
                self.tls.reload("sighup")
            if self.child is not None and self.settings.engine == "guardian":
                self.forward_sighup(self.child)
            return
        if signum == WAKE_CHILD:
            if self.child is None and self.exit_code is None and self.state == State.STARTING:
                log.info("child_waking", why="a request came with no child ([supervisor] idle_stop_s)")
                self.spawn_child()
            return
        if signum == READER_CRASHED:  # deaf: stop, as at SIGTERM, and exit as for a bug
            if self.exit_code is None:
                self.notifier.notify("STOPPING=1")
                self.exit_code = EXIT_UNCAUGHT
                self.stopping_since = time.monotonic()
                self.set_state(State.STOPPING)
                if self.child is not None:
                    self.soft_kill("the supervisor's HTTP reader crashed")
            return
        if signum not in (signal.SIGTERM, signal.SIGINT):
            return
        name = signal.Signals(signum).name
        if self.exit_code is None:
            log.info("supervisor_stopping", signal=name)
            self.notifier.notify("STOPPING=1")
            self.exit_code = EXIT_OK
            self.stopping_since = time.monotonic()
            self.set_state(State.STOPPING)
            child = self.child
            if child is not None and child.kill_reason is None and self.settings.engine == "stock" \
                    and self.in_flight.active:
                self.stock_drain_until = self.stopping_since + self.core.exit_grace_s
                self.stock_drain_reason = f"supervisor received {name}"
                log.info("stock_child_draining", pid=child.pid, in_flight=self.in_flight.active,
                         exit_grace_s=self.core.exit_grace_s)
            elif child is not None and child.kill_reason is None:
                self.soft_kill(f"supervisor received {name}")
        elif time.monotonic() - self.stopping_since < SAME_STOP_S:
            # The same stop: a terminal's Ctrl-C reaches the whole process group, a
            # container's stop hook and its runtime each send one, as the one-process server takes them.
            return
        elif self.child is not None and self.child.kill_reason is None:  # a stock child's drain, ended
            self.soft_kill(f"{self.stock_drain_reason}, then {name} again")
        elif self.child is not None and not self.child.hard_killed:
            self.hard_kill(f"when {name} asked again for the stop")
        else:  # the child is gone: what its clients are still owed is given up too (``finish``)
            self.asked_again = True

    # -- the child's life ---------------------------------------------------
    def spawn_child(self) -> None:
        """Start a child on a free private port; give up (exit 6) where the system refuses
        what that takes: a port, a descriptor, a process (EMFILE, EAGAIN), the interpreter
        itself (removed or replaced by an upgrade). The error went up through the main loop:
        a traceback, no supervisor_gave_up, and the clients held for the child dropped."""
        try:
            self._spawn_child()
        except OSError as e:
            log.error("child_start_failed", error_type=type(e).__name__, error_message=str(e),
                      errno=e.errno, generation=self.generation)
            self.give_up(f"no child could be started ({type(e).__name__}: {e})", EXIT_SUPERVISOR_GAVE_UP)

    def _spawn_child(self) -> None:
        self.children_starting.stop(time.monotonic())  # until a child is ready
        self.generation += 1
        stock_engine = self.settings.engine == "stock"
        # A guardian child of its own (not a group's launcher, nor stock) listens on a
        # socket bound here: its port is its own from now, not from its bind after the
        # model loads (minutes, for a large one), which an outgoing connection on this
        # host could take meanwhile; its bind would fail (exit 2), and so would we.
        listener = reserve_port(CHILD_HOST) if not stock_engine and not self.settings.launch_args else None
        port = listener.getsockname()[1] if listener is not None else free_port()
        command = child_command(self.options, self.settings.engine, self.child_args, port)
        env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_ENV}
        if not stock_engine:  # streams it tags can be continued on the next child
            env[RELAY_KEY_ENV] = self.relay_key
        popen = subprocess.Popen
        channel = None
        pass_fds: tuple[int, ...] = ()
        if listener is not None:
            env[LISTEN_FD_ENV] = str(listener.fileno())
            pass_fds += (listener.fileno(),)
        if self.settings.launch_args:  # an mlx.launch group (guardian.distributed.launch)
            command = group_command(self.settings.launch_args, command)
            private = self.private_dir.name if self.private_dir is not None else None
            # A stock rank leaves no exit code: the launcher's stands (guardian.distributed.launch).
            exit_code_file = (os.path.join(private, f"group-{self.generation}-exit-code")
                              if private and not stock_engine else None)
            temp_folder = (os.path.join(private, f"group-{self.generation}-tmp")
                           if private and starts_its_ranks(self.settings.launch_args) else None)
            popen = functools.partial(LauncherProcess, exit_code_file=exit_code_file, temp_folder=temp_folder)
            if exit_code_file is not None:
                env[GROUP_EXIT_CODE_ENV] = exit_code_file
        elif stock_engine:  # stock asks for no parent-death signal: it would outlive a SIGKILLed supervisor
            command = dying_with_parent(command)
        elif self.settings.hand_off and handoff.supported():
            channel = handoff.Channel()
            env.update(channel.child_env())
            pass_fds += channel.child_fds()
        env[PARENT_PID_ENV] = str(os.getpid())  # a child's parent; a group's ranks' too, beside their launcher
        if self.private_dir is not None and not stock_engine:  # the version in force, for the next child
            env[in_force.IN_FORCE_ENV] = os.path.join(self.private_dir.name, "config-in-force.toml")
        try:
            proc = popen(command, stdin=subprocess.DEVNULL, env=env,  # stdout, stderr: ours
                         **({"pass_fds": pass_fds} if pass_fds else {}))
        finally:
            if channel is not None:
                channel.started()
            if listener is not None:
                listener.close()  # the child's now: its port is freed when it exits
        try:
            client = httpx.Client(
                base_url=f"http://{CHILD_HOST}:{port}",
                timeout=httpx.Timeout(None, connect=CHILD_CONNECT_TIMEOUT_S),
                # Streams can be many at once; the public side bounds nothing either.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=20),
                # Plain HTTP to 127.0.0.1: skip loading CA certificates (~40 ms a restart).
                verify=False,
                # A guardian child serves only its supervisor: health checks and metrics too.
                headers={KEY_HEADER: self.relay_key} if not stock_engine else None,
            )
            child = Child(proc, port, self.generation, stock=stock_engine, client=client, handoff=channel)
            note_memory_group(child)
        except BaseException:
            proc.kill()  # never tracked: it would serve nobody, and outlive a supervisor giving up
            raise
        with self.lock:
            self.child = child
        log.info("child_started", pid=proc.pid, port=port, generation=self.generation,
                 engine=self.settings.engine, command=loggable_command(command))

    def reap_child(self) -> None:
        """Notice a child that exited, say why, and replace it unless stopping."""
        child = self.child
        if child is None or child.proc.poll() is None:
            return
        child.out_of_memory = killed_for_memory(child)
        reason = exit_reason(child)
        kill_leftovers(child.proc)  # a group's ranks go with their launcher
        self.last_exit = {"pid": child.pid, "generation": child.generation,
                          "returncode": child.proc.returncode, "reason": reason,
                          "uptime_s": round(time.monotonic() - child.started_at, 3),
                          "at": time.time()}
        level = log.error if crashed(child) else log.info
        level("child_exited", **self.last_exit)
        if self.httpd is not None:
            # The child's last words on requests handed off (guardian.supervise.fast_handoff)
            # are read first: one it answered in full just before it died is no crash suspect.
            self.httpd.handle_readable_now(timeout=REAP_READ_WORDS_TIMEOUT_S)
        suspects = []
        try:
            suspects = self.quarantine.child_exited(child.generation, crashed=crashed(child),
                                                    # A stock child has no KV budget to refuse a
                                                    # request too big for its memory: its kills
                                                    # strike, so such a request is quarantined.
                                                    out_of_memory=bool(child.out_of_memory) and not child.stock,
                                                    pid=child.pid, reason=reason)
        except Exception as e:  # noqa: BLE001 - what one request carried must not end the supervisor
            log.exception("crash_suspects_failed", generation=child.generation, error_type=type(e).__name__)
        with self.changed:
            self.child = None
            self.changed.notify_all()
        if self.exit_code is None:
            self.set_state(State.RESTARTING)
        close_quietly(child.client)
        if child.handoff is not None:
            child.handoff.close()
        if self.exit_code is None and child.idle_stop and not crashed(child):
            self.rest()
        elif self.exit_code is None:
            self.replace_child(child, quarantined=[s for s in suspects if s["quarantined"]])

    def rest(self) -> None:
        """A child stopped for want of requests is gone: idle until a request comes, or,
        where requests came as it stopped (they wait), start the next child at once."""
        with self.changed:
            if not self.holding:
                self.state = State.IDLE
                self.changed.notify_all()
                log.info("supervisor_idle", idle_stop_s=self.settings.idle_stop_s)
                return
        self.spawn_child()

    def replace_child(self, dead: Child, quarantined: list = ()) -> None:
        """Start the next child, or give up on a crash loop or refused flags. ``quarantined``:
        the requests this crash quarantined (guardian.quarantine.crashes)."""
        if not dead.stopped_by_supervisor and dead.proc.returncode in NOT_RESTARTABLE:
            return self.give_up(f"the child refused its flags (exit code {dead.proc.returncode})",
                                dead.proc.returncode)
        boot_failure = dead.boot_failure
        # Exit 3 says the model could not be loaded (guardian.exit_codes), whatever the checks
        # read before it: a stock child of mlx-lm 0.31.3 answers 200 while it loads (stock_child).
        if boot_failure is None and not dead.stopped_by_supervisor and dead.proc.returncode == EXIT_BOOT_ERROR:
            boot_failure = f"exit code {EXIT_BOOT_ERROR}"
        self.boot_failures = 0 if boot_failure is None else self.boot_failures + 1
        # A model that failed to load boot_attempts times in a row, no child ready between,
        # fails the same way every time (a wrong path, a folder it cannot write).
        if self.boot_failures >= self.settings.boot_attempts:
            return self.give_up(f"the model could not be loaded, {self.boot_failures} children in a row "
                                f"({boot_failure})", EXIT_BOOT_ERROR)
        explained = bool(quarantined) and dead.ready_at is not None
        served = dead.ready_at is not None and dead.requests_completed > 0
        if served and not explained:
            # Judged by progress, as the engine's failures are: a child that completed users'
            # requests before it died is no crash loop, however many came before it. Children
            # that each served, killed by an outside hand, ended the supervisor (exit 6).
            forgiven = self.restart_times.forget_all()
            if forgiven:
                log.info("restarts_forgiven", restarts=forgiven, why="the child completed users' requests",
                         requests_completed=dead.requests_completed)
        if explained:
            # A request crashed a child that had served (its engine works), and is quarantined
            # now: its crashes are no crash loop. Distinct poisons sent back to back, each
            # quarantined rightly, counted two restarts each, and the third ended the supervisor.
            forgiven = self.restart_times.forget_first_after(t for s in quarantined for t in s["crash_times"])
            log.info("restarts_forgiven", restarts=forgiven + 1, why="a quarantined request's crashes",
                     fingerprints=[s["fingerprint"] for s in quarantined])
        elif self.restart_times.count() >= self.settings.max_restarts:
            return self.give_up(f"more than {self.settings.max_restarts} restarts "
                                f"within {self.restart_times.window_s:g} s", EXIT_SUPERVISOR_GAVE_UP)
        else:
            self.restart_times.add()
        self.restarts += 1
        self.metrics.child_restarted(dead)
        self.spawn_child()

    def give_up(self, reason: str, exit_code: int) -> None:
        """Stop restarting: answer what is in flight, then exit with ``exit_code``."""
        log.critical("supervisor_gave_up", reason=reason, exit_code=exit_code,
                     restarts=self.restarts, last_exit=self.last_exit)
        self.notifier.notify("STOPPING=1")
        self.exit_code = exit_code
        self.set_state(State.FAILED)

    def tend_child(self) -> None:
        """Escalate a pending kill, or check health when it is due."""
        child = self.child
        if child is None:
            return
        now = time.monotonic()
        if child.kill_reason is None and self.stock_drain_until is not None:
            if not self.in_flight.active:
                self.soft_kill(f"{self.stock_drain_reason}, once its requests had finished")
            elif now >= self.stock_drain_until:
                self.soft_kill(f"{self.stock_drain_reason}; its drain of {self.core.exit_grace_s:g} s "
                               f"ended with {self.in_flight.active} requests in flight")
            return
        if child.kill_reason is not None:
            if not child.hard_killed and now >= child.hard_kill_at:
                self.hard_kill()
            return
        idle_s = self.idle_for(child, now)
        if idle_s >= self.settings.idle_stop_s > 0:
            return self.stop_idle_child(child, idle_s)
        if now >= child.next_check_at(self.settings.interval_s):
            self.check_health(child)

    def idle_for(self, child: Child, now: float) -> float:
        """How long a ready child has had no request: none in flight nor held, since the
        last ended (or since it became ready); 0 while it has one, or is not ready."""
        if self.state != State.READY or child.ready_at is None or self.in_flight.active or self.holding:
            return 0.0
        return now - max(self.in_flight.changed_at, child.ready_at)

    def stop_idle_child(self, child: Child, idle_s: float) -> None:
        """[supervisor] idle_stop_s: the child goes, with the memory it holds; the next request
        starts another (``wait_for_child``). Decided again under ``lock``: a request counts
        itself in flight before it asks for the child (``serving_child``, ``wait_for_child``),
        so one that came since ``idle_for`` looked keeps this child, and one that comes once
        the state has changed here waits for the next."""
        with self.changed:
            # idle_for again: a request counted and let go since (the reader's hand-off fell back
            # to a handler thread, which counts it anew) moved in_flight.changed_at.
            came = self.child is not child or self.idle_for(child, time.monotonic()) < self.settings.idle_stop_s
            if not came:
                child.idle_stop = True
                self._change_state(State.RESTARTING)
        if came:
            log.info("child_idle_stop_called_off", pid=child.pid, idle_s=round(idle_s, 3),
                     in_flight=self.in_flight.active, held=self.holding, state=self.state)
            return
        log.info("child_idle_stopping", pid=child.pid, idle_s=round(idle_s, 3),
                 idle_stop_s=self.settings.idle_stop_s)
        self.soft_kill(f"no request for {self.settings.idle_stop_s:g} s ([supervisor] idle_stop_s)", routine=True)

    def notice_pause(self, late_s: float, ended_at: Optional[float] = None) -> None:
        """The supervisor ran ``late_s`` later than due (until ``ended_at``, now if not
        given): if that is a pause, the child's clocks (its start, its unhealthy spell)
        stand still for it, as the in-process watchdog's heartbeat clock does
        (``process_paused``). Once: the main loop and the pause watch may both see it."""
        if late_s < PAUSE_NOTICED_S:
            return
        ended_at = time.monotonic() if ended_at is None else ended_at
        if ended_at - late_s < self.paused_until - PAUSE_NOTICED_S:
            return  # the pause already counted, seen again
        self.paused_until = ended_at
        self.pauses += 1
        self.paused_s += late_s
        child = self.child
        if child is not None:
            child.paused_s += late_s
            if child.last_ok is not None:
                child.last_ok += late_s
            if child.unanswered_since is not None:
                child.unanswered_since += late_s
        log.warning("supervisor_paused", paused_s=round(late_s, 3), pauses=self.pauses,
                    hint="the supervisor did not run (SIGSTOP of its group, Ctrl-Z, a frozen cgroup "
                         "or VM); no child is blamed for that time")

    def check_health(self, child: Child) -> None:
        """One health check; state changes and unhealthy-too-long decided here."""
        # A pause since the main loop last looked (it came after the loop's wait, before this
        # check) is one too: taken and dropped here, it went unseen, and a child starting
        # across a 9 s pause of the whole group was "not ready after 9.1 s" of its 8 (CI,
        # under load). notice_pause counts a pause seen twice once.
        paused_s, ended_at = self.pause_watch.take()
        if paused_s >= PAUSE_NOTICED_S:
            self.notice_pause(paused_s, ended_at)
        ok = self.probe(child)
        child.last_check_at = time.monotonic()
        if child.proc.poll() is None:  # alive after the check: no OOM kill of it so far
            note_memory_group(child)
        # The supervisor did not run for a while during the check (the whole group stopped,
        # a frozen VM): a pause, as one between checks is, and the check that failed
        # across it is no verdict on the child. (Not the check's length: httpx's timeout is
        # each phase's, and a slow child can make a check outlast it.)
        paused_s, ended_at = self.pause_watch.take()
        if paused_s >= PAUSE_NOTICED_S:
            self.notice_pause(paused_s, ended_at)
            if not ok:
                return
        if not ok and child.proc.poll() is not None:
            # It died during the check (a crash, a kill): no verdict on its health, which the
            # main loop's reaping gives with the reason (child_exited). Logged "unhealthy"
            # 2 ms before "killed by SIGKILL" otherwise (bench/growth.py: 2 of 42 kills).
            return
        if child.ready_at is not None:  # one starting answers nothing yet, as expected
            self.answered(child, child.last_check_answered)
        if ok:
            child.last_ok = child.last_check_at
            return self.child_healthy(child)
        if child.says_stopping:
            return self.child_stops_on_its_own(child, "its /readyz says it is stopping")
        if child.stock and child.last_status == 503:
            # Stock's /health (0.32 on) answers 200 while its generation thread lives, the
            # model's load included, and 503 once that thread is gone, for good; the process
            # lives on. Starting, its model could not be loaded: it sat "starting" for
            # start_timeout_s (600 s), then again in the next child, for ever. Ready, every
            # completion fails (the incident): that went on for --supervisor-unhealthy-after.
            if child.ready_at is None:
                child.boot_failure = "its generation thread ended before it was ready (stock's /health: 503)"
                return self.soft_kill(f"the model could not be loaded: {child.boot_failure}")
            # Its requests in flight are crash suspects, as at a native crash: a request that
            # kills the thread every time is quarantined, not sent from child to child.
            child.engine_died = True
            return self.soft_kill("its generation thread is gone (stock's /health: 503)")
        if child.ready_at is None:
            waited = child.last_check_at - child.started_at - child.paused_s
            if waited > self.settings.start_timeout_s:
                self.soft_kill(f"not ready after {waited:.1f} s (last check: {child.last_check})")
            return
        if child.says_busy:
            # Its watchdog lets a step that computes run past the stall limit, and will call
            # it a stall past its allowance (stall_busy_extra_s): the child's verdict, not a
            # second one here, which came at --supervisor-unhealthy-after whatever that was.
            child.last_ok = child.last_check_at
            self.serving_again(child)  # a check just before said "no heartbeat"
            return
        with self.changed:  # not over a stop an HTTP thread saw meanwhile (child_stops_on_its_own)
            unhealthy = self.child is child and self.state == State.READY and child.kill_reason is None
            if unhealthy:
                self._change_state(State.UNHEALTHY)
        if unhealthy:
            log.warning("child_unhealthy", pid=child.pid, check=child.last_check)
        failing_for = child.last_check_at - child.last_ok
        # From its first check that got no answer: from the last that got one, a long
        # --supervisor-interval made a child that missed one check silent long enough.
        silent_for = 0.0 if child.unanswered_since is None else child.last_check_at - child.unanswered_since
        # A frozen child keeps none of the deadlines of the requests handed to it, whose
        # clients waited for --supervisor-unanswered-after (~11 s) past them (a measurement).
        overdue = None if child.answered or self.httpd is None else self.httpd.overdue_handoff(child, time.monotonic())
        if failing_for >= self.settings.unhealthy_after_s:
            self.soft_kill(f"unhealthy for {failing_for:.1f} s (last check: {child.last_check})")
        elif silent_for >= self.settings.unanswered_after_s:
            self.soft_kill(f"answered no check for {silent_for:.1f} s (last check: {child.last_check})")
        elif overdue is not None:
            late_s, deadline = overdue
            self.soft_kill(f"answered no check for {silent_for:.1f} s, and a request handed to it is "
                           f"{late_s:.1f} s past its deadline ({deadline.source})")

    def probe(self, child: Child) -> bool:
        """GET /readyz (guardian) or /health (stock) with a short timeout.

        Stock 0.31.3's /health always answers 200, even after its
        generation thread died: for a stock child this check only proves
        the process is alive and answers HTTP.
        """
        path = "/readyz" if child.has_readyz else "/health"
        child.says_stopping = child.says_busy = False  # what this check's answer says, or nothing
        try:
            response = child.client.get(path, timeout=self.health_timeout)
        except httpx.HTTPError as e:
            child.last_check = f"{path}: {type(e).__name__}"
            child.last_check_answered = False
            child.last_status = None
            return False
        child.last_check = f"{path}: HTTP {response.status_code}"
        child.last_status = response.status_code
        child.last_check_answered = True
        said = response_json(response)
        completed = said.get("requests_completed")
        if type(completed) is int:
            child.requests_completed = completed
        reason = said.get("reason") if response.status_code == 503 else None
        reason = reason if isinstance(reason, str) else None
        child.says_stopping = reason == STOPPING_REASON
        child.says_busy = reason is not None and reason.startswith(BUSY_STEP_REASON)
        return response.status_code == 200

    def answered(self, child: Child, answered: bool) -> None:
        """Whether ``child``'s checks get an answer, as its last did. One whose checks got
        none twice in a row is sent no new request: a frozen child (SIGSTOP, its
        VM's or cgroup's) took every request sent to it, handed off or relayed, until its
        replacement, --supervisor-unhealthy-after (30 s) later, past every deadline. Its
        requests wait instead, as while a child starts (``holds``), and it is replaced
        sooner: --supervisor-unanswered-after (``check_health``)."""
        if not answered:
            child.missed_checks += 1
            if child.unanswered_since is None:
                child.unanswered_since = child.last_check_at
        else:
            child.missed_checks, child.unanswered_since = 0, None
        # Two in a row: one check late under load (its 1 s timeout) held every new request.
        answering = child.missed_checks < MISSED_CHECKS_NOT_ANSWERING
        if child.answered == answering:
            return
        with self.changed:
            child.answered = answering
            self.changed.notify_all()
        if answering:
            log.info("child_answers_again", pid=child.pid, check=child.last_check)
        else:
            log.warning("child_not_answering", pid=child.pid, check=child.last_check,
                        hint="new requests wait for it to answer again, or for its replacement "
                             "(--supervisor-hold, --supervisor-unanswered-after)")

    def child_healthy(self, child: Child) -> None:
        """A check passed: the first makes the child ready, a later one ends an unhealthy spell."""
        if child.ready_at is None:
            child.ready_at = child.last_ok
            self.children_starting.resume(child.ready_at)
            log.info("child_ready", pid=child.pid, generation=child.generation,
                     startup_s=round(child.ready_at - child.started_at, 3),
                     downtime_s=round(child.ready_at - self.outage_started, 3))
            if not self.ready_sent:
                # Type=notify: the service is up once a child can generate.
                self.ready_sent = self.notifier.notify("READY=1")
            if child.sighup_held:
                self.forward_sighup(child)
        elif self.state == State.UNHEALTHY:
            log.info("child_healthy_again", pid=child.pid)
        self.serving_again(child)

    def serving_again(self, child: Child) -> None:
        """Ready, after a check that passed (or said busy). Not a child being stopped: an HTTP
        thread may have seen it stopping on its own (child_stops_on_its_own) while this check,
        answered just before, was on its way."""
        with self.changed:
            if self.state in (State.STARTING, State.RESTARTING, State.UNHEALTHY) and child.kill_reason is None:
                self.state = State.READY
                self.changed.notify_all()

    def forward_sighup(self, child: Child) -> None:
        """SIGHUP to a guardian child once it serves. A child still starting is not sent
        it: in its first moments, before its handler exists, SIGHUP would end it; it reads
        a file saved meanwhile when its watch begins, and gets the signal once ready."""
        if isinstance(child.proc, LauncherProcess):  # mlx.launch would die of it (LauncherProcess.send_signal)
            log.info("signal_not_forwarded", signal="SIGHUP", pid=child.pid, why="mlx.launch would die of it")
            return
        if child.ready_at is None:
            child.sighup_held = True
            log.info("signal_held", signal="SIGHUP", pid=child.pid, until="the child is ready")
            return
        child.sighup_held = False
        log.info("signal_forwarded", signal="SIGHUP", pid=child.pid)
        signal_quietly(child.proc, signal.SIGHUP)

    def soft_kill(self, reason: str, routine: bool = False) -> None:
        """SIGTERM (and SIGCONT, so a stopped child can act on it); SIGKILL after the grace:
        ``kill_grace_s``, or when stopping for good, the child's drain (``exit_grace_s``) and
        a moment for its last answers, if that is longer. ``routine``: logged at info (an
        idle child's stop), not as a warning."""
        child = self.child
        grace_s = self.settings.kill_grace_s
        if self.exit_code is not None:
            grace_s = max(grace_s, self.core.exit_grace_s + LAST_ANSWERS_S)
        # Decided under the lock, as child_stops_on_its_own decides on an HTTP thread: a child
        # it saw stopping on its own is left to its drain, which a SIGTERM now would end.
        with self.changed:
            if child.stopped_on_its_own:
                return
            child.kill_reason = reason
            child.soft_killed_at = time.monotonic()
            child.hard_kill_at = child.soft_killed_at + grace_s
            if self.exit_code is None:
                self._change_state(State.RESTARTING, now=child.soft_killed_at)
        (log.info if routine else log.warning)("child_stopping", pid=child.pid, reason=reason, grace_s=grace_s)
        # Like systemd: a SIGSTOPped process only sees SIGTERM once continued.
        for signum in (signal.SIGTERM, signal.SIGCONT):
            signal_quietly(child.proc, signum)

    def child_stops_on_its_own(self, child: Child, seen: str) -> None:
        """A child that stops by its own doing, not the supervisor's (a signal sent to it,
        its engine given up; ``seen``: how that was seen), is taken as one being replaced:
        requests wait for the next child rather than get its 503 server_stopping, and no
        health check sends it a second SIGTERM, which would end its drain. SIGKILL if its
        drain outlasts the grace. Whether its end was a crash is judged by its exit code
        (``crashed``). Called by the main loop and by HTTP threads."""
        now = time.monotonic()
        grace_s = max(self.settings.kill_grace_s, self.core.exit_grace_s + LAST_ANSWERS_S)
        with self.changed:
            if self.child is not child or child.kill_reason is not None or self.exit_code is not None:
                return
            child.soft_killed_at, child.hard_kill_at = now, now + grace_s
            child.stopped_on_its_own = True
            child.kill_reason = f"it is stopping on its own ({seen})"
            self._change_state(State.RESTARTING, now=now)
        log.warning("child_stopping", pid=child.pid, reason=child.kill_reason, grace_s=grace_s)
        self.signals.put(signal.SIGCHLD)  # the main loop's wait: its grace, not a health check

    def hard_kill(self, why: str = "after the grace") -> None:
        """SIGKILL: the child did not stop within the grace (``soft_kill``'s), or a stop was asked for again."""
        child = self.child
        grace_s = None if child.hard_kill_at is None else round(child.hard_kill_at - child.soft_killed_at, 3)
        log.error("child_hard_killed", pid=child.pid, reason=child.kill_reason, why=why, grace_s=grace_s)
        child.hard_kill_why = why
        child.hard_killed = True
        signal_quietly(child.proc, signal.SIGKILL)

    def set_state(self, state: str) -> None:
        """Change state; leaving the serving states starts an outage (logged as downtime)."""
        with self.changed:
            self._change_state(state)

    def _change_state(self, state: str, now: Optional[float] = None) -> None:
        """``set_state`` for a caller that holds ``changed`` (whose lock is no RLock): one that
        decides on the state and changes it in one hold."""
        if self.state in SERVING and state not in SERVING:
            self.outage_started = time.monotonic() if now is None else now
        self.state = state
        self.changed.notify_all()

    # -- exit ------------------------------------------------------------------
    def finish(self) -> int:
        """Let in-flight requests reach their clients, close the port, return the code.
        The wait is the rest of ``exit_grace_s`` from the stop (the child's drain took its
        part; a moment more for answers the supervisor writes), unless a signal comes again."""
        since = self.stopping_since if self.stopping_since is not None else time.monotonic()
        deadline = max(since + self.core.exit_grace_s, time.monotonic() + LAST_ANSWERS_S)
        while self.in_flight.active and time.monotonic() < deadline and not self.asked_again:
            for signum in self.wait_for_signals(0.02):  # a bounded pause that still drains the queue
                if signum in (signal.SIGTERM, signal.SIGINT) and time.monotonic() - since >= SAME_STOP_S:
                    self.asked_again = True
        self.httpd.shutdown()
        self.httpd.server_close()
        log.info("supervisor_stopped", exit_code=self.exit_code, restarts=self.restarts,
                 unanswered=self.in_flight.active)
        return self.exit_code

    # -- for the public side (HTTP threads) -------------------------------
    def serving_child(self, health_check: bool = False) -> Optional[Child]:
        """The child requests go to, or None while no child can take them.

        Health checks go to a READY child only: one that stopped answering
        them would leave the caller's check hanging instead of failing.
        """
        with self.lock:
            if health_check:
                return self.child if self.state == State.READY else None
            return None if self.holds() else self.serving()

    def serving(self) -> Optional[Child]:
        """The child, if requests go to it (under ``lock``). None too for a child just reaped,
        whose state changes next (``reap_child``)."""
        child = self.child
        return child if self.state in SERVING and child is not None and child.answered else None

    def holds(self) -> bool:
        """Whether requests wait now for a child that is coming or answers again (under ``lock``):
        a child just reaped too, whose state changes next (``reap_child``)."""
        child = self.child
        return self.state in HOLDING or (self.state in SERVING and (child is None or not child.answered))

    def wait_for_child(self, given_up: Callable[[], bool] = lambda: False,
                       until: Optional[float] = None, client: Optional[str] = None):
        """The child requests go to; while one is coming (starting, restarting), wait for it.

        At most ``hold_requests`` wait at once, each at most ``hold_s``;
        None when no child can take the request (the caller answers 503).
        ``given_up()``: its client left (``changed`` is notified then); it waits no more.
        ``until`` (monotonic): the request's deadline, which ends the wait sooner (None
        then, and the caller answers 504). ``client``: who sent it, as the door named it;
        one that has ``[access] client_max_concurrent`` requests held already gets
        ``OVER_CLIENT_SHARE`` (the caller answers 429, as the child would): one client
        took every place while a child started, and everyone else got 503 (a review).
        """
        refused = None
        with self.changed:
            if self.state == State.IDLE and self.exit_code is None:  # [supervisor] idle_stop_s: wake it
                self.state = State.STARTING
                self.outage_started = time.monotonic()  # its downtime: this request's wait
                self.changed.notify_all()
                self.signals.put(WAKE_CHILD)
            if self.holds():
                share = self.door.settings.client_max_concurrent
                if self.holding >= self.settings.hold_requests:
                    refused = "hold_queue_full"
                elif client is not None and share and self.held_by_client.get(client, 0) >= share:
                    refused = "client_share"
                else:
                    self.holding += 1
                    self.held_by_client[client] = self.held_by_client.get(client, 0) + 1
                    try:
                        hold_ends = time.monotonic() + self.settings.hold_s
                        ends = hold_ends if until is None else min(hold_ends, until)
                        if not self.changed.wait_for(lambda: not self.holds() or given_up(),
                                                     ends - time.monotonic()):
                            if ends < hold_ends:
                                return None  # its deadline came first
                            refused = "hold_timed_out"
                    finally:
                        self.holding -= 1
                        self.held_by_client[client] -= 1
                        if not self.held_by_client[client]:
                            del self.held_by_client[client]
                    if given_up():
                        return None
            child = self.serving()
            holding = self.holding
        if refused:
            self.metrics.requests_not_held.labels(refused).inc()
            log.warning("request_not_held", reason=refused, state=self.state, holding=holding,
                        hold_requests=self.settings.hold_requests, hold_s=self.settings.hold_s)
            if refused == "client_share":
                return OVER_CLIENT_SHARE
        return child

    def wait_reaped(self, child: Child, given_up: Callable[[], bool] = lambda: False,
                    until: Optional[float] = None) -> bool:
        """Wait until ``child`` is reaped (its crash, if any, struck what it had); False if it
        lives on past ``reap_wait_s``, or the wait ended first: at ``until`` (monotonic, the
        request's deadline) or as ``given_up()`` (its client left; ``changed`` is notified)."""
        ends = time.monotonic() + self.settings.reap_wait_s
        if until is not None:
            ends = min(ends, until)
        with self.changed:
            return self.changed.wait_for(lambda: self.child is not child or given_up(),
                                         ends - time.monotonic()) and self.child is not child

    def unavailable_health(self, reason: Optional[str] = None) -> dict:
        """The 503 body of /health and /readyz when the child's own answer cannot be used;
        ``reason`` by default the supervisor's state in words, as a child's /readyz says it."""
        child = self.child
        state = self.state
        return {"status": "unavailable", "state": state, "reason": reason or STATE_REASONS.get(state, state),
                "last_check": None if child is None else child.last_check}

    def unavailable_error(self) -> GuardianError:
        """What a request gets while no child can serve it."""
        state = self.state
        if state == State.FAILED:
            return GuardianError("The engine is not running and will not be restarted; "
                                 "the server is exiting to be restarted.",
                                 status=503, code="engine_failed", retry_after_s=self.core.retry_after_s)
        if state == State.STOPPING:
            return GuardianError("The server is stopping.", status=503, code=SERVER_STOPPING,
                                 retry_after_s=self.core.retry_after_s)
        return GuardianError(f"The engine is {state}; retry the request.", status=503,
                             code="engine_restarting", retry_after_s=self.core.retry_after_s)

    def isolation_busy_error(self) -> GuardianError:
        """What a crash suspect gets that waited its turn to run alone in vain."""
        return GuardianError("This request was in flight when the engine crashed, and runs alone until it is "
                             "cleared; another such request runs alone now. Retry the request.",
                             status=503, code="crash_check_busy", retry_after_s=self.core.retry_after_s)

    @staticmethod
    def dropped_request_error() -> GuardianError:
        """What a request gets whose child closed its connection without an answer and lives on."""
        return GuardianError("The engine closed the connection without an answer, and still runs: the "
                             "request may be one it cannot serve.", status=502, type="server_error",
                             code="engine_dropped_request", retry=False)

    def lost_child_error(self) -> GuardianError:
        """What a request gets when the child died under it."""
        if self.state in (State.STOPPING, State.FAILED):
            return self.unavailable_error()
        return GuardianError("The engine process stopped while answering; retry the request.",
                             status=503, code="engine_restarting", retry_after_s=self.core.retry_after_s)

    def status(self) -> dict:
        """/guardian/supervisor: the child, the state, restarts, the last exit."""
        child = self.child
        now = time.monotonic()
        return {
            "state": self.state,
            "engine": self.settings.engine,
            "pid": os.getpid(),
            "child": None if child is None else {
                "pid": child.pid,
                "port": child.port,
                "generation": child.generation,
                "uptime_s": round(now - child.started_at, 3),
                "ready": child.ready_at is not None,
                "last_check": child.last_check,
                "answers_checks": child.answered,
                # Its memory group's count of OOM kills, as last taken (guardian.supervise.oom_kills).
                "oom_counter": child.oom_counter,
                "requests_completed": child.requests_completed,
                "stopping_because": child.kill_reason,
            },
            "restarts": self.restarts,
            "restarts_in_window": self.restart_times.count(),
            "pauses": self.pauses,
            "paused_s": round(self.paused_s, 3),
            "max_restarts": self.settings.max_restarts,
            "last_exit": self.last_exit,
            "in_flight": self.in_flight.active,
            "holding": self.holding,
            "quarantine": self.quarantine.status(),
            "connections": self.httpd.connection_status() if self.httpd is not None else None,
            "access": self.door.status(),
            # The file's settings changed since the supervisor started that it reads at start only.
            "config_pending_restart": list(self.pending_restart),
            # The version of the file (its bytes' sha256) whose settings the supervisor acts on
            # now, as the child's /guardian/status "config" says of its own; None: no file.
            "config_sha256": self.config_sha256,
            # Why the last version of the file was refused here (with --engine stock, the only
            # word on it but the log); None while the file's version is in force.
            "config_last_failure": self.config_last_failure,
        }


def response_json(response: httpx.Response) -> dict:
    """A child's answer to a health check, read once (its /readyz says why not ready, and how
    many users' requests it completed); {} if it is no JSON object."""
    try:
        said = response.json()
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


class PauseWatch:
    """A thread that ticks every ``TICK_S`` and keeps the longest it went without running
    past that: only a pause of the whole process (SIGSTOP, a frozen VM) makes one of a
    second, not a slow child the main loop waits on."""

    TICK_S = 0.25

    def __init__(self):
        self._longest = (0.0, 0.0)  # (seconds, when it ended)
        self._last_tick = time.monotonic()
        threading.Thread(target=self._tick, name="pause-watch", daemon=True).start()

    def _tick(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            now = time.monotonic()
            if now - self._last_tick - self.TICK_S > self._longest[0]:
                self._longest = (now - self._last_tick - self.TICK_S, now)
            self._last_tick = now

    def take(self) -> tuple[float, float]:
        """The longest pause since the last take, and when it ended (monotonic). A pause
        the ticking thread has not run since (the main thread ran first after it) is one
        too: it ends now."""
        now = time.monotonic()
        ongoing = now - self._last_tick - self.TICK_S
        longest, self._longest = self._longest, (0.0, 0.0)
        return (ongoing, now) if ongoing > longest[0] else longest


def main(argv: Optional[list[str]] = None) -> int:
    parser = make_parser()
    options, child_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    abbreviated = abbreviated_flag(parser, child_args)
    if abbreviated is not None:
        parser.error(abbreviated)  # exit 2, as for any flag it cannot take
    piped, pipe_copy = options.guardian_config, None
    try:
        if piped is not None and read_once(piped):
            pipe_copy, options.guardian_config = copy_of_a_pipe(piped)
        settings, core = read_settings(options)
        door = public_door(options, child_args)  # a key file that does not parse stops here
    except ConfigError as e:
        configure_logging(options.log_format or CoreSettings.log_format.default, options.log_level or "INFO")
        log.critical("config_invalid", error_message=str(e))
        print(f"mlx-guardian: {e}", file=sys.stderr)
        return EXIT_USAGE
    # As a guardian's: [guardian] log_level, when set, wins over --log-level (read at start here).
    configure_logging(core.log_format, core.log_level or options.log_level or "INFO")
    if pipe_copy is not None:
        log.warning("config_file_read_once", file=piped,
                    why="not a regular file (a pipe): read once at start; every child reads its copy, "
                        "and no save or SIGHUP is read")
    with pipe_copy or contextlib.nullcontext():  # the copy goes as the supervisor ends
        if settings.engine == "stock" and not names_a_model(child_args):
            # As the guardian serves its demo model when given none: stock would start, answer
            # its health checks, and fail every completion (404, "expected str ... not NoneType").
            try:
                model = demo_model()
            except DemoModelUnavailable as e:
                log.critical("model_load_failed", model="demo", error_message=str(e))
                print(f"mlx-guardian: {e}", file=sys.stderr)
                return EXIT_BOOT_ERROR
            child_args = ["--model", model, *child_args]  # first: any flag of the user's comes after it
            log.info("demo_model_selected", model=model)
        return Supervisor(options, child_args, settings, core, door=door).run()


if __name__ == "__main__":
    raise SystemExit(main())

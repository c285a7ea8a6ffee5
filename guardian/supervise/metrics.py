"""The supervisor's ``GET /metrics`` on the public port, the child's engine metrics after its own.

The supervisor counts what only it sees: children restarted (and why),
requests held while no child was ready, relays a child broke, requests sent
again; its state and the child's are read at scrape time. A guardian child's
own /metrics (the engine: restarts, tokens, memory, ...) is fetched from its
private port and appended, so one scrape target sees both processes; the
two never share a metric name (``mlx_guardian_supervisor_`` here). A child
that is not running or serving yet, or does not answer within the health
check's timeout (``health_timeout_s``, 5 s at most), is left out and
``mlx_guardian_supervisor_child_metrics_up`` says 0; an unhealthy one's are
passed on. Imports neither mlx nor mlx_lm.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

from prometheus_client import Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from guardian.observability import metrics
from guardian.observability.metrics import gauge
from guardian.access.policy import REFUSALS as ACCESS_REFUSALS
from guardian.exit_codes import EXIT_ENGINE_FAILED, EXIT_ENGINE_STALLED, EXIT_GROUP_FAILED
from guardian.supervise.child import CHILD_GONE_ERRORS

P = metrics.PREFIX + "supervisor_"
# The classic text format, asked of the child too: two expositions in it can
# be concatenated (OpenMetrics ends each with "# EOF").
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SupervisorMetrics:
    """The supervisor's counters, and its scrape."""

    def __init__(self, supervisor):
        self.supervisor = supervisor
        self.registry = r = metrics.new_registry()
        self.child_restarts = Counter(
            P + "child_restarts", "Children replaced, by why the last one went: the signal that killed it "
            "(SIGKILL, SIGSEGV, ...; oom_killed for the kernel's OOM killer), exit_N for its exit code, or "
            "unhealthy / start_timeout when the supervisor stopped it.", ["reason"], registry=r)
        # The commonest, 0 until the first (so increase() sees it); others appear when they happen.
        for reason in ("SIGKILL", "oom_killed", "SIGSEGV", "SIGBUS", "SIGABRT", f"exit_{EXIT_ENGINE_FAILED}",
                       f"exit_{EXIT_ENGINE_STALLED}", f"exit_{EXIT_GROUP_FAILED}", "unhealthy", "start_timeout"):
            self.child_restarts.labels(reason)
        self.requests_not_held = Counter(
            P + "requests_not_held", "Requests not held while no child was ready, by why: "
            "hold_queue_full, hold_timed_out (503), client_share (429: the client had [access] "
            "client_max_concurrent held already).", ["reason"], registry=r)
        for reason in ("hold_queue_full", "hold_timed_out", "client_share"):
            self.requests_not_held.labels(reason)
        self.requests_deadline_exceeded = Counter(
            P + "requests_deadline_exceeded", "Requests whose deadline the supervisor answered: passed "
            "while no child had them (held for one that was starting, or between a child that died under "
            "them and the next), or kept by no child (relayed, a frozen child's: relay_cut_past_deadline): "
            "answered 504 deadline_exceeded, or a stream's error event.", registry=r)
        self.relay_errors = Counter(
            P + "relay_errors", "Relays to a child that failed, by when: before_response (nothing was "
            "sent to the client) or during_response.", ["stage"], registry=r)
        for stage in ("before_response", "during_response"):
            self.relay_errors.labels(stage)
        self.requests_resent = Counter(
            P + "requests_resent", "Requests sent again to the next child after theirs died: a request "
            "not yet answered, or a stream continued after the tokens its client has; counted when "
            "a child takes it (one given up while held is not).", ["kind"], registry=r)
        for kind in ("request", "stream"):
            self.requests_resent.labels(kind)
        self.requests_passed = Counter(
            P + "requests_passed", "Requests passed to a child, by how: handed_off (the child answered "
            "on the client's connection, guardian.handoff) or relayed (every byte through the "
            "supervisor).", ["how"], registry=r)
        # Counted for every request: the children looked up once.
        self.passed_handed_off = self.requests_passed.labels("handed_off")
        self.passed_relayed = self.requests_passed.labels("relayed")
        self.requests_refused = Counter(
            P + "requests_refused", "Requests the crash quarantine turned away before any child saw them, "
            "by code: request_quarantined (struck by two child crashes; 500) or crash_check_busy (a crash "
            "suspect that waited in vain to run alone; 503). The child's own refusals are in "
            "mlx_guardian_requests_refused_total.", ["code"], registry=r)
        for code in ("request_quarantined", "crash_check_busy"):
            self.requests_refused.labels(code)
        self.access_refused = Counter(
            P + "access_refused", "Requests the public port's door refused, by reason: invalid_api_key, "
            "protected_mode, host_not_allowed, origin_not_allowed.", ["reason"], registry=r)
        for reason in ACCESS_REFUSALS:
            self.access_refused.labels(reason)
        self.child_metrics_up = Gauge(
            P + "child_metrics_up", "Whether this scrape includes the child's engine metrics.", registry=r)
        r.register(SupervisorCollector(supervisor))
        # Its own memory, CPU and descriptors, beside the child's process_* (a supervisor that
        # leaks showed nowhere): mlx_guardian_supervisor_process_resident_memory_bytes, ...
        metrics.register_process_metrics(r, namespace=P.rstrip("_"))
        r.register(metrics.ConnectionCollector(
            lambda: supervisor.httpd.connection_status() if supervisor.httpd is not None else None, P))

    def child_restarted(self, dead) -> None:
        """Count a restart, labelled by how ``dead`` (the child replaced) went."""
        self.child_restarts.labels(restart_reason(dead)).inc()

    def exposition(self) -> bytes:
        """The supervisor's metrics, then the ready child's own, if it answers in time."""
        child_text = self.child_exposition()
        self.child_metrics_up.set(child_text is not None)
        own = generate_latest(self.registry)
        return own + child_text if child_text else own

    def child_exposition(self) -> Optional[bytes]:
        """The running child's metrics, whatever its health: an unhealthy child's are
        what an alert on its engine's state reads (a child not yet serving refuses the
        connection at once; a frozen one costs the scrape the health check's timeout at most)."""
        supervisor = self.supervisor
        child = supervisor.child
        if child is None or child.hard_killed or child.proc.poll() is not None or not child.has_readyz:
            return None  # (stock has no /metrics)
        try:
            response = child.client.get("/metrics", headers={"Accept": CONTENT_TYPE},
                                        timeout=supervisor.health_timeout)
        except CHILD_GONE_ERRORS:
            return None
        if response.status_code != 200:  # the metrics plugin is disabled in the child
            return None
        return response.content


class SupervisorCollector:
    """Gauges read at scrape time from the supervisor's own status."""

    def __init__(self, supervisor):
        self.supervisor = supervisor

    def collect(self):
        supervisor = self.supervisor
        from guardian.supervise.state import State  # the supervisor imports this module

        state = GaugeMetricFamily(P + "state", "The supervisor's state: 1 for the current one.", labels=["state"])
        for value in (State.STARTING, State.READY, State.UNHEALTHY, State.RESTARTING, State.STOPPING, State.FAILED,
                      State.IDLE):
            state.add_metric([value], float(supervisor.state == value))
        yield state
        child = supervisor.child
        yield gauge(P + "child_up", "Whether a child is running and passed its last health check.",
                    child is not None and supervisor.state == State.READY)
        if child is not None:
            yield gauge(P + "child_uptime_seconds", "Since the running child started.", time.monotonic() - child.started_at)
        yield gauge(P + "requests_held", "Requests waiting now for a child to be ready.", supervisor.holding)
        yield gauge(P + "requests_in_flight", "Requests the supervisor has taken and not yet answered: "
                    "handed off, relayed, or held for a child (requests_held counts those alone).",
                    supervisor.in_flight.active)
        yield gauge(P + "restarts_in_window", "Child restarts within the crash-loop window "
                    "(the supervisor gives up past max_restarts).", supervisor.restart_times.count())
        yield CounterMetricFamily(P + "pauses", "Times the supervisor itself did not run for a second or "
                                  "more (SIGSTOP of its group, a frozen cgroup or VM): no child was blamed.",
                                  value=supervisor.pauses)
        yield CounterMetricFamily(P + "paused_seconds", "How long those pauses lasted, in all.",
                                  value=supervisor.paused_s)
        quarantine = supervisor.quarantine.status()
        yield gauge(P + "quarantined_requests", "Requests struck by two child crashes, refused at the door "
                    "until their quarantine ends.", quarantine.get("quarantined_count", 0))


def restart_reason(dead) -> str:
    """A label with few values for how a child went: a signal's name (oom_killed: the
    kernel's OOM killer's SIGKILL), exit_N, or the supervisor's own kill (start_timeout,
    unhealthy)."""
    if dead.hard_killed or dead.stopped_by_supervisor:
        return "start_timeout" if dead.ready_at is None else "unhealthy"
    code = dead.proc.returncode
    if dead.out_of_memory:
        return "oom_killed"
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal_{-code}"
    return f"exit_{code}"

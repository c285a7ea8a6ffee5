"""Prometheus metrics for ``GET /metrics``, from the observer hooks.

A built-in plugin: counters and histograms move when a hook reports
something (a restart, a stall, a probe, an admission decision, a request
that ended), and gauges are read when Prometheus scrapes (the engine's
state and queues, the prompt cache, mlx's memory), so nothing is sampled
on a timer and the engine never calls into metrics. The registry is this
plugin's own (guardian.observability.metrics): one per server, never the global one.
Disable it with ``[guardian] disabled_plugins = ["metrics"]``; /metrics
then answers 404.

Names follow Prometheus' conventions: the ``mlx_guardian_`` prefix, the
unit last (``_seconds``, ``_bytes``), ``_total`` on counters. Label values
are few by construction: error codes, classifications, rungs, probe names.
"""

from __future__ import annotations

import threading
from typing import Optional

import mlx.core as mx
from prometheus_client import Counter, Histogram, PlatformCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

import guardian
from guardian.observability import metrics
from guardian.observability.metrics import gauge
from guardian.access.policy import REFUSALS as ACCESS_REFUSALS
from guardian.admission.facts import device_info, device_memory
from guardian.engine.lifecycle import EngineState
from guardian.engine.record import CANCELLED, COMPLETED, FAILED
from guardian.engine.failures import CLASSIFICATIONS
from guardian.config.registry import ACTIONS

P = metrics.PREFIX

# Seconds. A first token waits for admission, the queue and the prefill: a
# long prompt on a big model takes minutes. Between tokens: one decode step.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A request taken at the next step waits milliseconds; behind a full batch, a request's length.
QUEUE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TIME_BETWEEN_TOKENS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15,
                               0.2, 0.3, 0.5, 1, 2.5, 5, 10)
# A restart takes milliseconds on the loaded weights, seconds with a reload or a backoff.
RESTART_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PROBE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# The engine's request counts (EngineView.status()), each a gauge: together
# they are every request between the door and its last token.
REQUEST_GAUGES = {
    "arriving": ("requests_admitting", "Requests being admitted on their HTTP threads, not yet queued."),
    "waiting_for_memory": ("requests_waiting_for_memory",
                           "Requests waiting at admission for KV cache memory the running ones must free."),
    "queued": ("requests_queued", "Requests queued for the engine, not yet taken by its loop."),
    "rerun_queued": ("requests_rerun_queued", "Requests queued again after an engine failure or stall."),
    "in_flight": ("requests_in_flight", "Requests the engine's loop has taken: prefilling or decoding (probes included)."),
}


class Metrics:
    name = metrics.PLUGIN_NAME

    def __init__(self):
        self.registry = metrics.new_registry()
        self.engine = None  # the EngineView, from guardian_startup
        self._device_limit: Optional[tuple[int, str]] = None
        self._device_resource_limit: Optional[int] = None
        self._last_probes: dict[str, dict] = {}
        self._lock = threading.Lock()
        r = self.registry
        self.restarts = Counter(
            P + "engine_restarts", "Engine restarts, by the classification of the failure that caused them "
            "(stall: a stuck loop was replaced).", ["classification"], registry=r)
        for classification in ("stall", *CLASSIFICATIONS):  # 0 until the first, so increase() sees it
            self.restarts.labels(classification)
        self.restart_seconds = Histogram(
            P + "engine_restart_duration_seconds", "From an engine failure or stall to the new loop "
            "polling for work (a crash loop's backoff included).", buckets=RESTART_BUCKETS, registry=r)
        self.stalls = Counter(P + "engine_stalls", "Stalls the watchdog saw, by the ladder's rung taken.",
                              ["rung"], registry=r)
        for rung in ACTIONS:  # known in advance: 0 until the first, so rate() sees the first
            self.stalls.labels(rung)
        self.pauses = Counter(P + "process_pauses", "Pauses of the whole process the watchdog saw (its "
                              "look came late by more than the shortest stall limit): no engine was blamed.",
                              registry=r)
        self.paused_seconds = Counter(P + "process_paused_seconds", "How long those pauses lasted, in all.",
                                      registry=r)
        self.probes = Counter(P + "probes", "Probe results, by probe and result (ok, failed).",
                              ["probe", "result"], registry=r)
        self.probe_seconds = Histogram(P + "probe_duration_seconds", "How long each probe took.",
                                       ["probe"], buckets=PROBE_BUCKETS, registry=r)
        self.door_refused = Counter(P + "access_refused", "Requests the door refused (any path), by "
                                    "reason: invalid_api_key, protected_mode, host_not_allowed, "
                                    "origin_not_allowed.", ["reason"], registry=r)
        for reason in ACCESS_REFUSALS:
            self.door_refused.labels(reason)
        self.by_key = Counter(P + "api_key_requests", "Requests let in with an API key, by the key's "
                              "name (never the key).", ["api_key"], registry=r)
        self.admitted = Counter(P + "requests_admitted", "Completion requests let in at the door.", registry=r)
        self.refused = Counter(P + "requests_refused", "Completion requests turned away at the door, by the "
                               "error code their client got (a body refused unread or unparsed, 413 "
                               "request_too_large or 400 invalid_json, is not counted).", ["code"], registry=r)
        self.failed = Counter(P + "requests_failed", "Requests the engine had queued that ended with an "
                              "error instead of a completion, by error code.", ["code"], registry=r)
        self.finished = Counter(P + "requests_finished", "Requests the engine had queued that ended, by "
                                "outcome (completed; failed: with an error, a deadline's 504 too; "
                                "cancelled: the client left).", ["outcome"], registry=r)
        for outcome in (COMPLETED, FAILED, CANCELLED):
            self.finished.labels(outcome)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of the requests that ended.", registry=r)
        self.cached_prompt_tokens = Counter(P + "prompt_tokens_cached", "Of those prompt tokens, the ones "
                                            "the prompt cache spared the prefill.", registry=r)
        self.generated_tokens = Counter(P + "generation_tokens", "Tokens the engine generated, those of "
                                        "runs a failure discarded included.", registry=r)
        self.time_to_first_token = Histogram(
            P + "time_to_first_token_seconds", "From when the server took a request (admission and queue "
            "included) to its first token.", buckets=TIME_TO_FIRST_TOKEN_BUCKETS, registry=r)
        self.time_between_tokens = Histogram(
            P + "time_between_tokens_seconds", "Gaps between a request's consecutive tokens.",
            buckets=TIME_BETWEEN_TOKENS_BUCKETS, registry=r)
        self.queue_time = Histogram(
            P + "request_queue_time_seconds", "From when the engine queued a request (let in at the door) "
            "to when stock's loop first took it.", buckets=QUEUE_TIME_BUCKETS, registry=r)
        r.register(EngineCollector(self))
        # The process' own: resident memory, CPU, open files; Python's version.
        metrics.register_process_metrics(r)
        PlatformCollector(registry=r)

    # -- lifecycle ---------------------------------------------------------------
    @guardian.hookimpl
    def guardian_startup(self, engine):
        self.engine = engine
        # Fixed for the process: read once, not at every scrape.
        self._device_limit = device_memory()
        self._device_resource_limit = device_info().get("resource_limit")

    # -- counters --------------------------------------------------------------------
    @guardian.hookimpl
    def on_engine_restarted(self, duration_s, classification):
        self.restarts.labels(classification or "unknown").inc()
        self.restart_seconds.observe(duration_s)

    @guardian.hookimpl
    def on_stall(self, action):
        self.stalls.labels(action).inc()

    @guardian.hookimpl
    def on_process_paused(self, paused_s):
        self.pauses.inc()
        self.paused_seconds.inc(paused_s)

    @guardian.hookimpl
    def on_probe_result(self, results):
        for result in results:
            name = str(result.get("name", "unnamed"))
            self.probes.labels(name, "ok" if result.get("ok") else "failed").inc()
            if result.get("duration_ms") is not None:
                self.probe_seconds.labels(name).observe(result["duration_ms"] / 1000)
            with self._lock:
                self._last_probes[name] = result

    @guardian.hookimpl
    def on_access_decision(self, decision):
        if decision.error is not None:
            self.door_refused.labels(decision.error.code or str(decision.error.status)).inc()
        elif decision.key_name is not None:
            self.by_key.labels(decision.key_name).inc()

    @guardian.hookimpl
    def on_admission_decision(self, error):
        if error is None:
            self.admitted.inc()
        else:
            self.refused.labels(error.code or str(error.status)).inc()

    @guardian.hookimpl
    def on_request_failed(self, error):
        self.failed.labels(error.code or str(error.status)).inc()

    @guardian.hookimpl
    def on_request_finished(self, outcome, prompt_tokens, cached_prompt_tokens, generated_tokens,
                            time_to_first_token_s, time_between_tokens_s, queue_time_s):
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_prompt_tokens)
        self.generated_tokens.inc(generated_tokens)
        if time_to_first_token_s is not None:
            self.time_to_first_token.observe(time_to_first_token_s)
        if queue_time_s is not None:
            self.queue_time.observe(queue_time_s)
        observe = self.time_between_tokens.observe
        for gap in time_between_tokens_s:
            observe(gap)
        # Last: a scrape that sees the request finished sees its tokens too.
        self.finished.labels(outcome).inc()

    def last_probes(self) -> dict[str, dict]:
        with self._lock:
            return dict(self._last_probes)


class EngineCollector:
    """The gauges read at scrape time: the engine's state and queues, the prompt
    cache, the quarantine, mlx's memory and the device's limit."""

    def __init__(self, plugin: Metrics):
        self.plugin = plugin

    def collect(self):
        yield from self.memory()
        engine = self.plugin.engine
        if engine is None:  # before start-up: the engine is not serving yet
            return
        status = engine.status()
        info = InfoMetricFamily(P + "build", "Versions of what serves.")
        info.add_metric([], {"mlx_lm_version": str(status.get("mlx_lm_version")), "mlx_version": mx.__version__})
        yield info
        state = GaugeMetricFamily(P + "engine_state", "The engine's state: 1 for the current one.", labels=["state"])
        for value in EngineState:
            state.add_metric([value.value], float(status["state"] == value.value))
        yield state
        yield CounterMetricFamily(P + "engine_steps", "Engine steps since the process started.",
                                  value=status["steps"])
        cancelled = CounterMetricFamily(P + "requests_cancelled", "Requests ended before their answer, by "
                                        "reason: client_left (it closed its connection, or stopped "
                                        "reading; while it waited at admission for KV memory too), "
                                        "deadline. Probes are not counted.", labels=["reason"])
        for reason, count in sorted(status.get("requests_cancelled", {}).items()):
            cancelled.add_metric([reason], count)
        yield cancelled
        yield CounterMetricFamily(P + "tokens_after_disconnect", "Tokens the engine generated for requests "
                                  "already cancelled (their client left, or their deadline passed): about "
                                  "one for each cancelled while decoding (stock's step under way when it was "
                                  "cancelled; at times the one after it, which stock had begun), two at most.",
                                  value=status.get("tokens_after_cancel", 0))
        yield gauge(P + "engine_heartbeat_age_seconds",
                    "Since the engine's loop last stepped, reported progress or polled for work.",
                    status["heartbeat_age_s"])
        yield gauge(P + "engine_failures_in_window", "Engine failures the crash-loop budget counts now "
                    "(those without progress since the previous failure).", status["failures_in_window"])
        yield from self.failures(status)
        yield gauge(P + "engine_abandoned_loop_threads", "Loop threads a stall replaced that are still alive: "
                    "stuck in a step, or parked once it returned.", status.get("abandoned_loop_threads", 0))
        for key, (name, documentation) in REQUEST_GAUGES.items():
            yield gauge(P + name, documentation, status.get(key, 0))
        sequences, cache_bytes = engine.prompt_cache_usage()
        yield gauge(P + "prompt_cache_sequences", "Sequences held by the prompt cache.", sequences)
        yield gauge(P + "prompt_cache_bytes", "Bytes held by the prompt cache.", cache_bytes)
        quarantine = status.get("quarantine") or {}
        yield gauge(P + "quarantined_requests", "Fingerprints of requests blamed for an engine failure, "
                    "refused at the door until their quarantine ends.", quarantine.get("quarantined_count", 0))
        yield from self.group(status.get("group"))
        yield from self.probes()

    @staticmethod
    def group(group: Optional[dict]):
        """Under mlx.launch: each other rank, by when its control connection was last heard
        (beats ten times a peer timeout; a rank past peer_timeout_s is lost)."""
        if group is None:
            return
        yield gauge(P + "group_ranks", "Ranks in this mlx.launch group.", group["size"])
        heard = GaugeMetricFamily(P + "group_peer_last_heard_seconds", "Since each other rank's control "
                                  "connection was last heard (its beats come ten times a peer_timeout_s).",
                                  labels=["rank"])
        for peer in group["peers"]:
            heard.add_metric([str(peer["rank"])], peer["last_heard_s"])
        yield heard

    @staticmethod
    def failures(status: dict):
        """Engine failures by whether the engine progressed before them, the time
        they cost, and whether it is degraded (serving while it fails often)."""
        total = status.get("failures_total", 0)
        after_progress = status.get("failures_after_progress", 0)
        family = CounterMetricFamily(P + "engine_failures", "Engine failures, by whether the engine had "
                                     "generated a token or completed a request since the previous one "
                                     "(after_progress: those do not count toward the crash loop).",
                                     labels=["after_progress"])
        family.add_metric(["true"], after_progress)
        family.add_metric(["false"], total - after_progress)
        yield family
        yield CounterMetricFamily(P + "engine_failures_forgiven", "Engine failures no longer counted toward "
                                  "the crash loop because a request was blamed for them (guardian.engine.blame).",
                                  value=status.get("failures_forgiven", 0))
        yield CounterMetricFamily(P + "engine_failure_time_lost_seconds", "From each engine failure to the "
                                  "restarted loop polling for work (backoff included).",
                                  value=status.get("time_lost_s", 0.0))
        yield gauge(P + "engine_failures_recent", "Engine failures within recovery.window_s, of any kind.",
                    status.get("failures_recent", 0))
        yield gauge(P + "engine_degraded", "1 while the engine fails often (more than recovery.max_failures "
                    "within recovery.window_s) but keeps serving between the failures.",
                    float(bool(status.get("degraded"))))

    def memory(self):
        yield gauge(P + "mlx_active_memory_bytes", "Memory mlx has in live arrays.", mx.get_active_memory())
        yield gauge(P + "mlx_cache_memory_bytes", "Memory mlx keeps in its buffer cache for reuse.", mx.get_cache_memory())
        yield gauge(P + "mlx_peak_memory_bytes", "The most memory mlx has had in live arrays.", mx.get_peak_memory())
        yield gauge(P + "mlx_memory_limit_bytes", "mlx's memory limit (mx.get_memory_limit()).", mx.get_memory_limit())
        limit = self.plugin._device_limit
        if limit is not None:
            family = GaugeMetricFamily(
                P + "device_memory_limit_bytes", "The memory the device may use: Metal's recommended "
                "working set, or mlx's limit on the CPU (its control group's where lower); source says which.",
                labels=["source"])
            family.add_metric([limit[1]], limit[0])
            yield family
        if self.plugin._device_resource_limit is not None:
            yield gauge(P + "device_resource_limit", "Metal's limit on live buffers; mlx reports no live count.",
                        self.plugin._device_resource_limit)

    def probes(self):
        last = self.plugin.last_probes()
        if not last:
            return
        family = GaugeMetricFamily(P + "probe_last_success", "Whether each probe's last run passed (1) or failed (0).",
                                   labels=["probe"])
        for name, result in sorted(last.items()):
            family.add_metric([name], float(bool(result.get("ok"))))
        yield family


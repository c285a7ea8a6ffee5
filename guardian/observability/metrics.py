"""``GET /metrics``: one Prometheus registry per server, and its text.

Each server (the in-process guardian, the supervisor) keeps its metrics in a
``CollectorRegistry`` of its own, never prometheus-client's global one, so
two servers in one process (tests, several engines) count apart. In the
in-process server the registry belongs to the built-in ``metrics`` plugin
(guardian/plugins/metrics.py), which fills it from the observer hooks; the
engine knows nothing of metrics. The supervisor's are in guardian/supervise/metrics.py. Imports neither mlx nor mlx_lm: the
supervisor uses it too.
"""

from __future__ import annotations

import resource
from typing import Callable, Optional

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

# Every metric name starts so (Prometheus: one prefix per exporter).
PREFIX = "mlx_guardian_"
# The plugin that owns the in-process server's registry.
PLUGIN_NAME = "metrics"


def new_registry() -> CollectorRegistry:
    """An empty registry for one server."""
    # No ``_created`` series beside every counter and histogram: Prometheus
    # handles counter resets without them, and they double what a scrape holds.
    disable_created_metrics()
    return CollectorRegistry(auto_describe=True)


def registry_of(pm) -> Optional[CollectorRegistry]:
    """The registry of the server whose plugins ``pm`` holds; None if the metrics plugin is disabled."""
    return getattr(pm.get_plugin(PLUGIN_NAME), "registry", None)


def exposition(registry: CollectorRegistry, accept: Optional[str]) -> tuple[bytes, str]:
    """The registry's text and its Content-Type, in the format the scraper asked for
    (Prometheus' text format; OpenMetrics if its Accept header prefers it)."""
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type


def gauge(name: str, documentation: str, value) -> GaugeMetricFamily:
    """A gauge read at scrape time (a collector's), named in full: ``PREFIX + ...``."""
    return GaugeMetricFamily(name, documentation, value=float(value))


def register_process_metrics(registry: CollectorRegistry, namespace: str = "") -> None:
    """The process's own ``process_*`` metrics (resident memory, CPU, open files): from
    prometheus-client's collector where /proc has them (Linux), else from psutil (macOS,
    where that collector reports nothing). ``namespace``: put before each name with an
    underscore, as prometheus-client does (the supervisor's, beside its child's own)."""
    linux = ProcessCollector(namespace=namespace, registry=None)
    registry.register(linux if linux.collect() else PortableProcessCollector(namespace))


class PortableProcessCollector(Collector):
    """prometheus-client's ``process_*`` metrics, with its names and help, read through psutil."""

    def __init__(self, namespace: str = ""):
        self.process = psutil.Process()
        self.prefix = namespace + "_" if namespace else ""

    def collect(self):
        with self.process.oneshot():
            memory = self.process.memory_info()
            cpu = self.process.cpu_times()
            open_fds = self.process.num_fds()
            started = self.process.create_time()
        max_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        p = self.prefix
        yield GaugeMetricFamily(p + "process_virtual_memory_bytes", "Virtual memory size in bytes.", value=memory.vms)
        yield GaugeMetricFamily(p + "process_resident_memory_bytes", "Resident memory size in bytes.", value=memory.rss)
        yield GaugeMetricFamily(p + "process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.", value=started)
        yield CounterMetricFamily(p + "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                                  value=cpu.user + cpu.system)
        yield GaugeMetricFamily(p + "process_open_fds", "Number of open file descriptors.", value=open_fds)
        yield GaugeMetricFamily(p + "process_max_fds", "Maximum number of open file descriptors.", value=max_fds)


class ConnectionCollector(Collector):
    """The connection layer's counts (guardian.serving.connection), read at scrape time
    from ``status()`` (its ``connection_status()``; None: not serving yet): the
    connections it ended before a handler had their request, and what it holds now.
    ``prefix``: the server's (the supervisor's public port has its own)."""

    def __init__(self, status: Callable[[], Optional[dict]], prefix: str = PREFIX):
        self.status = status
        self.prefix = prefix

    def collect(self):
        status = self.status()
        if status is None:
            return
        p = self.prefix
        closed = CounterMetricFamily(
            p + "http_connections_closed", "Connections the server ended before any handler had their "
            "request, by reason: timeout_idle (no byte came; closed), timeout_headers and timeout_body "
            "(408), refused_head (its head refused: 400, 411, 414, 417, 431, 505), buffers_full (no room "
            "for its head or its request among those arriving: 503; 431 or 413 for one larger than all "
            "the room), handlers_busy (no handler free: 503), tls_failed (a TLS port's "
            "connection whose handshake failed, or plain HTTP: 400).", labels=["reason"])
        for reason, count in sorted(status["closed"].items()):
            closed.add_metric([reason], count)
        yield closed
        yield GaugeMetricFamily(p + "http_connections_reading", "Connections whose request is still arriving "
                                "(or that are idle between requests), held by the reader thread.",
                                value=status["held"])
        yield GaugeMetricFamily(p + "http_buffered_bytes", "Bytes of requests still arriving (heads as "
                                "they come, then head and body) that the server has room reserved for "
                                "([http] max_buffered_bytes).",
                                value=status["buffered_bytes"])
        yield GaugeMetricFamily(p + "http_handlers_active", "Handler threads answering a request now.",
                                value=status["handlers_active"])
        yield GaugeMetricFamily(p + "http_handlers_max", "The most handler threads at once ([http] "
                                "max_handlers, or its default); past it, 503.", value=status["max_handlers"])

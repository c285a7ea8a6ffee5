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

from typing import Optional

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

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

"""Resource gauges: mlx's memory counters and what the caches hold.

mlx exposes no live Metal buffer count (``MetalAllocator::num_resources_``
is internal; PRs to expose it were closed), only byte counters and the
static ``resource_limit``. So this samples the bytes, the limit, and the
things the guardian can count that hold buffers: prompt-cache entries and
requests in flight. A future mlx with a real counter can be added here.
"""

from __future__ import annotations

import mlx.core as mx

import guardian


def _device_resource_limit():
    try:
        return mx.device_info().get("resource_limit")
    except Exception:  # older mlx, or a device that does not report it
        return None


class Resources:
    name = "resources"

    @guardian.hookimpl
    def sample_resources(self, engine):
        sequences, cache_bytes = engine.prompt_cache_usage()
        return {
            "active_memory_bytes": mx.get_active_memory(),
            "cache_memory_bytes": mx.get_cache_memory(),
            "peak_memory_bytes": mx.get_peak_memory(),
            "resource_limit": _device_resource_limit(),
            "prompt_cache_sequences": sequences,
            "prompt_cache_bytes": cache_bytes,
            "requests_in_flight": engine.requests_in_flight(),
        }

"""Health: stall detection, probes, readiness and systemd's notify protocol."""

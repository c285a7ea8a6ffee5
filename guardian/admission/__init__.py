"""Admission: what stands between the HTTP handler and the engine's queue."""

"""Engine failures: what each is called."""

from __future__ import annotations


# What ``classify`` answers; plugins may add their own.
CLASSIFICATIONS = ("metal_resource_limit", "out_of_memory", "unknown")


def classify(exc: BaseException) -> str:
    """A stable name for an engine exception: what an operator searches for."""
    text = str(exc)
    if "Resource limit" in text and "metal" in text:
        return "metal_resource_limit"
    if isinstance(exc, MemoryError) or any(
        marker in text.lower()
        for marker in ("out of memory", "insufficient memory", "attempting to allocate")
    ):
        return "out_of_memory"
    return "unknown"

"""The quarantine's one table: fingerprints refused until their time runs out, and the refusal."""

from __future__ import annotations

from datetime import datetime, timezone

from guardian.errors import GuardianError


# Enough of a fingerprint to tell entries apart in logs and status.
FINGERPRINT_PREFIX_CHARS = 12


def short(fingerprint: str) -> str:
    """The fingerprint prefix that logs and status show."""
    return fingerprint[:FINGERPRINT_PREFIX_CHARS]


def utc_iso(wall_time: float) -> str:
    """A wall-clock time as ISO 8601 UTC, to the second."""
    return datetime.fromtimestamp(wall_time, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def quarantine_error(why: str, until_wall: float) -> GuardianError:
    """A 500 that tells the client not to send this request again before ``until_wall``.

    ``why`` says what the request was in on (an engine failure, process crashes).
    """
    until = utc_iso(until_wall)
    return GuardianError(
        f"{why}, and is quarantined: identical requests are refused until {until}. "
        "Change the request, or ask the operator to look at the failure.",
        status=500,
        code="request_quarantined",
        retry=False,  # the same request would fail the same way
        extra={"quarantined_until": until},
    )

"""The default recovery policy: restart, reload, or exit on a crash loop;
refuse requests blamed for a failure at the door for a while."""

from __future__ import annotations

from dataclasses import dataclass, field

import guardian
from guardian import stock
from guardian.quarantine import request_fingerprint


@dataclass
class RecoverySettings:
    # More than this many engine failures within window_s: answer what is
    # in flight and exit non-zero, so launchd or systemd restarts the process.
    max_failures: int = field(default=5, metadata={"min": 1})
    window_s: float = field(default=60.0, metadata={"min": 0})
    # From this many failures within the window on, read the weights again
    # before restarting (0: never reload, restart on the loaded weights).
    reload_after_failures: int = field(default=3, metadata={"min": 0})
    # How often a request the client has seen nothing of is re-run
    # transparently after a failure.
    max_reruns: int = field(default=1, metadata={"min": 0})
    # A request that failed the engine alone is refused at the door, with
    # every identical request (same prompt tokens and generation
    # parameters), for this many seconds (0: never refused).
    quarantine_s: float = field(default=600.0, metadata={"min": 0})


class Recovery:
    name = "recovery"
    Settings = RecoverySettings

    def __init__(self, settings: RecoverySettings):
        self.settings = settings

    @guardian.hookimpl
    def guardian_startup(self, engine):
        engine.configure_recovery(
            window_s=self.settings.window_s,
            max_reruns=self.settings.max_reruns,
            quarantine_s=self.settings.quarantine_s,
        )

    @guardian.hookimpl(tryfirst=True)
    def admit_request(self, admission, engine):
        """Refuse a request identical to one blamed for an engine failure.

        First, so no other hook reserves anything (KV budget) for it. The
        fingerprint is of the request as it came, before a hook lowers
        ``max_tokens`` or drops messages; it travels with the request, so
        the engine quarantines the very fingerprint checked here.
        """
        if not engine.quarantine.enabled:
            return None
        fingerprint = request_fingerprint(admission.prompt_tokens, admission.args)
        stock.attach_fingerprint(admission.args, fingerprint)
        return engine.quarantine.refusal(fingerprint)

    @guardian.hookimpl(trylast=True)
    def classify_engine_error(self, error):
        return classify(error)

    @guardian.hookimpl(trylast=True)
    def on_engine_error(self, failures_in_window):
        if failures_in_window > self.settings.max_failures:
            return "exit"
        reload_after = self.settings.reload_after_failures
        if reload_after and failures_in_window >= reload_after:
            return "reload"
        return "restart"


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

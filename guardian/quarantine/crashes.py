"""Subprocess mode: blame the requests in flight when the engine child crashes.

A body that crashes the engine natively (SIGSEGV) kills the child before
anything in it can blame the body. The supervisor can: it knows which
requests it had relayed to the child and not yet seen answered. A request
in flight at two crashes within the strike window is quarantined: identical
requests are refused at the proxy for ``quarantine_s`` seconds, so one
poison body and its clients' retries cannot crash-loop the service. A
suspect (in flight at one crash) is relayed alone (``guardian.quarantine.isolation``),
so the innocent requests beside the guilty one at the first crash are not
beside it again at the second; a suspect answered in full is cleared. A
request whose whole answer the child had written before it died (its
journal says so, guardian.handoff) is no suspect, word or no word.

Blame needs reproduction: a poison body crashes the engine at the same point
every time. A stream continued on the next child that relayed tokens past
where it stood at its previous crash progressed: it is no poison, and its
strikes start again at one. (A non-streaming request is sent again from
nothing: the supervisor sees no progress of it, so its strikes add up.)

Identical means the same fingerprint: method, target and the body, as
canonical JSON when it parses (key order and whitespace do not matter),
without ``stream`` and ``stream_options``: they change how tokens reach
the client, not what the engine computes, so a body that crashes the
engine streamed crashes it unstreamed too. The fingerprint is exact by
design: a changed prompt is another request, so quarantine stops retries
and crash loops, not a client set on varying a poison body (validation
at the door is for that).

Only POST requests are tracked: generation is what crashes an engine, and
a GET that happened to be in flight twice (a dashboard polling
/v1/models) must not be refused. No mlx here: the supervisor imports it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import structlog

from guardian.config.tables import SupervisorSettings
from guardian.errors import GuardianError
from guardian.observability.logs import loggable_line
from guardian.quarantine.isolation import IsolationGate
from guardian.quarantine.table import STATUS_ENTRIES, ExpiringTable, short

log = structlog.get_logger("guardian.supervisor")

# Only these are tracked (see the module's docstring).
TRACKED_METHOD = "POST"
# Crashes a request must be in flight at to be quarantined.
STRIKES_TO_QUARANTINE = 2
# Fields that do not change what the engine computes for a request.
DELIVERY_FIELDS = ("stream", "stream_options")
# Bodies up to this size are parsed to be made canonical (~9 ms a MiB here,
# holding the GIL that every relay shares); bigger ones are hashed as sent,
# which still matches a client's retry byte for byte.
MAX_CANONICAL_BYTES = 1 << 20
# A stream of distinct bodies (each in flight at one crash) cannot grow the
# supervisor without limit; the oldest go first (so do quarantined ones: the table's bound).
MAX_SUSPECTS = 1024
# At most this many in-flight records of one child: relays cut while the
# child lived on (a reset connection) wait there for its death.
MAX_RELAYS_PER_CHILD = 4096
# How long a suspect waits to run alone, and others wait behind it, by default.
ISOLATION_MAX_WAIT_S = SupervisorSettings.isolation_wait_s.default


def fingerprint(method: str, target: str, body: bytes) -> str:
    """A hash of what a request asks the engine for (sha256, hex). Never raises: it is
    worked out on the supervisor's main loop when a child dies."""
    digest = hashlib.sha256(f"{method.upper()} {target}\n".encode("utf-8", "surrogatepass"))
    digest.update(canonical_body(body))
    return digest.hexdigest()


def canonical_body(body: bytes) -> bytes:
    """The body as sorted, compact JSON without delivery fields; the bytes if not JSON."""
    if len(body) > MAX_CANONICAL_BYTES:
        return body
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if isinstance(parsed, dict):
        parsed = {k: v for k, v in parsed.items() if k not in DELIVERY_FIELDS}
    try:  # a lone surrogate ("\\ud800") is valid JSON: its text is encoded as such
        return json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        return body


class Relay:
    """One request relayed to a child: ``lost`` if the child failed under it, ``answered`` in full.

    Its fingerprint may be worked out only when a crash asks for it (``request``:
    the target and body it comes from): the reader's hand-off makes none while
    no crash suspect is about.
    """

    def __init__(self, fp: Optional[str], method: str, path: str,
                 request: Optional[tuple[str, bytes]] = None):
        self._fingerprint = fp
        self._request = request
        self.method = method
        self.path = loggable_line(path)  # for the log and the status only: cut if long
        self.lost = False
        self.answered = False
        self.admitted = False  # counted by the isolation gate (a fast relay), until released
        # The stream relayed (a guardian.relay_protocol.RelayedStream, or anything
        # with ``tokens``), set by the proxy once known.
        self.stream: Optional[object] = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            target, body = self._request
            self._fingerprint, self._request = fingerprint(self.method, target, body), None
        return self._fingerprint

    @property
    def position(self) -> int:
        """Where the request stands: the tokens its client has (0: none, or not a stream)."""
        return len(self.stream.tokens) if self.stream is not None else 0

    @property
    def answered_in_full(self) -> bool:
        """Whether the child had written the whole answer, said so or not (a handed-off
        request's journal, guardian.handoff.JournalProgress): its work for the request
        was over, so a death after it is none of the request's doing."""
        return bool(getattr(self.stream, "complete", False))


@dataclass
class Suspect:
    """A fingerprint in flight at one or more recent crashes."""

    method: str
    path: str
    crash_times: list = field(default_factory=list)  # monotonic
    position: int = 0  # its tokens relayed at its last crash

    def strikes(self, now: float, window_s: float) -> int:
        """Crashes it was in flight at within the last ``window_s`` seconds."""
        return sum(1 for t in self.crash_times if t > now - window_s)


class CrashQuarantine:
    """Tracks relays per child; strikes their fingerprints at crashes; refuses the twice-struck."""

    def __init__(self, quarantine_s: float, strike_window_s: float, isolation_wait_s: float = ISOLATION_MAX_WAIT_S):
        self.strike_window_s = strike_window_s
        self.lock = threading.Lock()
        # generation -> {relay id: Relay}; a child's entry goes when it is reaped.
        self.relays: dict[int, OrderedDict[int, Relay]] = {}
        # Children reaped so far: a relay that reaches a dead child is not tracked.
        self.settled_through = 0
        self.suspects: OrderedDict[str, Suspect] = OrderedDict()
        self.quarantined = ExpiringTable(quarantine_s, log)
        self.cleared = 0
        self.isolation = IsolationGate(isolation_wait_s)

    @property
    def quarantine_s(self) -> float:
        return self.quarantined.quarantine_s

    @property
    def enabled(self) -> bool:
        """0 seconds switches quarantining off (suspects are still logged)."""
        return self.quarantined.enabled

    # -- HTTP threads ---------------------------------------------------------
    def refusal(self, method: str, fp: str) -> Optional[GuardianError]:
        """The error for a quarantined request, or None to relay it."""
        if method != TRACKED_METHOD or not self.enabled:
            return None
        return self.quarantined.refusal(fp)

    @contextmanager
    def turn(self, method: str, fp: str, until: Optional[float] = None,
             given_up: Callable[[], bool] = lambda: False) -> Iterator[object]:
        """Wait until this request may go to the child; yield whether it runs alone,
        or ``isolation.REFUSED`` (a suspect that could not: another runs alone), or
        ``isolation.GAVE_UP`` (``until``, its deadline, passed, or ``given_up()``, its
        client left, before its turn).

        A suspect runs alone and others wait behind it (bounded), so a
        crash under it strikes it and nothing else.
        """
        if method != TRACKED_METHOD or not self.enabled:
            yield False
            return
        with self.lock:
            suspect = self.suspects.get(fp)
            struck = suspect is not None and suspect.strikes(time.monotonic(), self.strike_window_s) > 0
        with self.isolation.admit(struck, until, given_up) as alone:
            yield alone

    @contextmanager
    def relaying(self, generation: int, method: str, path: str, fp: str) -> Iterator[Relay]:
        """Record a POST relayed to child ``generation`` until it is answered.

        A relay the child failed under (``relay.lost = True``) stays on
        record: the child may be reaped after its requests were answered.
        """
        relay = Relay(fp, method, path)
        key = id(relay)
        tracked = method == TRACKED_METHOD and self._add(generation, key, relay)
        try:
            yield relay
        finally:
            if tracked:
                self.settle(generation, relay, relay.answered)
            elif relay.answered:
                self._clear(fp)

    # -- the reader's hand-off (guardian.supervise.fast_handoff) -----------------
    def start_fast_relay(self, generation: int, method: str, path: str, target: str,
                         body: bytes) -> Optional[Relay]:
        """Put a relay on record without waiting; None when the quarantine has a say
        (the request is quarantined or a suspect, or a suspect runs or waits to run
        alone): the handler path then decides, waiting if need be."""
        relay = Relay(None, method, path, (target, body))
        if method != TRACKED_METHOD:
            return relay
        if self.enabled:
            self._forget_expired()
            if self.quarantined.has_entries() or self.suspects:
                # Only then is the fingerprint worth its cost now.
                if self.quarantined.holds(relay.fingerprint) or relay.fingerprint in self.suspects:
                    return None
            if not self.isolation.try_admit():
                return None
            relay.admitted = True
        self._add(generation, id(relay), relay)
        return relay

    def end_fast_relay(self, generation: int, relay: Relay, answered: bool, sent: bool = True) -> None:
        """The child's word on a fast relay: answered, or left to the handler path
        (which ends it with ``settle``)."""
        if relay.method != TRACKED_METHOD:
            return
        if relay.admitted:
            relay.admitted = False
            self.isolation.release()
        if answered or not sent:
            self.settle(generation, relay, answered)

    def settle(self, generation: int, relay: Relay, answered: bool) -> None:
        """A relay's end: off the record unless the child failed under it; a suspect answered is cleared."""
        if not relay.lost:
            self._remove(generation, id(relay))
        self._forget_expired()
        if answered and self.suspects:  # only a suspect is cleared: no fingerprint worked out for nothing
            self._clear(relay.fingerprint)

    def _add(self, generation: int, key: int, relay: Relay) -> bool:
        """Put a relay on its child's record; False if that child is already reaped."""
        with self.lock:
            if generation <= self.settled_through:
                return False
            relays = self.relays.setdefault(generation, OrderedDict())
            relays[key] = relay
            while len(relays) > MAX_RELAYS_PER_CHILD:
                relays.popitem(last=False)
            return True

    def _remove(self, generation: int, key: int) -> None:
        """A relay answered in full: it is no suspect of anything."""
        with self.lock:
            self.relays.get(generation, {}).pop(key, None)

    def _forget_expired(self) -> None:
        """Suspects whose last crash left the strike window can strike no more: forgotten,
        oldest first (the table is in the order of their last crash). Kept, a suspect
        never answered again (a unique prompt) made every answered request after a
        crash work out its fingerprint, for as long as the supervisor ran."""
        if not self.suspects:
            return
        horizon = time.monotonic() - self.strike_window_s
        with self.lock:
            while self.suspects:
                fp, suspect = next(iter(self.suspects.items()))
                if suspect.crash_times and suspect.crash_times[-1] > horizon:
                    break
                del self.suspects[fp]

    def _clear(self, fp: str) -> None:
        """A request answered in full did not crash the child: no longer a suspect."""
        with self.lock:
            suspect = self.suspects.pop(fp, None)
            if suspect is not None:
                self.cleared += 1
        if suspect is not None:
            log.info("crash_suspect_cleared", fingerprint=short(fp), method=suspect.method,
                     path=suspect.path)

    # -- the supervisor's main loop -------------------------------------------
    def child_exited(self, generation: int, crashed: bool, out_of_memory: bool = False,
                     **exit_info) -> list[dict]:
        """Settle a reaped child; if it died on its own, strike what was in flight. The
        suspects, each with its crash times (``crash_times``, the monotonic clock).

        ``out_of_memory``: the kernel's OOM killer ended it. Nobody is struck: as in one
        process, where a failure for want of memory blames no request (guardian.engine.blame),
        its memory ran out for all it held (its caches grown over many requests, another
        process's), and a request too big for the memory is refused at a guardian child's
        door by its KV budget, sized to that memory (guardian.admission.cgroup_memory; a
        stock child has none, and its kills strike as crashes). Struck, the
        requests in flight at two such kills were quarantined though each fitted alone (a
        hunt: four of twelve, under a memory group's limit)."""
        with self.lock:
            relays = self.relays.pop(generation, {})
            self.settled_through = max(self.settled_through, generation)
        if not crashed:
            return []
        now = time.monotonic()
        in_flight = [relay for relay in relays.values() if not relay.answered_in_full]
        if out_of_memory:
            log.warning("crash_not_blamed", generation=generation, in_flight=len(in_flight),
                        why="the kernel's OOM killer ended the child: a shortage of memory, no request's fault",
                        **exit_info)
            return []
        distinct = {relay.fingerprint: relay for relay in in_flight}
        suspects = [self._strike(fp, relay, now) for fp, relay in distinct.items()]
        log.warning("crash_suspects", generation=generation,
                    suspects=[{k: v for k, v in s.items() if k != "crash_times"} for s in suspects],
                    answered_in_full=len(relays) - len(in_flight), quarantine_s=self.quarantine_s,
                    **exit_info)
        return suspects

    def _strike(self, fp: str, relay: Relay, now: float) -> dict:
        """One more crash for ``fp``; quarantine it at the second at one point within the window."""
        position = relay.position  # outside the lock: a stream's tokens are parsed from its tags
        with self.lock:
            suspect = self.suspects.pop(fp, None)
            progressed = suspect is not None and position > suspect.position
            if suspect is None:
                suspect = Suspect(relay.method, relay.path)
            suspect.position = max(position, suspect.position)
            suspect.crash_times = [t for t in suspect.crash_times
                                   if t > now - self.strike_window_s and not progressed]
            suspect.crash_times.append(now)
            strikes = len(suspect.crash_times)
            quarantine = self.enabled and strikes >= STRIKES_TO_QUARANTINE
            if not quarantine:
                self.suspects[fp] = suspect  # newest last: eviction takes the oldest
                while len(self.suspects) > MAX_SUSPECTS:
                    self.suspects.popitem(last=False)
        if quarantine:
            self.quarantined.add(fp, why=f"This request was in flight at {strikes} crashes of the engine process",
                                 shown={"method": suspect.method, "path": suspect.path, "strikes": strikes})
        return {"fingerprint": short(fp), "method": relay.method, "path": relay.path,
                "strikes": strikes, "lost": relay.lost, "quarantined": quarantine,
                "position": position, "progressed": progressed, "crash_times": list(suspect.crash_times)}

    # -- status -----------------------------------------------------------------
    def status(self) -> dict:
        """What /guardian/supervisor shows: the newest quarantined and suspect fingerprints."""
        now = time.monotonic()
        with self.lock:
            suspects = list(self.suspects.items())
        return {
            **self.quarantined.status(),
            "cleared": self.cleared,
            "isolation": self.isolation.status(),
            "suspects_count": len(suspects),
            "suspects": [
                {"fingerprint": short(fp), "method": s.method, "path": s.path,
                 "strikes": s.strikes(now, self.strike_window_s)}
                for fp, s in suspects[-STATUS_ENTRIES:]
            ],
        }

"""Rehearse the incident: make the engine fail or hang on purpose.

Off by default. Enable it in the TOML file with ``[fault_injection]``
``enabled = true`` and one or more triggers; the default exception is the
incident's ``RuntimeError: [metal::malloc] Resource limit (499000)
exceeded.``, raised inside ``BatchGenerator.next`` as on the Mac.
"""

from __future__ import annotations

import builtins
import ctypes
import random
import threading

import structlog

import guardian
from guardian.config.registry import ConfigError
from guardian.plugin_manager import resolve
from guardian.config.registry import Bool, Float, Int, Setting, Str, Table

log = structlog.get_logger("guardian.fault_injection")

INCIDENT_MESSAGE = "[metal::malloc] Resource limit (499000) exceeded."


class FaultInjectionSettings(Table, name="fault_injection"):
    """Rehearse the incident. Off unless enabled; triggers combine."""

    enabled = Setting(Bool(), False, """
        Plant the faults below. Live where ``armable`` is set at start.""", live=True)
    armable = Setting(Bool(), False, """
        Keep the plugin on the engine's step (one hook call a step) even while
        ``enabled`` is false, so that saving the configuration file arms or
        disarms faults without a restart: a test shares one server between
        fault-free and faulty cases. Read at start.""")
    exception = Setting(Str(), "RuntimeError", """
        A builtin exception name, or "package.module:Class". Read at start.""")
    message = Setting(Str(), INCIDENT_MESSAGE, """
        The default is the incident's message.""", live=True)
    at_step = Setting(Int(min=0), 0, """
        Raise once, at this engine step (1-based, counted from when faults were
        enabled: the process start, or the save that armed them). 0: off.""", live=True)
    every_n_steps = Setting(Int(min=0), 0, """
        Raise at every Nth engine step. 0: off.""", live=True)
    probability = Setting(Float(min=0.0), 0.0, """
        Raise at each step with this probability (seeded, so runs repeat).""", live=True)
    seed = Setting(Int(), 0, """
        The seed of probability's random draws: the same seed, the same steps fail.""")
    poison_marker = Setting(Str(), "", """
        Raise at every step while a started request's prompt contains this text. "": off.""", live=True)
    segfault_marker = Setting(Str(), "", """
        Crash the process with a real SIGSEGV at a step while a started request's
        prompt contains this text (a body that kills the engine natively). "": off.""", live=True)
    min_started = Setting(Int(min=0), 0, """
        Count steps for at_step and every_n_steps only while at least this many
        requests are started (8: fail with 8 clients mid-generation).""", live=True)
    max_faults = Setting(Int(min=0), 0, """
        Stop raising after this many faults. 0: no limit.""", live=True)
    hang_at_step = Setting(Int(min=0), 0, """
        Block the engine thread at this step, as a native deadlock would (1-based,
        counted from when faults were enabled, as at_step is, though every step
        counts). 0: off.""", live=True)
    hang_s = Setting(Float(min=0.0), 0.0, """
        How long the hang lasts in seconds; 0 blocks until shutdown.""", live=True)
    step_delay_s = Setting(Float(min=0.0), 0.0, """
        Sleep this long before every step: slow steps that still progress (a long
        prefill on a big model), to check the watchdog raises no false alarm.""", live=True)
    rank = Setting(Int(min=-1), -1, """
        Under mlx.launch: plant faults on this rank of the group only, counting its
        steps (the ranks step together); -1: on every rank. A process alone is rank 0.
        Requests are known on rank 0 only: min_started and the markers work there.
        Only rank 0 follows the file: another rank's faults are those it read at start.""")


# What the armed log line says (the triggers).
ARMED_FIELDS = ("at_step", "every_n_steps", "probability", "poison_marker", "segfault_marker",
                "min_started", "max_faults", "hang_at_step", "step_delay_s")


class FaultInjection:
    name = "fault_injection"
    Settings = FaultInjectionSettings

    def __init__(self, settings: FaultInjectionSettings):
        self.settings = settings
        # Disabled (and not armable), it stays off the engine's per-step hot
        # path entirely; so does it on the ranks of a group other than the one it targets.
        self.active = (settings.enabled or settings.armable) and on_this_rank(settings.rank)
        self.exception_class = self._exception_class(settings.exception)
        self.random = random.Random(settings.seed)
        self.faults = 0
        self.armed_steps = 0  # steps that count for at_step and every_n_steps
        self.steps_since_armed = 0  # every step, for hang_at_step
        self.armed = False
        # Set by a save that changed this table: the next step arms afresh, even
        # where no step ran between a disarming save and an arming one.
        self.resaved = False
        self.released = threading.Event()

    @staticmethod
    def _exception_class(spec: str):
        cls = getattr(builtins, spec, None) if ":" not in spec else resolve(spec)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise ConfigError(f"fault_injection.exception: {spec!r} is not an exception class")
        return cls

    @guardian.hookimpl
    def guardian_startup(self):
        if self.settings.enabled:
            log.warning("fault_injection_enabled", **vars(self.settings))

    @guardian.hookimpl
    def guardian_shutdown(self):
        self.released.set()

    @guardian.hookimpl
    def on_config_reloaded(self, changed):
        if any(key.startswith(f"{self.name}.") for key in changed):
            self.resaved = True
            if self.settings.enabled and not self.active and on_this_rank(self.settings.rank):
                # Off the engine's step since start: the save arms nothing, and said nothing.
                log.warning("fault_injection_not_armable",
                            why="enabled by a save, but neither enabled nor armable at start: "
                                "no fault is planted", hint="set armable = true and restart")

    @guardian.hookimpl
    def on_engine_step(self, step, engine):
        s = self.settings
        if not self.active or not self._armed(s):
            return
        self.steps_since_armed += 1
        if s.step_delay_s:
            self.released.wait(s.step_delay_s)
        if s.hang_at_step and self.steps_since_armed == s.hang_at_step:
            log.warning("fault_injected", kind="hang", step=step)
            self.released.wait(s.hang_s or None)
        if s.segfault_marker and engine.started_prompt_contains(s.segfault_marker):
            self._segfault(step)
        if s.max_faults and self.faults >= s.max_faults:
            return
        reason = self._trigger(step, engine)
        if reason:
            self.faults += 1
            log.warning("fault_injected", kind="raise", step=step, trigger=reason)
            raise self.exception_class(s.message)

    def _armed(self, s) -> bool:
        """Whether faults are enabled now; armed afresh (by a save), the counts start again."""
        resaved, self.resaved = self.resaved, False
        if s.enabled and (not self.armed or resaved):
            self.faults = self.armed_steps = self.steps_since_armed = 0
            if self.settings.armable:
                log.warning("fault_injection_armed", **{k: getattr(s, k) for k in ARMED_FIELDS})
        elif not s.enabled and self.armed:
            log.warning("fault_injection_disarmed", faults=self.faults)
        self.armed = s.enabled
        return self.armed

    @staticmethod
    def _segfault(step):
        """Read address 0, as a native bug would: the kernel sends SIGSEGV."""
        log.warning("fault_injected", kind="segfault", step=step, trigger="segfault_marker")
        ctypes.string_at(0)

    def _trigger(self, step, engine):
        s = self.settings
        if s.min_started and engine.started_count() < s.min_started:
            return None
        self.armed_steps += 1
        if s.at_step and self.armed_steps == s.at_step:
            return "at_step"
        if s.every_n_steps and self.armed_steps % s.every_n_steps == 0:
            return "every_n_steps"
        if s.probability and self.random.random() < s.probability:
            return "probability"
        if s.poison_marker and engine.started_prompt_contains(s.poison_marker):
            return "poison_marker"
        return None


def on_this_rank(rank: int) -> bool:
    """Whether faults aimed at ``rank`` (-1: any) are planted in this process."""
    if rank < 0:
        return True
    from guardian.distributed.group import current_group

    group = current_group()
    return (group.rank if group is not None else 0) == rank

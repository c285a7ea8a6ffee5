"""Records every hook call the server makes: one JSON line per call.

A test plugin (``[guardian] plugins = ["tests.plugins.hook_recorder:HookRecorder"]``,
``[hook_recorder] path = "..."``, or the ``HOOK_RECORDER_PATH`` environment
variable). Its methods are generated from ``guardian.hookspecs``,
each with its spec's own arguments, so it implements every hook there is,
including hooks added later, without naming one. It decides nothing:
deciding hooks (first result, collect-all) return None, which means no
opinion, no probe, no gauges.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from dataclasses import dataclass

import guardian.hookspecs as hookspecs

PROJECT = hookspecs.hookspec.project_name
hookimpl = hookspecs.hookimpl


@dataclass
class HookRecorderSettings:
    # Where the JSON lines go; empty: $HOOK_RECORDER_PATH.
    path: str = ""


def hook_specs() -> dict:
    """Every hookspec function, by name."""
    return {
        name: function
        for name, function in inspect.getmembers(hookspecs, inspect.isfunction)
        if getattr(function, f"{PROJECT}_spec", None) is not None
    }


def summarize(value, depth: int = 0):
    """Something JSON can hold that says what the argument was, never the engine itself."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:200]
    if hasattr(value, "code") and hasattr(value, "status"):  # a GuardianError
        return {"type": type(value).__name__, "status": value.status, "code": value.code}
    if isinstance(value, BaseException):
        return {"exception": type(value).__name__, "message": str(value)[:200]}
    if depth < 2 and isinstance(value, dict):
        return {str(k): summarize(v, depth + 1) for k, v in value.items()}
    if depth < 2 and isinstance(value, (list, tuple)):
        return [summarize(v, depth + 1) for v in value]
    return {"type": type(value).__name__}


class _Recorder:
    name = "hook_recorder"
    Settings = HookRecorderSettings

    def __init__(self, settings: HookRecorderSettings):
        self.path = settings.path or os.environ.get("HOOK_RECORDER_PATH", "")
        if not self.path:
            raise ValueError("hook_recorder: set [hook_recorder] path or $HOOK_RECORDER_PATH")
        self._lock = threading.Lock()

    def _record(self, hook: str, kwargs: dict) -> None:
        line = json.dumps({
            "hook": hook,
            "at": time.time(),
            "thread": threading.current_thread().name,
            "args": {k: summarize(v) for k, v in kwargs.items()},
        })
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


def _method(name: str, spec) -> object:
    """An implementation of hook ``name`` taking exactly its spec's arguments."""
    params = list(inspect.signature(spec).parameters)
    source = (
        f"def {name}(self, {', '.join(params)}):\n"
        f"    self._record({name!r}, {{{', '.join(f'{p!r}: {p}' for p in params)}}})\n"
    )
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 - generated from the specs, nothing external
    opts = getattr(spec, f"{PROJECT}_spec")
    # A first-result hook stops at the first non-None answer: be asked first,
    # so a refusal by another plugin cannot hide the call from the record.
    return hookimpl(tryfirst=bool(opts.get("firstresult")))(namespace[name])


HookRecorder = type(
    "HookRecorder",
    (_Recorder,),
    {name: _method(name, spec) for name, spec in hook_specs().items()},
)


def read_records(path) -> list[dict]:
    """The recorded calls, in order; a missing file is no calls. A last line
    without its newline is a record the server is writing now: left for the
    next read (CI once read one half written)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]
    except FileNotFoundError:
        return []

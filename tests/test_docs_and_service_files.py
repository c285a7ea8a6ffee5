"""The documents users rely on say what the code does."""

from __future__ import annotations

import configparser
import inspect
import plistlib
from pathlib import Path

from guardian.plugins import hookspecs
from guardian.exit_codes import (
    EXIT_BOOT_ERROR,
    EXIT_ENGINE_FAILED,
    EXIT_ENGINE_STALLED,
    EXIT_SUPERVISOR_GAVE_UP,
)

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def hook_names():
    return [name for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(f, "mlx_guardian_spec")]


def test_every_hook_is_documented_with_its_signature():
    assert hook_names()
    for name in hook_names():
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"`{name}({params})`" in README, f"README lacks hook {name}({params})"


def test_every_hook_has_a_docstring_saying_its_thread_and_return():
    for name in hook_names():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert "thread" in doc.lower() and ("return" in doc.lower()), name


def test_readme_starts_with_the_two_commands():
    head = README.split("## ", 1)[0]
    assert "make serve" in head and "make test" in head
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_exit_codes_are_documented():
    for code in (EXIT_BOOT_ERROR, EXIT_ENGINE_FAILED, EXIT_ENGINE_STALLED, EXIT_SUPERVISOR_GAVE_UP):
        assert f"| {code} |" in README


def test_systemd_unit_restarts_on_failure_and_uses_the_watchdog():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(REPO / "config" / "systemd" / "mlx-guardian.service")
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["Restart"] == "on-failure"
    assert int(service["WatchdogSec"]) > 0
    assert "--guardian-config" in service["ExecStart"]


def test_launchd_plist_restarts_only_after_failures():
    with open(REPO / "config" / "launchd" / "com.example.mlx-guardian.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] >= 1
    assert plist["ProgramArguments"][0].endswith("mlx-guardian")

"""The documents users rely on say what the code does."""

from __future__ import annotations

import configparser
import inspect
import plistlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from guardian import hookspecs
from guardian.exit_codes import (
    EXIT_BOOT_ERROR,
    EXIT_ENGINE_FAILED,
    EXIT_ENGINE_STALLED,
    EXIT_SUPERVISOR_GAVE_UP,
)

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
# The hooks' overview table (written by hand) and the exit codes (written
# from guardian/exit_codes.py by tools/docs_reference.py).
PLUGINS_PAGE = (REPO / "docs" / "plugins.md").read_text()
EXIT_CODES_PAGE = (REPO / "docs" / "reference" / "exit-codes.md").read_text()
SYSTEMD_UNIT = REPO / "config" / "systemd" / "mlx-guardian.service"
LAUNCHD_PLIST = REPO / "config" / "launchd" / "com.example.mlx-guardian.plist"


def hook_names():
    return [name for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(f, "mlx_guardian_spec")]


def test_every_hook_is_documented_with_its_signature():
    assert hook_names()
    for name in hook_names():
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"`{name}({params})`" in PLUGINS_PAGE, f"docs/plugins.md lacks hook {name}({params})"


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
        assert f"| {code} |" in EXIT_CODES_PAGE


def test_systemd_unit_restarts_on_failure_and_uses_the_watchdog():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(SYSTEMD_UNIT)
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["Restart"] == "on-failure"
    assert int(service["WatchdogSec"]) > 0
    assert service["KillMode"] == "mixed"  # the main process drains; a group's launcher dies of SIGTERM
    assert "--guardian-config" in service["ExecStart"]


def test_systemd_reload_checks_the_file_the_server_reads_before_it_signals():
    """`systemctl reload` of a broken file fails there, with the error (check-config's
    exit 2), before the SIGHUP: the file checked is the one ExecStart names."""
    lines = [line.partition("=")[2] for line in SYSTEMD_UNIT.read_text().splitlines()
             if line.startswith("ExecReload=")]
    served = re.search(r"--guardian-config (\S+)", SYSTEMD_UNIT.read_text().replace("\\\n", " ")).group(1)
    assert len(lines) == 2 and lines[0].endswith(f"mlx-guardian check-config {served}") and "-HUP" in lines[1]


def test_launchd_plist_restarts_only_after_failures():
    with open(LAUNCHD_PLIST, "rb") as f:
        plist = plistlib.load(f)
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] >= 1
    assert plist["ProgramArguments"][0].endswith("mlx-guardian")


def test_systemd_unit_limits_a_crash_loop_in_the_unit_section():
    # systemd reads the start limit from [Unit]; in [Service] it ignores
    # StartLimitIntervalSec, and the crash-loop limit would not be in force.
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(SYSTEMD_UNIT)
    assert int(unit["Unit"]["StartLimitIntervalSec"]) > 0 and int(unit["Unit"]["StartLimitBurst"]) > 0
    assert not {"startlimitintervalsec", "startlimitburst"} & set(unit["Service"])


@pytest.mark.one_version
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_every_line_of_the_unit(tmp_path):
    # The same unit, but for the program it starts: verify refuses an
    # ExecStart binary that does not exist on this machine.
    text = SYSTEMD_UNIT.read_text()
    shipped_program = "/opt/mlx-guardian/.venv/bin/mlx-guardian"
    assert f"ExecStart={shipped_program} " in text
    unit = tmp_path / SYSTEMD_UNIT.name
    unit.write_text(text.replace(f"{shipped_program} ", f"{shutil.which('true')} "))  # ExecReload's too
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert "Unknown" not in output and "ignoring" not in output, output
    assert result.returncode == 0, output


# The keys launchd.plist(5) (macOS) documents, with the type each takes.
LAUNCHD_KEYS = {
    "Label": str, "Disabled": bool, "UserName": str, "GroupName": str, "inetdCompatibility": dict,
    "LimitLoadToHosts": list, "LimitLoadFromHosts": list, "LimitLoadToSessionType": (str, list),
    "LimitLoadToHardware": dict, "LimitLoadFromHardware": dict, "Program": str, "ProgramArguments": list,
    "EnableGlobbing": bool, "EnableTransactions": bool, "EnablePressuredExit": bool, "OnDemand": bool,
    "ServiceIPC": bool, "KeepAlive": (bool, dict), "RunAtLoad": bool, "RootDirectory": str,
    "WorkingDirectory": str, "EnvironmentVariables": dict, "Umask": (int, str), "TimeOut": int,
    "ExitTimeOut": int, "ThrottleInterval": int, "InitGroups": bool, "WatchPaths": list,
    "QueueDirectories": list, "StartOnMount": bool, "StartInterval": int,
    "StartCalendarInterval": (dict, list), "StandardInPath": str, "StandardOutPath": str,
    "StandardErrorPath": str, "Debug": bool, "WaitForDebugger": bool, "SoftResourceLimits": dict,
    "HardResourceLimits": dict, "Nice": int, "ProcessType": str, "AbandonProcessGroup": bool,
    "LowPriorityIO": bool, "LowPriorityBackgroundIO": bool, "MaterializeDatalessFiles": bool,
    "LaunchOnlyOnce": bool, "MachServices": dict, "Sockets": dict, "LaunchEvents": dict,
    "SessionCreate": bool, "LegacyTimers": bool, "AssociatedBundleIdentifiers": (str, list),
}
# launchd.plist(5)'s KeepAlive dictionary.
LAUNCHD_KEEPALIVE_KEYS = {"SuccessfulExit", "NetworkState", "PathState", "OtherJobEnabled", "Crashed",
                          "AfterInitialDemand"}


@pytest.mark.one_version
def test_launchd_plist_uses_only_keys_launchd_knows():
    with open(LAUNCHD_PLIST, "rb") as f:
        plist = plistlib.load(f)
    unknown = set(plist) - set(LAUNCHD_KEYS)
    assert not unknown, f"keys launchd.plist(5) does not document: {unknown}"
    for key, value in plist.items():
        assert isinstance(value, LAUNCHD_KEYS[key]), f"{key}: {type(value).__name__}"
    assert all(isinstance(argument, str) for argument in plist["ProgramArguments"])
    assert set(plist["KeepAlive"]) <= LAUNCHD_KEEPALIVE_KEYS
    assert plist["Label"] == LAUNCHD_PLIST.name.removesuffix(".plist")  # launchd's naming convention

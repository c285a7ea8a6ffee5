"""The command line: stock's flags parsed by stock, the guardian's beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx_lm.server


def run(*args, timeout=60):
    # Offline: a path that does not exist must not send mlx_lm to the hub.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "guardian", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_shows_stock_and_guardian_flags():
    result = run("--help")
    assert result.returncode == 0
    for flag in ("--model", "--decode-concurrency", "--prompt-cache-bytes"):
        assert flag in result.stdout
    assert "--guardian-config" in result.stdout and "--log-format" in result.stdout


def test_every_stock_flag_is_accepted():
    import inspect
    import re

    stock_flags = set(re.findall(r'"(--[a-z-]+)"', inspect.getsource(mlx_lm.server.main)))
    help_text = run("--help").stdout
    assert stock_flags and all(flag in help_text for flag in stock_flags)


def test_bad_stock_flag_value_is_stocks_usage_error():
    result = run("--port", "not-a-number")
    assert result.returncode == 2
    assert "--port" in result.stderr


def test_plugins_command_lists_hooks():
    result = run("plugins")
    assert result.returncode == 0
    plugins = {p["name"]: p["hooks"] for p in json.loads(result.stdout)}
    assert "on_engine_error" in plugins["recovery"]
    assert "on_engine_step" in plugins["fault_injection"]


def test_demo_model_command_writes_a_model(tmp_path):
    result = run("demo-model", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "model.safetensors").exists()


def test_missing_model_path_exits_with_boot_error(tmp_path):
    from guardian.exit_codes import EXIT_BOOT_ERROR

    result = run("--model", str(tmp_path / "nothing-here"), "--port", "0")
    assert result.returncode == EXIT_BOOT_ERROR, result.stderr[-2000:]
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if line.startswith("{")]
    assert "model_load_failed" in events

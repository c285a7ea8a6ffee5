"""The command line: stock's flags parsed by stock, the guardian's beside them."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys

import httpx
import mlx_lm.server
import pytest

from conftest import BOTH_MODES, REPO, free_port, poll, run_guardian, spawn_guardian


def run(*args, timeout=60):
    # Offline (conftest: the whole session is): a path that does not exist must not send mlx_lm to the hub.
    return run_guardian(list(args), env={"HF_HUB_OFFLINE": "1"}, timeout=timeout)


def test_help_shows_stock_and_guardian_flags():
    result = run("--help")
    assert result.returncode == 0
    for flag in ("--model", "--decode-concurrency", "--prompt-cache-bytes"):
        assert flag in result.stdout
    assert "--guardian-config" in result.stdout and "--log-format" in result.stdout
    # The one stock flag whose default differs says so (its help said "default: *").
    allowed_origins = " ".join(result.stdout.partition("--allowed-origins ALLOWED_ORIGINS\n")[2].split())
    assert allowed_origins.startswith("Origins whose web pages") and "(default: *)" not in result.stdout
    assert "http://127.0.0.1:*" in allowed_origins.partition("--")[0]
    # Stock's --model had no default; leaving it out here serves the demo model.
    model = " ".join(result.stdout.partition("\n  --model MODEL")[2].split()).partition("--")[0]
    assert "demo model" in model, model


@pytest.mark.one_version
def test_help_shows_the_other_commands_and_subprocess_mode():
    help_text = run("--help").stdout
    for usage in ("mlx-guardian plugins", "mlx-guardian demo-model PATH", "mlx-guardian --supervise",
                  "mlx-guardian --supervise --help"):
        assert usage in help_text
    assert "--supervisor-interval" in run("--supervise", "--help").stdout
    assert "hooks" in run("plugins", "--help").stdout


def test_every_stock_flag_is_accepted():
    import inspect
    import re

    stock_flags = set(re.findall(r'"(--[a-z-]+)"', inspect.getsource(mlx_lm.server.main)))
    help_text = run("--help").stdout
    assert stock_flags and all(flag in help_text for flag in stock_flags)


def test_stocks_abbreviations_of_its_flags_still_work():
    """argparse takes a flag's unambiguous prefix. Ours beside stock's made some of stock's
    ambiguous: `--log DEBUG` (stock: --log-level) exited 2, "could match --log-level,
    --log-format", where stock started (a side-by-side run of every stock flag's prefixes)."""
    for prefix in ("--l", "--lo", "--log", "--log-"):
        result = run(prefix, "DEBUG", "--port", "99999")
        # Parsed: it gets as far as the port, which no server can listen on.
        assert result.returncode == 2 and "cannot listen" in result.stderr, (prefix, result.stderr[-300:])


def test_an_abbreviated_supervise_is_refused_not_ignored():
    """argparse took `--sup` for --supervise, and the process ran without a supervisor."""
    result = run("--sup", "--port", "99999")
    assert result.returncode == 2 and "--sup is short for --supervise: spell it in full" in result.stderr


def test_a_flag_of_subprocess_mode_without_supervise_says_which_mode_takes_it():
    """argparse said "unrecognized arguments: --launch-args ..." and no more."""
    for args in (["--launch-args", "--backend ring -n 2"], ["--supervisor-interval=0.2"]):
        result = run(*args, "--port", "99999")
        flag = args[0].partition("=")[0]
        assert result.returncode == 2, result.stderr[-300:]
        assert f"{flag} is a flag of subprocess mode: add --supervise" in result.stderr, result.stderr[-300:]


def test_a_file_with_a_supervisor_table_read_in_process_says_it_is_unused(tmp_path):
    """[supervisor] is the supervisor's alone: a service started without --supervise from a
    file that sets launch_args ran one process, in-process, and nothing said so."""
    config = tmp_path / "guardian.toml"
    config.write_text('[supervisor]\nlaunch_args = "--backend ring -n 2"\n')
    result = run("--guardian-config", str(config), "--port", "99999")
    assert result.returncode == 2, result.stderr[-300:]  # past the file, at the port
    [unused] = [json.loads(line) for line in result.stderr.splitlines() if "supervisor_table_unused" in line]
    assert unused["level"] == "warning" and "--supervise" in unused["hint"], unused
    assert unused["keys"] == ["launch_args"], unused
    config.write_text("[guardian]\nexit_grace_s = 2\n[supervisor]\n# engine = 'stock'\n")
    assert "supervisor_table_unused" not in run("--guardian-config", str(config), "--port", "99999").stderr
    # The example file sets every key at its default: no news (it warned of 21 keys at every start).
    example = REPO / "config" / "guardian.example.toml"
    assert "supervisor_table_unused" not in run("--guardian-config", str(example), "--port", "99999").stderr


def test_a_stock_flag_of_one_of_the_guardians_names_is_a_clear_exit_2(capsys):
    """A future mlx-lm that adds, say, --ssl-certfile (uvicorn's and vLLM's name): argparse's
    "conflicting option string" traceback ended every start."""
    import argparse

    from guardian.cli import add_guardian_arguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--ssl-certfile")  # as stock might one day
    with pytest.raises(SystemExit) as exited:
        add_guardian_arguments(parser)
    assert exited.value.code == 2
    assert "this mlx-lm's server has a flag of the guardian's own" in capsys.readouterr().err


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


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_version_names_what_a_bug_report_needs(mode):
    from importlib.metadata import version

    result = run(*(["--supervise"] if mode == "supervised" else []), "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"mlx-guardian {version('mlx-guardian')} (mlx-lm {version('mlx-lm')}, "
                                     f"mlx {version('mlx')}, Python {platform.python_version()})")
    assert "child_started" not in result.stdout + result.stderr  # the supervisor started nothing


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("held, logged", [("hold_s = 0.0\nhold_before_load_s = 30.0", "slow_start_loading"),
                                          ("hold_s = 30.0", "slow_start_waiting")],
                         ids=["while_the_model_loads", "after_it_loaded"])
def test_ctrl_c_before_serving_ends_by_sigint_with_one_line_not_a_traceback(tmp_path, held, logged):
    """Before the server takes SIGINT over, Ctrl-C ends the process as SIGTERM does then: by
    the signal. Just after the model loaded it exited 0 instead."""
    config = tmp_path / "slow.toml"
    config.write_text(f'[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n[slow_start]\n{held}\n')
    # A shell's background jobs ignore SIGINT, and so would this one: a terminal's Ctrl-C is not ignored.
    # -X faulthandler: a process that outlives the signal is made to say where each thread was (SIGABRT).
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "guardian", "--port", str(free_port()),
                             "--guardian-config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if logged in line:
                break
        proc.send_signal(signal.SIGINT)
        try:
            rest = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"still running 30 s after SIGINT; where its threads were:\n{proc.communicate(timeout=30)[0]}")
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, rest  # as Python's own end: killed by SIGINT
    assert rest.strip().splitlines()[-1] == "mlx-guardian: interrupted" and "Traceback" not in rest, rest


def test_demo_model_command_writes_a_model(tmp_path):
    from guardian.exit_codes import EXIT_USAGE

    result = run("demo-model", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "config.json").exists()
    assert (tmp_path / "m" / "model.safetensors").exists()
    # A path it cannot use is one line, a usage error (it was a traceback and exit 1, "a bug").
    again = run("demo-model", str(tmp_path / "m"))
    assert again.returncode == EXIT_USAGE and "it already exists" in again.stderr, again.stderr
    under_a_file = run("demo-model", str(tmp_path / "m" / "config.json" / "x"))
    assert under_a_file.returncode == EXIT_USAGE and "cannot write the demo model" in under_a_file.stderr
    assert "Traceback" not in again.stderr + under_a_file.stderr


def test_missing_model_path_exits_with_boot_error(tmp_path):
    from guardian.exit_codes import EXIT_BOOT_ERROR

    result = run("--model", str(tmp_path / "nothing-here"), "--port", "0")
    assert result.returncode == EXIT_BOOT_ERROR, result.stderr[-2000:]
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if line.startswith("{")]
    assert "model_load_failed" in events
    # One line a person reads, naming the fix; no traceback (stock's loader took the path
    # for a hub id: "Repo id must be in the form ...").
    assert f"cannot load the model {tmp_path / 'nothing-here'}: no such folder" in result.stderr
    assert "Traceback" not in result.stderr and '"exception"' not in result.stderr


def test_a_missing_draft_model_is_named_not_the_model(tmp_path, model_cache):
    """It was said as the model's failure, naming the model that loads."""
    from guardian.exit_codes import EXIT_BOOT_ERROR

    model = tmp_path / "model"
    assert run("demo-model", str(model)).returncode == 0
    result = run("--model", str(model), "--draft-model", str(tmp_path / "no-draft"), "--port", "0")
    assert result.returncode == EXIT_BOOT_ERROR, result.stderr[-2000:]
    assert f"cannot load the draft model {tmp_path / 'no-draft'}: no such folder" in result.stderr


@pytest.mark.parametrize("engine_args", [[], ["--supervise", "--engine", "stock"]], ids=["guardian", "stock"])
def test_a_demo_model_it_cannot_write_exits_with_boot_error_naming_the_fix(tmp_path, engine_args):
    """A supervisor of stock finds the demo model for its child (the guardian's own find it)."""
    from guardian.exit_codes import EXIT_BOOT_ERROR

    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder would be")
    result = run_guardian(["--port", "0", *engine_args], env={"MLX_GUARDIAN_CACHE": str(not_a_folder / "sub")})
    assert result.returncode == EXIT_BOOT_ERROR, result.stderr[-2000:]
    assert "MLX_GUARDIAN_CACHE" in result.stderr and "Traceback" not in result.stderr
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if line.startswith("{")]
    assert "model_load_failed" in events


def test_a_bug_in_the_servers_start_exits_1_and_never_hangs(tmp_path, model_cache):
    """An exception out of the server's start, its engine's thread running, left a
    traceback and a process that never exited (that thread is not a daemon): the
    incident's shape, one level up. It is logged and the process exits 1."""
    from guardian.exit_codes import EXIT_UNCAUGHT

    config = tmp_path / "guardian.toml"
    config.write_text('[guardian]\nplugins = ["tests.plugins.serve_fault:ServeFault"]\n')
    result = run_guardian(["--port", "0", "--guardian-config", str(config)],
                          env={"MLX_GUARDIAN_CACHE": str(model_cache)}, timeout=120)
    assert result.returncode == EXIT_UNCAUGHT, result.stderr[-2000:]
    failed = [json.loads(line) for line in result.stderr.splitlines() if '"server_failed"' in line]
    assert failed and "planted" in failed[0]["exception"]


def test_docs_exit_code_table_is_the_exit_codes_table():
    from pathlib import Path

    from guardian.exit_codes import markdown_table

    page = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "exit-codes.md").read_text()
    assert markdown_table() in page, ("docs/reference/exit-codes.md's table differs from guardian.exit_codes.EXIT_CODES: "
                                      "regenerate it with python tools/docs_reference.py")


def test_guardian_flags_come_from_the_settings_registry():
    from guardian.config.tables import CommandLine, CoreSettings

    help_text = run("--help").stdout
    for setting in [*CommandLine.settings.values(), CoreSettings.log_format]:
        assert setting.flag in help_text


def supervisor_options(*argv):
    from guardian.supervise.settings import make_parser

    return make_parser().parse_known_args(["--supervise", *argv])


def test_supervisor_reads_its_table_and_flags_win(tmp_path):
    from guardian.supervise.child import child_command
    from guardian.supervise.settings import read_settings

    path = tmp_path / "guardian.toml"
    path.write_text("[supervisor]\ninterval_s = 2\nmax_restarts = 1\n"
                    "[guardian]\nretry_after_s = 3\nlog_format = 'console'\n")
    options, rest = supervisor_options("--guardian-config", str(path), "--supervisor-interval", "0.5",
                                       "--model", "m")
    settings, core = read_settings(options)
    assert (settings.interval_s, settings.max_restarts, settings.window_s) == (0.5, 1, 300.0)
    assert (core.retry_after_s, core.log_format, core.exit_grace_s) == (3.0, "console", 5.0)
    assert rest == ["--model", "m"]
    # A guardian child reads (and checks) the same file; stock gets none of it.
    guardian_child = child_command(options, "guardian", rest, 1234)
    assert guardian_child[guardian_child.index("--guardian-config") + 1] == str(path)
    assert "--guardian-config" not in child_command(options, "stock", rest, 1234)


def test_supervisor_defaults_without_a_file():
    from guardian.config.tables import SupervisorSettings
    from guardian.supervise.settings import read_settings

    settings, core = read_settings(supervisor_options()[0])
    assert settings == SupervisorSettings() and core.retry_after_s == 1.0


def test_stock_engine_reads_only_the_supervisor_table(tmp_path):
    from guardian.config.registry import ConfigError
    from guardian.supervise.settings import read_settings

    path = tmp_path / "guardian.toml"
    path.write_text("[supervisor]\nengine = 'stock'\n")
    assert read_settings(supervisor_options("--guardian-config", str(path))[0])[0].engine == "stock"
    path.write_text("[supervisor]\nengine = 'stock'\n[recovery]\nmax_failures = 2\n")
    with pytest.raises(ConfigError, match=r"--engine stock reads only .*; nothing reads \[recovery\]"):
        read_settings(supervisor_options("--guardian-config", str(path))[0])
    # Of [guardian], what the supervisor acts on itself: its deadlines, Retry-After, the drain.
    path.write_text("[supervisor]\nengine = 'stock'\n[guardian]\nexit_grace_s = 20\nrequest_timeout_s = 60\n")
    assert read_settings(supervisor_options("--guardian-config", str(path))[0])[1].exit_grace_s == 20
    path.write_text("[supervisor]\nengine = 'stock'\n[guardian]\nexit_grace_s = 20\nmax_stop_sequences = 4\n")
    with pytest.raises(ConfigError, match=r"nothing reads \[guardian\] max_stop_sequences"):
        read_settings(supervisor_options("--guardian-config", str(path))[0])
    # A stock child's cut stream ends, never waits for the next child: no keepalive to pace.
    path.write_text("[supervisor]\nengine = 'stock'\n[guardian]\nstream_keepalive_s = 2\n")
    with pytest.raises(ConfigError, match=r"nothing reads \[guardian\] stream_keepalive_s"):
        read_settings(supervisor_options("--guardian-config", str(path))[0])
    # Per-client limits are applied by a guardian engine as it admits; stock admits everything.
    # Written at their defaults (a shared file) they limit nothing, and are no error.
    path.write_text("[supervisor]\nengine = 'stock'\n[access]\nclient_max_concurrent = 0\nfair_admission = true\n")
    assert read_settings(supervisor_options("--guardian-config", str(path))[0])[0].engine == "stock"
    for limit in ("client_max_concurrent = 2", "client_tokens_per_minute = 1000", "fair_admission = false"):
        path.write_text(f"[supervisor]\nengine = 'stock'\n[access]\n{limit}\n")
        with pytest.raises(ConfigError, match=rf"\[access\] {limit.split()[0]} is applied by a guardian engine"):
            read_settings(supervisor_options("--guardian-config", str(path))[0])


def test_supervisor_bad_table_or_flag_is_a_usage_error(tmp_path):
    path = tmp_path / "guardian.toml"
    path.write_text("[supervisor]\nwindow = 3\n")
    result = run("--supervise", "--guardian-config", str(path))
    assert result.returncode == 2 and "[supervisor] unknown key 'window'" in result.stderr
    result = run("--supervise", "--supervisor-max-restarts", "-1")
    assert result.returncode == 2 and "--supervisor-max-restarts: must be >= 0" in result.stderr


def test_exit_reasons_come_from_the_exit_codes_table():
    from guardian.exit_codes import EXIT_BOOT_ERROR, reason

    assert reason(EXIT_BOOT_ERROR) == "the model could not be loaded"
    assert reason(99) == "unexpected exit"


def mode_args(mode: str) -> list[str]:
    return ["--supervise"] if mode == "supervised" else []


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_port_already_taken_exits_2_at_once_naming_it(mode, model_cache):
    """Not a traceback and a process left hanging on its engine's thread (what a
    taken port did in one process): exit 2 and the reason, for launchd or systemd."""
    from guardian.exit_codes import EXIT_USAGE

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_guardian(["--port", str(port), *mode_args(mode)],
                              env={"MLX_GUARDIAN_CACHE": str(model_cache)}, timeout=120)
    assert result.returncode == EXIT_USAGE, result.stderr[-2000:]
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    failed = [e for e in events if e["event"] in ("http_bind_failed", "supervisor_bind_failed")]
    assert failed and "in use" in failed[0]["error_message"] and "Traceback" not in result.stderr
    # Before the model loads: a service manager restarting it would load a real model each time.
    assert not [e for e in events if e["event"] in ("engine_ready", "child_started")], events


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_port_past_65535_is_refused_not_wrapped(mode, model_cache):
    from guardian.exit_codes import EXIT_USAGE

    result = run_guardian(["--port", "70000", *mode_args(mode)], env={"MLX_GUARDIAN_CACHE": str(model_cache)},
                          timeout=120)
    assert result.returncode == EXIT_USAGE, result.stderr[-2000:]  # not served on 70000 - 65536 = 4464
    assert "0 to 65535" in result.stderr


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback (::1) to bind")
@pytest.mark.parametrize("mode", BOTH_MODES)
def test_an_ipv6_host_is_served_as_stock_binds_it(mode, model_cache, tmp_path):
    port = free_port()
    proc = spawn_guardian(["--host", "::1", "--port", str(port), *mode_args(mode)], tmp_path / "server.log",
                          model_cache)
    try:
        def models():
            try:
                return httpx.get(f"http://[::1]:{port}/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
                return False
        poll(models, 90, what="/v1/models on [::1]")
    finally:
        proc.terminate()
        proc.wait(30)



def test_check_config_says_what_a_good_file_sets_and_names_what_is_wrong_in_a_bad_one(tmp_path):
    """``mlx-guardian check-config FILE`` checks as a start would, serving nothing: exit 0 and
    the keys the file sets; exit 2 and the start's own message for each kind of mistake."""
    good = tmp_path / "good.toml"
    good.write_text("[guardian]\nrequest_timeout_s = 30\n[http]\nidle_timeout_s = 2\n"
                    "[recovery]\nmax_failures = 3\nwindow_s = 30\n")
    result = run("check-config", str(good))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{good}: valid", "  [guardian] request_timeout_s",
                                          "  [http] idle_timeout_s", "  [recovery] max_failures, window_s"]
    example = run("check-config", str(REPO / "config" / "guardian.example.toml"))
    assert example.returncode == 0 and example.stdout.startswith(f"{REPO / 'config' / 'guardian.example.toml'}: valid")
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert run("check-config", str(empty)).stdout == f"{empty}: valid, every setting at its default\n"

    keys = tmp_path / "keys"
    keys.write_text("alice:sk-a-key-of-the-right-length-0123456789\nalice:sk-a-key-of-another-0123456789\n")
    keys.chmod(0o600)
    bad = {
        "[http]\nidle_timeout_s = -2\n": "http.idle_timeout_s: must be > 0",
        "[recovery]\nmax_failurs = 3\n": "did you mean 'max_failures'?",
        "[nothing]\na = 3\n": "no loaded plugin reads [nothing]",
        '[guardian]\nplugins = ["no.such.module:Plugin"]\n': "no.such.module",
        '[supervisor]\nengine = "stock"\n[recovery]\nmax_failures = 3\n': "nothing reads [recovery]",
        f'[access]\napi_key_file = "{keys}"\n': "'alice' is used twice",
        "[guardian\n": "",  # not TOML
    }
    for text, message in bad.items():
        broken = tmp_path / "broken.toml"
        broken.write_text(text)
        result = run("check-config", str(broken))
        assert result.returncode == 2 and result.stdout == "", (text, result.stdout)
        assert result.stderr.startswith("mlx-guardian: ") and message in result.stderr, (text, result.stderr)
        assert "sk-a-key" not in result.stderr  # a key file's error names the line, never the key
    missing = run("check-config", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "not found" in missing.stderr

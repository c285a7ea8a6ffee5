"""The TOML configuration: defaults, documented example, and clear errors."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
from conftest import run_guardian

from guardian.config.registry import ConfigError
from guardian.config.loading import load_config
from guardian.exit_codes import EXIT_USAGE
from guardian.plugin_manager import make_plugin_manager

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "config" / "guardian.example.toml"


def write(tmp_path, text) -> Path:
    path = tmp_path / "guardian.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_no_file_means_defaults_and_builtin_plugins():
    pm = make_plugin_manager(load_config(None))
    names = {name for name, _ in pm.list_name_plugin()}
    assert {"recovery", "fault_injection"} <= names
    assert pm.get_plugin("fault_injection").settings.enabled is False


def test_example_file_loads_with_every_plugin_section():
    config = load_config(EXAMPLE)
    pm = make_plugin_manager(config)
    assert pm.get_plugin("recovery").settings.max_failures == 5


def test_every_loaded_settings_table_is_in_the_example():
    # The example is written from the registry (tests/test_example_config.py
    # compares it byte for byte); a built-in whose settings are not a
    # registry Table would be missing from it.
    from guardian.config.tables import CORE_TABLES
    from guardian.config.registry import Table

    pm = make_plugin_manager(load_config(None))
    text = EXAMPLE.read_text()
    tables = list(CORE_TABLES)
    for name, plugin in pm.list_name_plugin():
        # Built-ins only: an installed third party's plugin (plugins/notifier) documents its own table.
        if hasattr(plugin, "Settings") and type(plugin).__module__.startswith("guardian."):
            assert issubclass(plugin.Settings, Table), f"{name}: Settings is not a registry Table"
            tables.append(plugin.Settings)
    for table in tables:
        assert f"[{table.table_name}]" in text
        for key in table.settings:
            assert f"\n{key} =" in text, f"{table.table_name}.{key} undocumented in {EXAMPLE.name}"
    # Each says what it does (twelve had no words: the reference's rows were empty).
    wordless = [f"{table.table_name}.{key}" for table in tables for key, setting in table.settings.items()
                if not setting.doc.strip()]
    assert not wordless, f"settings with no description: {wordless}"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[recovery]\nmax_failurez = 3\n", r"\[recovery\] unknown key 'max_failurez' \(did you mean 'max_failures'\?\)"),
        ("[recovery]\nmax_failures = 'three'\n", r"recovery.max_failures: expected int"),
        ("[recovery]\nmax_failures = 0\n", r"recovery.max_failures: must be >= 1"),
        ("[guardian]\nlog_format = 'xml'\n", r"guardian.log_format: must be one of"),
        ("[fault_injection]\nenabled = 1\n", r"fault_injection.enabled: expected bool"),
        ("[fault_injection]\nexception = 'NoSuchError'\n", r"fault_injection.exception"),
        ("[nonesuch]\nx = 1\n", r"no loaded plugin reads \[nonesuch\]$"),
        ("[watchdg]\nx = 1\n", r"no loaded plugin reads \[watchdg\] \(did you mean \[watchdog\]\?\)"),
        ("[promt_guard]\nx = 1\n", r"no loaded plugin reads \[promt_guard\] \(did you mean \[prompt_guard\]\?\)"),
        ("[guardian]\nplugins = ['no.such.module']\n", r"cannot load plugin 'no.such.module'"),
        ("not toml at all [", r"not valid TOML"),
        ("[watchdog]\nladder = ['restart', 'pray']\n", r"watchdog.ladder\[1\]: must be one of 'restart', 'reload', 'exit'"),
        ("[watchdog]\nladder = []\n", r"watchdog.ladder: needs at least 1"),
        ("[watchdog]\ninterval_s = true\n", r"watchdog.interval_s: expected float"),
        ("[watchdog]\nmax_abandoned_loops = -1\n", r"watchdog.max_abandoned_loops: must be >= 0"),
        ("[watchdog]\nmax_abandoned_loops = 'four'\n", r"watchdog.max_abandoned_loops: expected int"),
        ("[guardian]\nplugins = 'x'\n", r"guardian.plugins: expected list"),
        ("[guardian]\nallowed_models = ['a', 3]\n", r"guardian.allowed_models\[1\]: expected str"),
        ("[supervisor]\ninterval_s = 0\n", r"supervisor.interval_s: must be > 0"),
        ("[supervisor]\nengine = 'vllm'\n", r"supervisor.engine: must be one of 'guardian', 'stock'"),
        ("[supervisor]\nwindow = 3\n", r"\[supervisor\] unknown key 'window'"),
        ("supervisor = 3\n", r"\[supervisor\] must be a table"),
        ("[prompt_guard]\nretry_after_s = -1\n", r"prompt_guard.retry_after_s: must be >= 0"),
        # Found by saving each live setting's extremes into a running server: each was taken,
        # and broke it (a watchdog thread dead or asleep for good, every request dropped,
        # /health 503 for ever, the engine failing at each probe until the process exited).
        ("[watchdog]\ninterval_s = inf\n", r"watchdog.interval_s: must be a finite number, got inf"),
        ("[watchdog]\ninterval_s = nan\n", r"watchdog.interval_s: must be a finite number, got nan"),
        ("[watchdog]\ninterval_s = 1e9\n", r"watchdog.interval_s: must be <= 10,"),
        ("[http]\nsend_timeout_s = 1e10\n", r"http.send_timeout_s: must be <= 1e\+09"),
        ("[watchdog]\nstall_timeout_s = nan\n", r"watchdog.stall_timeout_s: must be a finite number"),
        ("[watchdog]\nstall_timeout_s = 0.05\n", r"watchdog.stall_timeout_s: must be >= 0.5"),
        ("[http]\nsend_timeout_s = inf\n", r"http.send_timeout_s: must be a finite number"),
        ("[http]\nsend_buffer_bytes = 2147483648\n", r"http.send_buffer_bytes: must be <= 1073741824"),
        ("[http]\nmax_header_bytes = 9223372036854775807\n", r"http.max_header_bytes: must be <= "),
        ("[http]\nmax_header_count = 1\n", r"http.max_header_count: must be >= 16"),
        ("[resources]\nretry_after_s = nan\n", r"resources.retry_after_s: must be a finite number"),
        ("[resources]\nrefuse_above = inf\n", r"resources.refuse_above: must be a finite number"),
        ("[prompt_guard]\nkv_budget_margin = 1.0\n", r"prompt_guard.kv_budget_margin: must be <= 0.95,"),
        ("[generation_probe]\nprompt = ''\n", r"generation_probe.prompt: must not be empty"),
        # A deep check answered from an old round: "deep" in name only.
        ("[watchdog]\ndeep_check_reuse_s = 1e9\n", r"watchdog.deep_check_reuse_s: must be <= 60"),
        ("[watchdog]\ndeep_check_reuse_s = -1\n", r"watchdog.deep_check_reuse_s: must be >= 0"),
        ("[watchdog]\ndeep_check_reuse_s = nan\n", r"watchdog.deep_check_reuse_s: must be a finite number"),
        # A keepalive every 1e9 s is none, said otherwise; -1 and nan are no period at all.
        ("[guardian]\nstream_keepalive_s = 1e9\n", r"guardian.stream_keepalive_s: must be <= 60"),
        ("[guardian]\nstream_keepalive_s = -1\n", r"guardian.stream_keepalive_s: must be >= 0"),
        ("[guardian]\nstream_keepalive_s = nan\n", r"guardian.stream_keepalive_s: must be a finite number"),
        ("[supervisor]\nidle_stop_s = -1\n", r"supervisor.idle_stop_s: must be >= 0"),
        ("[supervisor]\nidle_stop_s = nan\n", r"supervisor.idle_stop_s: must be a finite number"),
        # Found by a hunt: each raised something other than a ConfigError, which nothing
        # caught. A live save logged a crash and kept nothing; under --supervise every
        # later child exited 1 at start, and the supervisor gave up (exit 6).
        ("[guardian]\nretry_after_s = " + "1" * 401 + "\n",
         r"guardian.retry_after_s: must be <= 1e\+09, got an integer of about 401 digits"),
        ("[guardian]\nretry_after_s = " + "9" * 5000 + "\n", r"not a usable TOML file: Exceeds the limit"),
        ("[guardian]\nallowed_models = " + "[" * 2000 + "]" * 2000 + "\n", r"nested too deeply"),
        ("[http]\nself = 1\n", r"\[http\] unknown key 'self'"),
        # This stop's settings, at their bounds.
        ("[http]\nlinger_s = 31\n", r"http.linger_s: must be <= 30"),
        ("[http]\nlinger_s = -1\n", r"http.linger_s: must be >= 0"),
        ("[supervisor]\nreap_wait_s = 0\n", r"supervisor.reap_wait_s: must be > 0"),
        ("[http]\nmax_lingering = -1\n", r"http.max_lingering: must be >= 0"),
        ("[watchdog]\njoin_timeout_s = 0.05\n", r"watchdog.join_timeout_s: must be >= 0.1"),
        ("[watchdog]\njoin_timeout_s = inf\n", r"watchdog.join_timeout_s: must be a finite number"),
        ("[supervisor]\nisolation_wait_s = -1\n", r"supervisor.isolation_wait_s: must be >= 0"),
        # Past 5 it was taken, and cut to 5 without a word (the checks run on the main loop).
        ("[supervisor]\nhealth_timeout_s = 10\n", r"supervisor.health_timeout_s: must be <= 5"),
        ("[prompt_guard]\nself = 1\n", r"\[prompt_guard\] unknown key 'self'"),
        ("[prompt_guard]\nmax_queue_wait_s = " + "1" * 401 + "\n", r"prompt_guard.max_queue_wait_s: must be <= "),
        # A path no request names: /metrics stayed closed without a word.
        ('[access]\npublic_paths = ["/health", "metrics"]\n', r"access.public_paths\[1\]: must be a path that starts with / and has no query, got 'metrics'"),
        ('[access]\npublic_paths = ["/metrics?x=1"]\n', r"access.public_paths\[0\]: must be a path that starts"),
        # The 2026-12-06 stop's settings, at their bounds.
        ("[watchdog]\nunwind_timeout_s = 0.5\n", r"watchdog.unwind_timeout_s: must be >= 1"),
        ("[watchdog]\nunwind_timeout_s = 61\n", r"watchdog.unwind_timeout_s: must be <= 60"),
        ("[watchdog]\nunwind_timeout_s = nan\n", r"watchdog.unwind_timeout_s: must be a finite number"),
        ("[supervisor]\nchild_verdict_wait_s = 0\n", r"supervisor.child_verdict_wait_s: must be > 0"),
        ("[supervisor]\nchild_verdict_wait_s = 61\n", r"supervisor.child_verdict_wait_s: must be <= 60"),
        ("[supervisor]\nboot_attempts = 0\n", r"supervisor.boot_attempts: must be >= 1"),
        ("[supervisor]\nboot_attempts = 1.5\n", r"supervisor.boot_attempts: expected int"),
        ("[supervisor]\nhandoff_pause_s = -1\n", r"supervisor.handoff_pause_s: must be >= 0"),
        ("[supervisor]\nhandoff_pause_s = inf\n", r"supervisor.handoff_pause_s: must be a finite number"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        make_plugin_manager(load_config(write(tmp_path, text)))


SECRET = "https://hooks.example/services/T0SECRET/XXXXSECRETTOKEN"


@pytest.mark.parametrize("text, shown", [
    (f"[guardian]\nplugins = '{SECRET}'\n", f"got a string of {len(SECRET)} characters"),
    (f"[guardian]\nlog_format = '{SECRET}'\n", f"got a string of {len(SECRET)} characters"),
    (f"[watchdog]\nladder = ['{SECRET}']\n", f"got a string of {len(SECRET)} characters"),
    (f"[guardian]\nrequest_timeout_s = ['{SECRET}']\n", "got a list of 1 items"),
    (f"[guardian]\nallowed_models = {{ key = '{SECRET}' }}\n", "got a table"),
    ("[recovery]\nmax_failures = 0\n", "got 0"),  # numbers are no secret, and say the most
])
def test_a_refused_value_is_described_never_echoed(tmp_path, text, shown):
    """The message goes to the log and /guardian/status: a string in the wrong key may be
    a secret (a webhook's URL in a string where a list was due), so it is never quoted."""
    with pytest.raises(ConfigError) as refused:
        make_plugin_manager(load_config(write(tmp_path, text)))
    assert shown in str(refused.value) and "SECRET" not in str(refused.value)


def test_server_refuses_to_start_with_bad_config(tmp_path):
    path = write(tmp_path, "[recovery]\nbogus = true\n")
    result = run_guardian(["--guardian-config", str(path), "--port", "1"])
    assert result.returncode == EXIT_USAGE
    assert "unknown key 'bogus'" in result.stderr


def test_file_paths_in_the_file_are_the_files_folders(tmp_path, monkeypatch):
    """A relative api_key_file was read from the working directory, / under systemd:
    "keys.txt" beside the configuration was another folder's file, or none."""
    folder = tmp_path / "etc"
    folder.mkdir()
    path = folder / "guardian.toml"
    path.write_text('[access]\napi_key_file = "keys.txt"\nssl_certfile = "~/tls/cert.pem"\n'
                    'ssl_keyfile = "/srv/tls/key.pem"\n')
    monkeypatch.chdir(tmp_path)
    access = load_config(path).access
    assert access.api_key_file == str(folder / "keys.txt")
    assert access.ssl_certfile == str(Path.home() / "tls" / "cert.pem")
    assert access.ssl_keyfile == "/srv/tls/key.pem"
    # A flag's stays the working directory's, as any command's.
    flags = SimpleNamespace(api_key_file="mine.txt", ssl_certfile=None, ssl_keyfile=None)
    assert load_config(path).access.with_flags(flags).api_key_file == "mine.txt"
    # The server reads that file at start, and names it whole in what it says.
    (folder / "keys.txt").write_text("short\n")
    result = run_guardian(["--guardian-config", str(path), "--port", "1"], cwd=tmp_path)
    assert result.returncode == EXIT_USAGE and f"{folder / 'keys.txt'}, line 1" in result.stderr, result.stderr


def test_third_party_plugin_from_config(tmp_path, monkeypatch):
    module = tmp_path / "my_guardian_plugin.py"
    module.write_text(textwrap.dedent('''
        from dataclasses import dataclass
        import guardian

        @dataclass
        class Settings:
            greeting: str = "hello"

        class Greeter:
            name = "greeter"
            Settings = Settings
            def __init__(self, settings):
                self.settings = settings
            @guardian.hookimpl
            def on_engine_restarted(self, restarts):
                pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, '[guardian]\nplugins = ["my_guardian_plugin:Greeter"]\n[greeter]\ngreeting = "hi"\n')
    pm = make_plugin_manager(load_config(path))
    assert pm.get_plugin("greeter").settings.greeting == "hi"


def test_engine_step_hook_is_skipped_unless_a_plugin_is_active(tmp_path):
    from guardian.plugin_manager import active_hook

    assert active_hook(make_plugin_manager(load_config(None)), "on_engine_step") is None
    enabled = write(tmp_path, "[fault_injection]\nenabled = true\n")
    hook = active_hook(make_plugin_manager(load_config(enabled)), "on_engine_step")
    assert [impl.plugin_name for impl in hook.get_hookimpls()] == ["fault_injection"]


def test_a_third_party_settings_dataclass_is_checked_by_the_registry_types():
    from guardian.config.loading import parse_settings

    @dataclass
    class Settings:
        count: int = field(default=1, metadata={"min": 0})
        ratio: float = 0.5
        mode: str = field(default="a", metadata={"choices": ("a", "b")})
        label: Optional[str] = None
        words: list[str] = field(default_factory=list)
        share: float = field(default=0.5, metadata={"min": 0.0, "max": 1.0})

    parsed = parse_settings(Settings, {"ratio": 2, "mode": "b", "words": ["x"]}, "mine")
    assert parsed == Settings(count=1, ratio=2.0, mode="b", words=["x"]) and isinstance(parsed.ratio, float)
    # The items of a list[str] and a "max" were not checked: [1, 2] was taken, and failed every request.
    for table, message in [({"count": -1}, r"mine.count: must be >= 0"),
                           ({"mode": "c"}, r"mine.mode: must be one of 'a', 'b'"),
                           ({"label": 3}, r"mine.label: expected str or none"),
                           ({"words": [1, 2]}, r"mine.words\[0\]: expected str"),
                           ({"share": 2.0}, r"mine.share: must be <= 1"),
                           ({"nope": 1}, r"\[mine\] unknown key 'nope'")]:
        with pytest.raises(ConfigError, match=message):
            parse_settings(Settings, table, "mine")


def test_the_ladder_and_recovery_decide_among_one_set_of_actions():
    from guardian.config.tables import WatchdogSettings
    from guardian.plugins.recovery import Recovery, RecoverySettings
    from guardian.config.registry import ACTIONS

    assert WatchdogSettings().ladder == list(ACTIONS)
    recovery = Recovery(RecoverySettings())
    decisions = {recovery.on_engine_error(classification="unknown", failures_in_window=n, engine=None) for n in range(1, 8)}
    assert decisions == set(ACTIONS)


def test_a_flag_wins_over_the_file(tmp_path):
    import argparse

    config = load_config(write(tmp_path, "[guardian]\nlog_format = 'console'\nexit_grace_s = 2\n"))
    assert config.core.with_flags(argparse.Namespace(log_format="json")).log_format == "json"
    kept = config.core.with_flags(argparse.Namespace(log_format=None))
    assert (kept.log_format, kept.exit_grace_s) == ("console", 2.0)


def test_a_byte_order_mark_is_no_toml(tmp_path):
    # Windows Notepad and some editors begin a UTF-8 file with one: it was refused at
    # start as "Invalid statement (at line 1, column 1)" in a file that looks right.
    path = tmp_path / "bom.toml"
    path.write_bytes("\ufeff[guardian]\nretry_after_s = 3\n".encode())
    assert load_config(path).core.retry_after_s == 3.0


def test_third_party_plugin_may_declare_a_registry_table(tmp_path, monkeypatch):
    module = tmp_path / "my_table_plugin.py"
    module.write_text(textwrap.dedent('''
        import guardian
        from guardian.config.registry import Float, Setting, Table

        class Pager:
            name = "pager"

            class Settings(Table, name="pager"):
                delay_s = Setting(Float(min=0), 1.5, "Seconds before paging.")

            def __init__(self, settings):
                self.settings = settings

            @guardian.hookimpl
            def on_engine_restarted(self, restarts):
                pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins = '[guardian]\nplugins = ["my_table_plugin:Pager"]\n'
    pm = make_plugin_manager(load_config(write(tmp_path, plugins + "[pager]\ndelay_s = 3\n")))
    assert pm.get_plugin("pager").settings.delay_s == 3.0
    with pytest.raises(ConfigError, match=r"pager.delay_s: must be >= 0"):
        make_plugin_manager(load_config(write(tmp_path, plugins + "[pager]\ndelay_s = -1\n")))

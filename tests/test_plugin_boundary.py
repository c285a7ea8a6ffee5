"""The plugin boundary: how plugins are found, named, disabled and contained.

Third-party plugins are real installed distributions here: a ``.dist-info``
folder with an ``entry_points.txt`` on ``sys.path`` is what pip leaves
behind, and importlib.metadata finds it the same way.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from guardian.config.registry import ConfigError
from guardian.config.loading import load_config
from guardian import hookspecs
from guardian.plugin_manager import REQUIRED_HOOKS, make_plugin_manager, plugin_entry_points

BUILT_INS = {"recovery", "fault_injection", "prompt_guard", "generation_probe", "resources", "metrics", "access"}


def installed_third_party() -> set[str]:
    """Plugins installed as distributions of their own: `make test` installs the
    optional first-party ones of plugins/ (notifier, blocked_words) this way."""
    return {ep.name for ep in plugin_entry_points()[0]}


def config_with(tmp_path, text: str = ""):
    path = tmp_path / "guardian.toml"
    path.write_text(textwrap.dedent(text))
    return load_config(path)


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """Install a distribution named ``extra-plugin`` whose entry point is ``name``."""

    def install(source: str, name: str = "extra") -> None:
        (tmp_path / "extra_plugin_module.py").write_text(textwrap.dedent(source))
        dist = tmp_path / "extra_plugin-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-plugin\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(
            f"[{hookspecs.PROJECT_NAME}]\n{name} = extra_plugin_module:Extra\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        # Each test installs its own module of that name.
        monkeypatch.delitem(sys.modules, "extra_plugin_module", raising=False)

    yield install
    sys.modules.pop("extra_plugin_module", None)


EXTRA = """
    import guardian

    class Extra:
        name = "extra"

        @guardian.hookimpl
        def sample_resources(self):
            return {"extra": 1}
"""


def test_built_ins_are_entry_points_of_this_distribution():
    _, built_in = plugin_entry_points()
    assert {ep.name for ep in built_in} == BUILT_INS
    assert all(ep.value.startswith("guardian.plugins.") for ep in built_in)
    pm = make_plugin_manager(load_config(None))
    assert {name for name, _ in pm.list_name_plugin()} == BUILT_INS | installed_third_party()


def test_a_third_party_entry_point_is_loaded(tmp_path, installed_plugin):
    installed_plugin(EXTRA)
    third_party, _ = plugin_entry_points()
    assert "extra" in [ep.name for ep in third_party]
    pm = make_plugin_manager(config_with(tmp_path))
    assert pm.has_plugin("extra")
    assert "extra" in [impl.plugin_name for impl in pm.hook.sample_resources.get_hookimpls()]


def test_disabled_plugins_covers_entry_point_plugins(tmp_path, installed_plugin):
    installed_plugin(EXTRA)
    pm = make_plugin_manager(config_with(tmp_path, '[guardian]\ndisabled_plugins = ["extra", "resources"]\n'))
    names = {name for name, _ in pm.list_name_plugin()}
    assert "extra" not in names and "resources" not in names
    assert "prompt_guard" in names


def test_a_misspelt_disabled_plugin_is_a_configuration_error_and_a_disabled_ones_table_is_kept(tmp_path):
    """A misspelt name in disabled_plugins left its plugin on, silently, where every other
    typo in the file stops the start; and a plugin turned off with its table still in the
    file stopped the start ("no loaded plugin reads [prompt_guard]")."""
    with pytest.raises(ConfigError, match=r"disabled_plugins: no plugin is named 'notifer'; those found: .*notifier"):
        make_plugin_manager(config_with(tmp_path, '[guardian]\ndisabled_plugins = ["notifer"]\n'))
    pm = make_plugin_manager(config_with(tmp_path, '[guardian]\ndisabled_plugins = ["prompt_guard"]\n'
                                                   "[prompt_guard]\nmax_context_tokens = 100\n"))
    assert pm.get_plugin("prompt_guard") is None


def test_two_plugins_with_one_name_are_a_configuration_error(tmp_path, installed_plugin):
    installed_plugin(EXTRA.replace('name = "extra"', 'name = "resources"'))
    with pytest.raises(ConfigError, match=r"two plugins are named 'resources'") as refused:
        make_plugin_manager(config_with(tmp_path))
    # The advice works: the entry point's name leaves out the installed one alone (the
    # advice was the name they share, which leaves out both).
    assert "entry point's name" in str(refused.value)
    pm = make_plugin_manager(config_with(tmp_path, '[guardian]\ndisabled_plugins = ["extra"]\n'))
    assert type(pm.get_plugin("resources")).__module__ == "guardian.plugins.resources"


@pytest.mark.parametrize("broken, message", [
    # a misspelt hook, named with its plugin (the message showed "<extra_plugin_module.Extra object at 0x...>")
    (EXTRA.replace("def sample_resources", "def sample_resource"),
     r"plugin 'extra' \(extra_plugin_module:Extra\): .*sample_resource"),
    (EXTRA.replace('name = "extra"', 'name = "extra"\n        def __init__(self):\n            raise RuntimeError("no")'),
     "RuntimeError: no"),
    ("import guardian\nraise RuntimeError('at import')\n", "at import"),
])
def test_a_plugin_that_cannot_load_is_a_configuration_error(tmp_path, installed_plugin, broken, message):
    """Exit 2 at start, not an uncaught exception's exit 1, which a supervisor took for a
    crash to retry, six times over."""
    installed_plugin(broken)
    with pytest.raises(ConfigError, match=message):
        make_plugin_manager(config_with(tmp_path))


@pytest.mark.parametrize("hook, plugin", [("on_engine_error", "recovery"), ("probe", "generation_probe"),
                                          ("check_access", "access")])
def test_a_required_hook_missing_at_start_is_a_clear_error(tmp_path, hook, plugin):
    with pytest.raises(ConfigError, match=rf"no plugin implements {hook}"):
        make_plugin_manager(config_with(tmp_path, f'[guardian]\ndisabled_plugins = ["{plugin}"]\n'))


def test_a_replacement_for_a_disabled_built_in_satisfies_the_requirement(tmp_path, installed_plugin):
    installed_plugin("""
        import guardian

        class Extra:
            name = "always_exit"

            @guardian.hookimpl
            def on_engine_error(self):
                return "exit"
    """, name="always_exit")
    pm = make_plugin_manager(config_with(tmp_path, '[guardian]\ndisabled_plugins = ["recovery"]\n'))
    assert pm.hook.on_engine_error(error=None, classification="unknown", failures_in_window=1,
                                   engine=None) == "exit"


def test_a_plugins_error_is_typed_by_its_status_unless_it_says():
    """A plugin's refusal with status 400 and no type told its client "server_error"."""
    from guardian.errors import GuardianError

    assert GuardianError("blocked", status=400).body()["error"]["type"] == "invalid_request_error"
    assert GuardianError("busy", status=429).body()["error"]["type"] == "rate_limit_error"
    assert GuardianError("down").body()["error"]["type"] == "server_error"
    assert GuardianError("no", status=403, type="permission_error").body()["error"]["type"] == "permission_error"


def test_required_hooks_are_hooks():
    assert set(REQUIRED_HOOKS) <= {name for name in dir(hookspecs) if not name.startswith("_")}


# -- observers are contained, start-up and shutdown included (real servers) ----------
RAISING = '[guardian]\nplugins = ["tests.plugins.raising_observers:RaisingObservers"]\n'


def hook_failures(server) -> list[str]:
    return [e["hook"] for e in server.events("plugin_hook_failed")]


def test_start_up_shutdown_and_sampling_hooks_that_raise_are_contained(start_server):
    import signal

    import httpx

    from conftest import chat_body, poll

    server = start_server(RAISING + "[watchdog]\nresource_interval_s = 0.1\n")
    response = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=60)
    assert response.status_code == 200, response.text
    # Its sample raises at each look: the built-in resources plugin's gauges are sampled still
    # (one plugin's raise took every plugin's with it, the memory thresholds' included).
    def sampled_at():
        sample = httpx.get(server.url + "/guardian/status", timeout=5).json()["last_resource_sample"]
        return sample is not None and "memory_used_bytes" in sample and sample["at"]

    first = poll(sampled_at, 10, what="a resource sample")
    poll(lambda: sampled_at() != first, 10, what="the next resource sample")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    # Said once, not at every sample.
    assert hook_failures(server) == ["guardian_startup", "sample_resources", "guardian_shutdown"]
    # What hooks get is the facade, never the engine itself.
    assert {e["engine_type"] for e in server.events("observer_saw_engine")} == {"EngineView"}


def test_a_shutdown_hook_that_raises_keeps_the_exit_code(start_server):
    from guardian.exit_codes import EXIT_ENGINE_FAILED

    # Every engine step fails, the start-up probe's included: a crash loop.
    server = start_server(RAISING + "[fault_injection]\nenabled = true\nevery_n_steps = 1\n"
                          "[recovery]\nmax_failures = 1\n", wait=False)
    assert server.proc.wait(timeout=60) == EXIT_ENGINE_FAILED
    assert "guardian_shutdown" in hook_failures(server)


def test_an_observer_that_raises_leaves_the_others_called():
    """pluggy ends a call at its first exception: the plugins after one that raised
    (the notifier's alerts, the access plugin's token charge) were never told."""
    import pluggy
    from structlog.testing import capture_logs

    import guardian
    from guardian.plugin_manager import notify

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    told = []

    class Broken:
        @guardian.hookimpl(tryfirst=True)
        def on_stall(self, engine, heartbeat_age_s, action):
            raise RuntimeError("a plugin's bug")

    class Listening:
        @guardian.hookimpl
        def on_stall(self, engine, heartbeat_age_s, action):
            told.append(action)

    pm.register(Listening(), name="listening")
    pm.register(Broken(), name="broken")
    with capture_logs() as logs:
        notify(pm.hook.on_stall, engine=None, heartbeat_age_s=3.0, action="restart")
    assert told == ["restart"]
    assert [(e["event"], e["plugin"]) for e in logs] == [("plugin_hook_failed", "broken")]


def test_an_admission_hook_returning_neither_none_nor_an_error_is_a_500_in_openais_shape(start_server):
    import httpx

    from conftest import chat_body

    server = start_server('[guardian]\nplugins = ["tests.plugins.odd_admission:OddAdmission"]\n')
    response = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=60)
    # Stock's 404 with an AttributeError's words ('str' object has no attribute 'message') before.
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == "internal_error"
    [failed] = server.events("admission_failed")
    assert failed["returned_type"] == "str" and failed["plugin"] == "odd_admission"  # it named none


def test_a_probe_that_raises_is_a_failed_result_naming_its_plugin(start_server):
    """It killed the probe thread: /readyz?deep=1 got an empty reply, and readiness went
    stale, since the built-in probe's passing result was thrown away with it."""
    import httpx

    from conftest import poll

    # Never ready: a probe that fails holds readiness (the start waits for /readyz).
    server = start_server('[guardian]\nplugins = ["tests.plugins.raising_probe:RaisingProbe"]\n', wait=False)
    poll(lambda: server.health() == 200, 60, what="the engine serving")
    response = httpx.get(server.url + "/readyz?deep=1", timeout=60)
    assert response.status_code == 503, response.text
    results = {r["name"]: r for r in response.json()["last_probe"]["results"]}
    assert results["raising_probe"]["ok"] is False
    assert "a probe plugin's bug" in results["raising_probe"]["error"]
    assert results["generation"]["ok"] is True  # the built-in's result kept beside it
    assert any(e.get("plugin") == "raising_probe" for e in server.events("plugin_hook_failed"))


def test_a_probe_that_overruns_its_deadline_is_cut_off_and_not_run_twice_at_once(start_server):
    """It held the probe round's lock for as long as it ran: every later /readyz?deep=1
    waited behind it (here for good), and so did every later round."""
    import time

    import httpx

    from conftest import poll

    server = start_server('[guardian]\nplugins = ["tests.plugins.stuck_probe:StuckProbe"]\n'
                          '[watchdog]\nprobe_timeout_s = 1.0\n', wait=False)
    poll(lambda: server.health() == 200, 60, what="the engine serving")
    for round_ in range(2):
        asked_at = time.monotonic()
        response = httpx.get(server.url + "/readyz?deep=1", timeout=30)
        print(f"\nmeasured: deep readiness {round_} answered in {time.monotonic() - asked_at:.2f} s")
        assert response.status_code == 503, response.text
        results = {r["name"]: r for r in response.json()["last_probe"]["results"]}
        assert results["stuck_probe"]["ok"] is False
        assert ("no result within" in results["stuck_probe"]["error"]
                or "previous probe has not returned" in results["stuck_probe"]["error"]), results
        assert results["generation"]["ok"] is True  # the built-in's result kept beside it
    # The first round (at start) was cut off and left running; no round started a second.
    assert len(server.events("stuck_probe_called")) == 1
    [overran] = server.events("probe_overran")
    assert overran["plugin"] == "stuck_probe"


def test_a_hook_wrapper_is_refused_at_start_naming_its_plugin_and_hook(tmp_path, installed_plugin):
    """The guardian calls each implementation on its own, so that one plugin's failure is
    contained; one wrapper made the call pluggy's own for every plugin of its hook, and a
    plugin that raised there silenced the built-in memory thresholds' sample."""
    installed_plugin("""
        import guardian

        class Extra:
            name = "extra"

            @guardian.hookimpl(wrapper=True)
            def on_resource_sample(self):
                return (yield)
    """)
    with pytest.raises(ConfigError, match=r"plugin 'extra': its on_resource_sample is a hook wrapper"):
        make_plugin_manager(config_with(tmp_path))


def test_a_recovery_plugins_bug_is_passed_over_not_the_end_of_the_process(start_server):
    """Its typo'd answer ("restart ") raised, and so did its classification: the engine gave
    up at the first failure, exit 4 ("the engine kept failing"), blaming the engine."""
    import httpx

    from conftest import chat_body

    server = start_server("""
        [guardian]
        plugins = ["tests.plugins.careless_plugins:TypoRecovery"]
        [fault_injection]
        enabled = true
        at_step = 3
    """)
    with httpx.Client(timeout=60) as client:
        response = client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=8))
        assert response.status_code == 200, response.text  # re-run on the restarted loop
        assert client.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4)).status_code == 200
    assert server.proc.poll() is None and not server.events("engine_gave_up")
    [error] = server.events("engine_error")
    assert error["classification"] == "metal_resource_limit"  # the built-in's, the plugin's raised
    assert [(e["hook"], e["plugin"]) for e in server.events("plugin_hook_failed")] == [
        ("classify_engine_error", "typo_recovery")]
    [invalid] = server.events("plugin_hook_answer_invalid")
    assert (invalid["hook"], invalid["plugin"], invalid["answer"]) == ("on_engine_error", "typo_recovery",
                                                                      "'restart '")


def test_a_door_plugin_answering_what_is_no_decision_refuses_with_a_500(start_server):
    """A GuardianError (admit_request's way) or True from check_access: the client got no
    reply at all, and a traceback went to stderr unstructured."""
    import httpx

    server = start_server('[guardian]\nplugins = ["tests.plugins.careless_plugins:WrongDoor"]\n')
    for path in ("/ge", "/true"):
        response = httpx.get(server.url + path, timeout=10)
        assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error", path
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # no opinion: the built-in decides
    failed = server.events("access_check_failed")
    assert [e["path"] for e in failed] == ["/ge", "/true"] and {e["plugin"] for e in failed} == {"wrong_door"}
    assert "Traceback" not in server.log_path.read_text()


def test_a_save_whose_live_settings_clash_with_those_bound_at_start_is_refused_not_a_crash(start_server):
    """The live key of the new version beside the start's value of the other failed the
    plugin's own check inside the merge: config_reload_crashed and a traceback, and the
    status kept an older, unrelated failure."""
    import httpx

    from conftest import poll

    head = '[guardian]\nplugins = ["tests.plugins.careless_plugins:RangeGate"]\n[range_gate]\n'
    server = start_server(head)
    config = server.config
    config.write_text(head + "low = 15\nhigh = 20\n")  # whole, fine; with high as at start (10), not
    failure = poll(lambda: httpx.get(server.url + "/guardian/status", timeout=5).json()["config"]["last_failure"],
                   10, what="the save refused")
    assert "low (15) is above high (10)" in failure["error_message"], failure
    # The status may say so before the line is written: polled for too.
    [failed] = poll(lambda: server.events("config_reload_failed"), 5, what="config_reload_failed logged")
    assert "do not go with those in force until a restart" in failed["error_message"]
    assert not server.events("config_reload_crashed")
    assert server.health() == 200


def test_a_sample_of_what_are_no_numbers_or_another_plugins_gauges_is_left_out(start_server):
    """A plugin's text and table went into the status, and its memory_used_bytes replaced
    the built-in's: a made-up petabyte paused admission and trimmed the prompt cache."""
    import httpx

    from conftest import poll

    server = start_server('[guardian]\nplugins = ["tests.plugins.careless_plugins:OddSampler"]\n'
                          "[watchdog]\nresource_interval_s = 0.1\n")

    def sample():
        return httpx.get(server.url + "/guardian/status", timeout=5).json()["last_resource_sample"] or {}

    sampled = poll(lambda: "odd_count" in sample() and sample(), 10, what="a sample with the plugin's gauge")
    assert sampled["odd_count"] == 3 and "odd_text" not in sampled and "odd_table" not in sampled
    assert sampled["memory_used_bytes"] < 10 ** 15  # the built-in's
    [failed] = [e for e in server.events("plugin_hook_failed") if e["plugin"] == "odd_sampler"]
    assert "'odd_text', 'odd_table', 'memory_used_bytes'" in failed["error_message"]
    assert not server.events("memory_trimmed") and not server.events("memory_admission_paused")


def test_a_wrongly_typed_default_in_a_plugins_settings_is_said_to_be_the_plugins(tmp_path, installed_plugin):
    """It was reported as the file's key (``[extra] words: expected list, ...``), and the
    operator's file has no such key: the author's mistake sent them looking in the file."""
    installed_plugin("""
        from dataclasses import dataclass

        import guardian

        @dataclass
        class Settings:
            limit: int = "3"

        class Extra:
            name = "extra"
            Settings = Settings

            def __init__(self, settings):
                self.settings = settings

            @guardian.hookimpl
            def guardian_startup(self):
                pass
    """)
    with pytest.raises(ConfigError, match=r"extra\.limit: expected int, got a string of 1 characters: "
                                          r"the default declared in the plugin's extra_plugin_module\.Settings, "
                                          r"not a value from the file"):
        make_plugin_manager(config_with(tmp_path))

"""The --guardian-config file edited under a running server, and memory thresholds acting.

One server for the module (its file rewritten by each test, from a base
every test starts from): live settings apply without a restart, a broken
edit changes nothing, a setting bound at start is logged as needing a
restart, SIGHUP re-reads; then the resources plugin's thresholds, set low
in bytes on the CPU, trim the prompt cache and refuse (429) until memory
falls back.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import signal
import textwrap
import sys
import threading

import httpx
import mlx.core as mx
import pytest

from conftest import BOTH_MODES, Server, SessionServer, chat_body, free_port, poll, spawn_guardian

# Run once, in the 0.31.3 lane of `make test` (tools/test_lanes.sh balances its lanes).
pytestmark = [pytest.mark.one_version, pytest.mark.lane_0313]

CHAT = "/v1/chat/completions"
# Probes stay out of the way (the start-up one makes the server ready);
# samples come often, so thresholds act quickly; thresholds off; faults may
# be armed by a save (armable is read at start), none are.
BASE = """\
[watchdog]
probe_interval_s = 600
resource_interval_s = 0.2
[resources]
trim_above = 0
refuse_above = 0
[fault_injection]
armable = true
"""
# About 30 prompt tokens with the demo model's chat template.
PROMPT = "Tell me a long story about a cat who sails around the world."


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_cache):
    folder = tmp_path_factory.mktemp("live-config")
    config = folder / "guardian.toml"
    config.write_text(BASE)
    port = free_port()
    # The log in the watched folder too: its writes are events the watcher must ignore.
    log_path = folder / "server.log"
    proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config)], log_path, model_cache)
    server = Server(proc, port, log_path)
    server.wait_healthy()
    server.config_path = config
    yield server
    server.stop()


def status(server: Server) -> dict:
    return httpx.get(server.url + "/guardian/status", timeout=5).json()


def save(server: Server, text: str, *, by_rename: bool = True) -> str:
    """Write the file as editors do (a new file renamed over it), or in place; its sha256."""
    data = textwrap.dedent(text).encode()
    path = server.config_path
    if by_rename:
        temporary = path.with_name(path.name + ".swp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
    else:
        path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def save_and_wait(server: Server, text: str, **kwargs) -> dict:
    """Save ``text`` and wait until /guardian/status says that version is live."""
    sha = save(server, text, **kwargs)
    return poll(lambda: (s := status(server))["config"]["sha256"] == sha and s, 10, interval=0.05,
                what=f"version {sha[:12]} live")


def chat(server: Server, content: str = PROMPT, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(server.url + CHAT, json=chat_body(content, max_tokens=max_tokens), timeout=30)


def test_an_edit_applies_live_settings_without_a_restart(served):
    save_and_wait(served, BASE)
    before = status(served)["config"]
    assert before["watching"] is True
    assert chat(served).status_code == 200
    assert not served.events("resource_sample")  # INFO: no debug lines yet

    handlers = status(served)["connections"]["max_handlers"]
    live = save_and_wait(served, BASE + "[prompt_guard]\nmax_prompt_tokens = 8\nmax_queued = 116\n"
                         "[guardian]\nlog_level = \"DEBUG\"\n")["config"]
    # The handler threads' cap, sized from the queue, follows it (it stayed at the start's).
    assert status(served)["connections"]["max_handlers"] == handlers + 100
    assert live["loads"] > before["loads"] and live["reason"] == "file_changed"
    assert live["pending_restart"] == [] and live["last_failure"] is None
    refused = chat(served)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert "limit of 8 prompt tokens" in refused.json()["error"]["message"]
    # The log level changed too: the resource samples' debug lines appear.
    served.wait_for_event("resource_sample")
    reloaded = served.events("config_reloaded")[-1]
    assert set(reloaded["changed"]) == {"prompt_guard.max_prompt_tokens", "prompt_guard.max_queued",
                                        "guardian.log_level"}
    # The same process all along.
    assert served.proc.poll() is None and len(served.events("server_started")) == 1

    save_and_wait(served, BASE, by_rename=False)  # an edit in place
    assert chat(served).status_code == 200


def test_a_broken_save_seen_twice_is_refused_and_said_once(tmp_path, capsys):
    """One save can come as two events (a rename and a late event, a change of mode, the
    watch's poll): a good version read twice is applied once, and now a broken one is
    refused and said once too, as the key file's is. It was logged once per event."""
    import json

    from guardian.config.live import LiveConfig
    from guardian.config.loading import load_config
    from guardian.observability.logs import configure_logging

    configure_logging("json", "INFO")
    path = tmp_path / "guardian.toml"
    path.write_text("[watchdog]\nstall_min_s = 3.0\n")
    live = LiveConfig(load_config(path))
    in_force = live.config.sha256
    path.write_text("[watchdog\n")  # not TOML
    assert live.reload("file_changed") is None and live.reload("file_changed") is None
    assert live.reload("sighup") is None  # asked for: read and said again
    path.write_text("[watchdog]\nstall_min_s = 0.1\n")  # another broken version
    assert live.reload("file_changed") is None and live.reload("file_changed") is None
    failed = [json.loads(line) for line in capsys.readouterr().err.splitlines() if "config_reload_failed" in line]
    assert [e["reason"] for e in failed] == ["file_changed", "sighup", "file_changed"], failed
    assert live.config.sha256 == in_force and "stall_min_s" in live.last_failure["error_message"]


def test_a_disabled_plugins_table_left_in_the_file_is_kept_unread_by_a_save_too(tmp_path):
    """Start keeps a disabled plugin's table unread (turned off for a while); a save
    refused it ("no loaded plugin reads [resources]"), so a file that started fine
    had every later save refused (found by a review, on a live server)."""
    from guardian.config.live import LiveConfig
    from guardian.config.loading import load_config

    path = tmp_path / "guardian.toml"
    kept = '[guardian]\ndisabled_plugins = ["resources"]\n[resources]\nrefuse_above = 0.9\n'
    path.write_text(kept + "[watchdog]\nstall_min_s = 3.0\n")
    live = LiveConfig(load_config(path))
    path.write_text(kept + "[watchdog]\nstall_min_s = 4.0\n")
    assert live.reload("file_changed") is not None, live.last_failure
    assert live.config.watchdog.stall_min_s == 4.0


def test_a_broken_version_saved_while_another_is_read_is_said_on_its_own(tmp_path, capsys, monkeypatch):
    """A save that lands while a broken version is read: the refusal was filed under the
    new bytes (hashed after the read) with the old version's error, and the new version's
    own error was then taken for one already said (a hunt, from the code)."""
    import json

    from guardian.config import live as live_module
    from guardian.observability.logs import configure_logging

    configure_logging("json", "INFO")
    path = tmp_path / "guardian.toml"
    path.write_text("[watchdog]\nstall_min_s = 3.0\n")
    live = live_module.LiveConfig(live_module.load_config(path))
    path.write_text("[watchdog\n")  # not TOML
    read = live_module.load_config

    def read_as_another_save_lands(file, **kwargs):
        try:
            return read(file, **kwargs)
        finally:
            path.write_text("[watchdog]\nstall_min_s = 0.1\n")  # another broken version

    monkeypatch.setattr(live_module, "load_config", read_as_another_save_lands)
    assert live.reload("file_changed") is None
    monkeypatch.setattr(live_module, "load_config", read)
    assert live.reload("file_changed") is None  # the second save's own event
    failed = [json.loads(line) for line in capsys.readouterr().err.splitlines() if "config_reload_failed" in line]
    assert len(failed) == 2 and "stall_min_s" in failed[1]["error_message"], failed


def test_a_broken_edit_changes_nothing_and_says_why(served):
    live = save_and_wait(served, BASE + "[prompt_guard]\nmax_prompt_tokens = 8\n")["config"]
    failures = len(served.events("config_reload_failed"))

    save(served, BASE + "[prompt_guard]\nmax_prompt_tokens = 8\n[prompt_guard\n")  # not TOML
    [*_, bad_toml] = served.wait_for_event("config_reload_failed", count=failures + 1)
    assert "not valid TOML" in bad_toml["error_message"]
    save(served, BASE + "[prompt_guard]\nmax_prompt_tokens = -1\n")  # not a valid value
    [*_, bad_value] = served.wait_for_event("config_reload_failed", count=failures + 2)
    assert "prompt_guard.max_prompt_tokens: must be >= 0" in bad_value["error_message"]
    # A string where a list was due (a webhook's URL, say) is described, never echoed.
    save(served, BASE + '[guardian]\nallowed_models = "https://hooks.example/T0SECRET"\n')
    [*_, secret] = served.wait_for_event("config_reload_failed", count=failures + 3)
    assert "guardian.allowed_models: expected list, got a string of 30 characters" in secret["error_message"]
    failures += 1
    save(served, BASE + "[no_such_plugin]\nx = 1\n")  # a table nobody reads
    [*_, unknown] = served.wait_for_event("config_reload_failed", count=failures + 3)
    assert "[no_such_plugin]" in unknown["error_message"]
    # A plugin list waits for a restart, but one no start could load is refused at the save
    # (put in force, it was kept for a supervisor's next child, which then could not start).
    save(served, BASE + '[guardian]\nplugins = ["no_such_module"]\n')
    [*_, unloadable] = served.wait_for_event("config_reload_failed", count=failures + 4)
    assert "cannot load plugin 'no_such_module'" in unloadable["error_message"]

    now = status(served)["config"]
    assert now["sha256"] == live["sha256"] and now["loads"] == live["loads"]
    assert "no_such_module" in now["last_failure"]["error_message"]
    assert chat(served).status_code == 400  # the limit of the version in force still holds
    # A list that loads is put in force, waiting for the restart.
    loadable = save_and_wait(served, BASE + '[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n')
    assert loadable["config"]["pending_restart"] == ["guardian.plugins"]
    save_and_wait(served, BASE)


def test_a_context_of_one_token_refuses_every_prompt(served):
    """It left no room for a prompt and was read as "no limit": the clamp left max_tokens
    below 1, the engine failed on it twice, and the request was quarantined for 10 min."""
    save_and_wait(served, BASE + "[prompt_guard]\nmax_context_tokens = 1\n")
    answer = chat(served)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    save_and_wait(served, BASE)
    assert chat(served).status_code == 200
    assert not served.events("engine_error")


def test_a_setting_bound_at_start_is_logged_as_needing_a_restart(served):
    save_and_wait(served, BASE)
    # seed = 2: a key of BASE's last table, [fault_injection].
    # [supervisor] is a supervisor's, read at its start: no restart of this process applies it.
    live = save_and_wait(served, BASE + "seed = 2\n[guardian]\nallow_any_model = true\nretry_after_s = 3\n"
                         "[supervisor]\ninterval_s = 5\n")["config"]
    [*_, needs] = served.wait_for_event("config_change_needs_restart")
    assert set(needs["settings"]) == {"guardian.allow_any_model", "fault_injection.seed"}
    assert set(live["pending_restart"]) == {"guardian.allow_any_model", "fault_injection.seed"}
    assert served.events("config_reloaded")[-1]["changed"] == ["guardian.retry_after_s"]
    # Not applied: a request naming another model is still refused at the door.
    response = httpx.post(served.url + CHAT, json=chat_body(model="some/other-model"), timeout=30)
    assert response.status_code == 404, response.text
    assert save_and_wait(served, BASE)["config"]["pending_restart"] == []


def test_the_kv_budget_margin_is_live(served):
    """[prompt_guard] kv_budget_margin keeps a share of (device memory - weights) out of the
    KV budget: saved at 0.5, the budget is 0.5 / 0.75 of the default's, and back again."""
    save_and_wait(served, BASE)
    [ready] = served.events("prompt_guard_ready")
    assert ready["kv_budget_source"] != "configured"
    seen = len(served.events("prompt_guard_reconfigured"))

    def budget_becomes(expected: float, after: int) -> int:
        """Wait for a reconfiguration to that budget (a save before may log its own first)."""
        def found():
            lines = served.events("prompt_guard_reconfigured")
            return next((i + 1 for i in range(after, len(lines))
                         if abs(lines[i]["kv_budget_bytes"] - expected) <= 2
                         and lines[i]["kv_budget_source"] == ready["kv_budget_source"]), None)
        return poll(found, 10, what=f"a KV budget of {expected:.0f} bytes")

    save_and_wait(served, BASE + "[prompt_guard]\nkv_budget_margin = 0.5\n")
    seen = budget_becomes(ready["kv_budget_bytes"] * 0.5 / 0.75, seen)
    save_and_wait(served, BASE)
    budget_becomes(ready["kv_budget_bytes"], seen)


def test_the_stop_limits_are_live_settings(served):
    stop = {"stop": ["a", "b", "c"]}
    save_and_wait(served, BASE + "[guardian]\nmax_stop_sequences = 2\n")
    refused = httpx.post(served.url + CHAT, json=chat_body(max_tokens=2, **stop), timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
    save_and_wait(served, BASE + "[guardian]\nmax_stop_chars = 8\n")
    for length, status in ((8, 200), (9, 400)):
        answer = httpx.post(served.url + CHAT, json=chat_body(max_tokens=2, stop=["y" * length]), timeout=30)
        assert answer.status_code == status, answer.text
    assert "8 characters" in answer.json()["error"]["message"], answer.text
    save_and_wait(served, BASE + "[guardian]\nmax_stop_sequences = 0\nmax_stop_chars = 0\n")  # 0: no limit
    many = {"stop": ["x" * 300] * 40}
    assert httpx.post(served.url + CHAT, json=chat_body(max_tokens=2, **many), timeout=30).status_code == 200
    save_and_wait(served, BASE)


def test_sighup_rereads_the_file(served):
    loads = save_and_wait(served, BASE)["config"]["loads"]
    served.proc.send_signal(signal.SIGHUP)
    poll(lambda: status(served)["config"]["loads"] == loads + 1, 10, what="a reload after SIGHUP")
    assert status(served)["config"]["reason"] == "sighup"
    assert served.events("config_reloaded")[-1]["reason"] == "sighup"
    assert served.proc.poll() is None  # SIGHUP's default would have ended it


def sample(server: Server) -> dict:
    return status(server)["last_resource_sample"]


def test_the_sample_counts_what_holds_buffers_while_a_request_generates(served):
    save_and_wait(served, BASE)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", served.url + CHAT, json=chat_body(PROMPT, max_tokens=1500, stream=True)):
            busy = poll(lambda: (s := sample(served))["requests_started"] >= 1
                        and (s["requests_kv_cache_bytes"] or 0) > 0 and s, 30,
                        what="a sample taken while a request generates")
    print(f"\nmeasured: requests' KV caches {busy['requests_kv_cache_bytes']} B, "
          f"arrays (estimate) {busy['kv_cache_arrays_estimate']}")
    assert busy["kv_cache_arrays_estimate"] >= 2


def test_memory_over_the_trim_threshold_trims_the_prompt_cache(served):
    save_and_wait(served, BASE)
    assert chat(served).status_code == 200
    cached = poll(lambda: (s := sample(served))["prompt_cache_sequences"] >= 1 and s, 10,
                  what="a prompt-cache entry")
    # The buffer proxy: mlx counts no buffers, the guardian counts what holds them.
    assert cached["prompt_cache_bytes"] > 0 and cached["kv_cache_arrays_estimate"] >= 2
    trims = len(served.events("memory_trimmed"))

    save_and_wait(served, BASE.replace("trim_above = 0", "trim_above_bytes = 1"))
    # The first trim after the save: over 1 byte, every sample (0.2 s) trims again, and a
    # slow poll saw a second one, of the cache already empty (a lane under load).
    trimmed = served.wait_for_event("memory_trimmed", count=trims + 1)[trims]
    print(f"\nmeasured: memory_trimmed before={trimmed['before']} after={trimmed['after']}")
    assert trimmed["before"]["prompt_cache_sequences"] >= 1
    assert trimmed["after"]["prompt_cache_sequences"] == 0
    assert trimmed["after"]["prompt_cache_bytes"] < trimmed["before"]["prompt_cache_bytes"]
    assert trimmed["after"]["cache_memory_bytes"] == 0  # mx.clear_cache()
    # The samples after the trim show the prompt cache empty.
    poll(lambda: sample(served)["prompt_cache_sequences"] == 0, 10, what="an empty prompt cache sampled")
    save_and_wait(served, BASE)


def test_memory_over_the_refusal_threshold_refuses_until_it_falls(served):
    save_and_wait(served, BASE)
    for i in range(3):  # mlx's buffer cache keeps what they freed
        assert chat(served, f"{i}: {PROMPT * (i + 1)}", max_tokens=32).status_code == 200
    # All three in the prompt cache (stock stores a request's cache after its answer went out).
    full = poll(lambda: (s := sample(served))["prompt_cache_sequences"] >= 3 and s["cache_memory_bytes"] > 0
                and s, 10, what="a sample with the caches filled")
    used = full["memory_used_bytes"]
    # What a trim surely frees: mlx's buffer cache (the prompt cache's arrays too,
    # unless something else still holds them).
    freeable = full["cache_memory_bytes"]
    refuse, resume = used - freeable // 4, used - freeable // 2
    thresholds = BASE.replace("refuse_above = 0", f"refuse_above_bytes = {refuse}\n"
                              f"resume_below_bytes = {resume}\nretry_after_s = 3")
    save_and_wait(served, thresholds)

    refused = chat(served)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "3"
    error = refused.json()["error"]
    assert error["code"] == "memory_pressure" and error["type"] == "rate_limit_error"
    assert set(error) >= {"message", "type", "param", "code"}
    served.wait_for_event("memory_admission_paused")
    assert chat(served).status_code == 429  # still over: nothing freed it

    # Trimming (at the resume threshold) frees memory: admission resumes.
    trims = len(served.events("memory_trimmed"))
    save_and_wait(served, thresholds.replace("trim_above = 0", f"trim_above_bytes = {resume}"))
    served.wait_for_event("memory_trimmed", count=trims + 1)
    [resumed] = served.wait_for_event("memory_admission_resumed")
    print(f"\nmeasured: used {used} B, refuse above {refuse}, resume below {resume}, "
          f"resumed at {resumed['memory_used_bytes']} B")
    assert resumed["memory_used_bytes"] < resume
    assert chat(served).status_code == 200
    save_and_wait(served, BASE)


class Restarts:
    """The engine view the plugin reads at a restart: an empty prompt cache."""

    def prompt_cache_usage(self):
        return 0, 0


def test_memory_over_the_line_with_nothing_to_free_lets_a_request_in_while_none_is_in_flight(served):
    """Over refuse_above with nothing in flight and both caches trimmed empty, what is in use
    is the weights, which waiting never frees: a model past resume_below alone got 429
    memory_pressure for the life of the process. Now one request at a time is let in."""
    save_and_wait(served, BASE)
    floors = len(served.events("memory_admission_at_floor"))
    disconnects_before = len(served.events("client_disconnected"))
    # Anything is over 1 byte; every sample (0.2 s) trims both caches empty.
    save_and_wait(served, BASE.replace("trim_above = 0", "trim_above_bytes = 1").replace(
        "refuse_above = 0", "refuse_above_bytes = 1\nresume_below_bytes = 1"))

    def let_in(client: httpx.Client, stream: bool = False):
        """The request's response once it is let in (the caches a last one filled are
        trimmed at the next sample); None while refused."""
        request = client.build_request("POST", served.url + CHAT,
                                       json=chat_body(PROMPT, max_tokens=1500 if stream else 4, stream=stream))
        response = client.send(request, stream=stream)
        if response.status_code == 200:
            return response
        response.read()
        assert response.status_code == 429 and response.json()["error"]["code"] == "memory_pressure", response.text
        return None

    def four_at_once() -> list[int]:
        """Four requests sent together; their statuses (none let in while the caches
        a last one filled are still there)."""
        barrier = threading.Barrier(4)

        def one(_) -> int:
            barrier.wait(10)
            return chat(served, max_tokens=300).status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return sorted(pool.map(one, range(4)))

    with httpx.Client(timeout=60) as client:
        poll(lambda: let_in(client), 30, interval=0.2, what="a request let in at the floor")
        [said] = served.wait_for_event("memory_admission_at_floor", count=floors + 1)[floors:]
        assert said["memory_used_bytes"] > said["resume_below_bytes"] == 1
        # Arriving together at the floor, one is let in: the rest find its place taken.
        statuses = poll(lambda: (s := four_at_once()) != [429] * 4 and s, 30, interval=0.2,
                        what="four requests at the floor")
        assert statuses == [200, 429, 429, 429], statuses
        # While one is in flight, the others are refused as before.
        stream = poll(lambda: let_in(client, stream=True), 30, interval=0.2, what="a stream let in")
        try:
            lines = stream.iter_lines()  # kept: a line iterator dropped closes the stream
            next(lines)
            refused = chat(served)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "memory_pressure"
            assert not served.events("client_disconnected")[disconnects_before:], "the stream left before the check"
        finally:
            stream.close()  # it leaves: its generation stops
        poll(lambda: let_in(client), 30, interval=0.2, what="a request let in once none was in flight")
        # One at a time, each is let in at once: what each leaves in the caches, a trim would
        # free, and it would not bring memory under the line (every other one was refused).
        assert [chat(served).status_code for _ in range(4)] == [200] * 4
    assert len(served.events("memory_admission_at_floor")) == floors + 1  # once a pause
    save_and_wait(served, BASE)


def test_the_thresholds_as_fractions_of_the_device_and_resume_at_most_refuse():
    """The fractions (the defaults; the tests above set bytes) are of the device's memory,
    a *_bytes setting wins over its fraction, 0 turns one off, and admission resumes at the
    refusal line at the highest (a resume_below above refuse_above would pause for good)."""
    from guardian.plugins.resources import Resources, ResourcesSettings

    plugin = Resources(ResourcesSettings())
    device = plugin.device_bytes
    assert device > 0
    assert plugin.thresholds() == (int(0.85 * device), int(0.95 * device), int(0.9 * device))
    plugin.settings = ResourcesSettings(trim_above=0.5, refuse_above=0.7, resume_below=0.6)
    assert plugin.thresholds() == (int(0.5 * device), int(0.7 * device), int(0.6 * device))
    assert plugin.refuse_now(int(0.71 * device)) and not plugin.refuse_now(int(0.59 * device))
    plugin.settings = ResourcesSettings(trim_above=0, refuse_above_bytes=1000, resume_below=0.99)
    assert plugin.thresholds() == (None, 1000, 1000)
    plugin.settings = ResourcesSettings(refuse_above=0)
    assert plugin.thresholds()[1] is None and not plugin.refuse_now(device)
    # Paused above the line, resumed only below resume_below.
    plugin.settings = ResourcesSettings(refuse_above_bytes=100, resume_below_bytes=50)
    assert plugin.refuse_now(101) and plugin.refuse_now(60) and not plugin.refuse_now(49)


def test_a_supervisors_continuation_passes_memory_admission():
    """A continuation (its prompt carries tokens a dead child made) is a stream let in before:
    refused 429 by the next child, it was cut. Requests beside it in flight: no floor here."""
    from types import SimpleNamespace

    from guardian.errors import GuardianError
    from guardian.plugins.resources import Resources, ResourcesSettings

    held = mx.ones((1024,))  # memory in use here, over the 1-byte line
    mx.eval(held)
    plugin = Resources(ResourcesSettings(refuse_above_bytes=1, resume_below_bytes=1))
    engine = SimpleNamespace(has_work=lambda: True, prompt_cache_usage=lambda: (0, 0),
                             relieve_memory=lambda target_bytes, reason: True)

    def admission(carried_tokens: int):
        return SimpleNamespace(carried_tokens=carried_tokens, on_finish=lambda callback: None)

    refused = plugin.admit_request(admission(0), engine)
    assert isinstance(refused, GuardianError) and refused.code == "memory_pressure"
    assert plugin.admit_request(admission(37), engine) is None


def test_memory_that_grows_across_engine_restarts_is_a_suspected_leak(capsys):
    """Real mlx memory held across four 'restarts' (the plugin's hook called in-process)."""
    from guardian.observability.logs import configure_logging
    from guardian.plugins.resources import Resources, ResourcesSettings

    configure_logging("json", "INFO")
    plugin = Resources(ResourcesSettings(leak_restarts=3, leak_min_growth_bytes=3 * 1024 * 1024))
    plugin.engine = Restarts()
    held = []
    for restart in range(1, 5):
        plugin.on_engine_restarted(restarts=restart)
        held.append(mx.ones((1024, 1024), dtype=mx.float32))  # 4 MiB more after each
        mx.eval(held[-1])
    plugin.on_engine_restarted(restarts=5)
    logged = capsys.readouterr().err
    assert "memory_leak_suspected" in logged
    steady = Resources(ResourcesSettings(leak_restarts=3))
    steady.engine = Restarts()
    for restart in range(1, 6):
        steady.on_engine_restarted(restarts=restart)
    assert "memory_leak_suspected" not in capsys.readouterr().err
    # leak_restarts = 5: four climbs in a row are not yet a leak; the fifth is.
    patient = Resources(ResourcesSettings(leak_restarts=5, leak_min_growth_bytes=3 * 1024 * 1024))
    patient.engine = Restarts()
    for restart in range(1, 6):
        patient.on_engine_restarted(restarts=restart)
        held.append(mx.ones((1024, 1024), dtype=mx.float32))
        mx.eval(held[-1])
    assert "memory_leak_suspected" not in capsys.readouterr().err
    patient.on_engine_restarted(restarts=6)
    assert "memory_leak_suspected" in capsys.readouterr().err


FAULTS = BASE + """\
enabled = {enabled}
poison_marker = "POISON"
message = "planted poison"
"""  # keys of BASE's last table, [fault_injection]


def test_faults_are_armed_and_disarmed_by_saving_the_file(served):
    """A server started with [fault_injection] armable keeps the plugin on the
    engine's step: saving enabled = true plants faults in the running server
    (tests share one server between fault-free and faulty cases), false removes them."""
    save_and_wait(served, FAULTS.format(enabled="false"))
    with httpx.Client(timeout=60) as client:
        before = client.post(served.url + CHAT, json=chat_body("POISON before arming.", max_tokens=4))
        assert before.status_code == 200, before.text
        save_and_wait(served, FAULTS.format(enabled="true"))
        poisoned = client.post(served.url + CHAT, json=chat_body("POISON armed.", max_tokens=4))
        assert poisoned.status_code == 500, poisoned.text
        assert poisoned.json()["error"]["code"] == "request_failed_repeatedly"
        assert "planted poison" in poisoned.json()["error"]["message"]
        innocent = client.post(served.url + CHAT, json=chat_body("An innocent request.", max_tokens=4))
        assert innocent.status_code == 200, innocent.text
        save_and_wait(served, FAULTS.format(enabled="false"))
        after = client.post(served.url + CHAT, json=chat_body("POISON disarmed.", max_tokens=4))
        assert after.status_code == 200, after.text
    assert served.events("fault_injection_armed") and served.events("fault_injection_disarmed")
    save_and_wait(served, BASE)


def test_faults_enabled_by_a_save_on_a_server_started_without_them_say_they_are_not_planted():
    """Started neither enabled nor armable, the plugin is off the engine's step: a save
    that enables it plants nothing, and nothing said so."""
    from structlog.testing import capture_logs

    from guardian.plugins.fault_injection import FaultInjection, FaultInjectionSettings

    settings = FaultInjectionSettings()
    plugin = FaultInjection(settings)
    settings.enabled = True  # as the live view reads it after the save
    with capture_logs() as logs:
        plugin.on_config_reloaded(changed=["fault_injection.enabled"])
    [said] = [line for line in logs if line["event"] == "fault_injection_not_armable"]
    assert "armable = true" in said["hint"]
    armable = FaultInjection(FaultInjectionSettings(armable=True))
    armable.settings.enabled = True
    with capture_logs() as logs:
        armable.on_config_reloaded(changed=["fault_injection.enabled"])
    assert not [line for line in logs if line["event"] == "fault_injection_not_armable"]


def test_a_sighup_while_the_model_loads_is_held_then_applied(tmp_path, model_cache):
    """SIGHUP's default ends a process: one that came before the server installed its
    reload (systemctl reload, a supervisor passing one on to a child still starting) ended
    it with 129. It is held, and the file saved meanwhile is read once the server serves."""
    config = tmp_path / "guardian.toml"
    start = '[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n[slow_start]\nhold_s = 3.0\n'
    config.write_text(start)
    port = free_port()
    server = Server(spawn_guardian(["--port", str(port), "--guardian-config", str(config)], tmp_path / "server.log",
                                   model_cache), port, tmp_path / "server.log")
    try:
        server.wait_for_event("slow_start_waiting", timeout=60)
        config.write_text(start.replace("[guardian]\n", "[guardian]\nretry_after_s = 7\n"))  # a live setting
        server.proc.send_signal(signal.SIGHUP)
        server.wait_healthy()
        assert server.proc.poll() is None
        reloaded = server.wait_for_event("config_reloaded", timeout=10)[-1]
        assert reloaded["reason"] == "sighup" and reloaded["changed"] == ["guardian.retry_after_s"]
    finally:
        server.stop()


def test_saves_made_while_the_model_loads_are_read_once_it_serves(tmp_path, model_cache):
    """The file watches begin once the model has loaded, which a large model takes
    minutes over: a save made before, with no SIGHUP, was read only at the next save
    (a key added then stayed refused). Each file is compared with what was read at
    start when its watch begins."""
    alice, carol = "sk-alice-0123456789abcdef", "sk-carol-0123456789abcdef"
    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice:{alice}\n")
    config = tmp_path / "guardian.toml"
    start = ('[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n[slow_start]\nhold_s = 3.0\n'
             f'[access]\napi_key_file = "{keys}"\n')
    config.write_text(start)
    port = free_port()
    server = Server(spawn_guardian(["--port", str(port), "--guardian-config", str(config)], tmp_path / "server.log",
                                   model_cache), port, tmp_path / "server.log")

    def models_with(key: str) -> int:
        return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code

    try:
        server.wait_for_event("slow_start_waiting", timeout=60)
        config.write_text(start.replace("[guardian]\n", "[guardian]\nretry_after_s = 7\n"))  # a live setting
        keys.write_text(f"alice:{alice}\ncarol:{carol}\n")
        server.wait_healthy()
        reloaded = server.wait_for_event("config_reloaded", timeout=10)[-1]
        assert reloaded["reason"] == "file_changed" and reloaded["changed"] == ["guardian.retry_after_s"]
        poll(lambda: models_with(carol) == 200, 10, what="carol's key, added while the model loaded, to work")
        assert models_with(alice) == 200
        assert [e["added"] for e in server.events("api_keys_reloaded")] == [["carol"]]
    finally:
        server.stop()


def test_a_key_file_broken_while_the_model_loads_keeps_the_keys_read_at_start(tmp_path, model_cache):
    """The door read the key file again once the model had loaded: a file broken (or half
    saved) meanwhile ended the server there, exit 1 and a traceback, the load wasted."""
    alice = "sk-alice-0123456789abcdef"
    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice:{alice}\n")
    config = tmp_path / "guardian.toml"
    config.write_text('[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n'
                      f'[slow_start]\nhold_before_load_s = 2.0\n[access]\napi_key_file = "{keys}"\n')
    port = free_port()
    server = Server(spawn_guardian(["--port", str(port), "--guardian-config", str(config)], tmp_path / "server.log",
                                   model_cache), port, tmp_path / "server.log")
    try:
        server.wait_for_event("slow_start_loading", timeout=60)
        keys.write_text(f"alice:{alice}\nbob:tiny\n")
        server.wait_healthy()
        [failed] = server.wait_for_event("api_keys_reload_failed", timeout=10)
        assert "line 2" in failed["error_message"]
        models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {alice}"}, timeout=10)
        assert models.status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_a_config_and_a_key_file_given_as_pipes_are_read_once(tmp_path, model_cache, mode):
    """``--guardian-config <(...)`` and ``--api-key-file <(...)`` (secrets kept off disk):
    the watch read each pipe again as it began, found it empty, and put an empty file in
    force: every setting back to its default, and every key revoked (all requests 401).
    Under --supervise the child, whose /dev/fd the pipe is not, exited 2 and the supervisor
    with it. A pipe is read at start only (a child reads the supervisor's private copy),
    and SIGHUP reads neither again."""
    alice = "sk-alice-0123456789abcdef"
    pipes = []
    for text in ("[guardian]\nmax_stop_sequences = 2\n", f"alice:{alice}\n"):
        read_end, write_end = os.pipe()
        os.write(write_end, text.encode())
        os.close(write_end)
        pipes.append(read_end)
    port = free_port()
    args = ["--port", str(port), "--guardian-config", f"/dev/fd/{pipes[0]}", "--api-key-file", f"/dev/fd/{pipes[1]}"]
    supervised = mode == "supervised"
    server = (SessionServer if supervised else Server)(
        spawn_guardian(["--supervise", *args] if supervised else args, tmp_path / "server.log", model_cache,
                       pass_fds=pipes, start_new_session=supervised), port, tmp_path / "server.log")
    for fd in pipes:
        os.close(fd)
    try:
        server.wait_healthy()
        assert len(server.wait_for_event("config_file_read_once", count=2)) == 2
        server.proc.send_signal(signal.SIGHUP)
        # Both files' reloads (the key file's alone under --supervise: the config's copy is a file).
        poll(lambda: len(server.events("config_reload_skipped")) >= (1 if supervised else 2), 10,
             what="SIGHUP's reloads skipped")
        key = {"Authorization": f"Bearer {alice}"}
        three_stops = chat_body(max_tokens=2, stop=["a", "b", "c"])
        refused = httpx.post(server.url + CHAT, json=three_stops, headers=key, timeout=30)
        assert refused.status_code == 400, refused.text  # max_stop_sequences = 2, still in force
        assert httpx.post(server.url + CHAT, json=chat_body(max_tokens=2), headers=key, timeout=30).status_code == 200
        assert not server.events("api_keys_reloaded")
        assert supervised or not server.events("config_reloaded")
    finally:
        server.stop()


@pytest.mark.skipif(sys.platform != "linux", reason="inotify is Linux's (macOS watches with FSEvents)")
@pytest.mark.one_version  # the guardian's watch, whatever stock's version: once, in the lane that ends first
@pytest.mark.lane_0313
@pytest.mark.parametrize("mode", BOTH_MODES)
def test_inotify_at_its_limit_leaves_the_saves_to_the_poll(tmp_path, model_cache, mode):
    """A user's inotify instances all taken (fs.inotify.max_user_instances, 128 on most
    Linux; a busy host reaches it): the watch's OSError ended the start once the model had
    loaded (exit 1), and a service manager's restarts loaded it again and again (found by a
    review). Now the server serves, says so, and its poll reads each save of the file and
    of the key file."""
    from test_supervisor import with_supervisor_hooks

    alice, bob = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef0"
    config, keys = tmp_path / "guardian.toml", tmp_path / "keys.txt"
    config.write_text("[guardian]\nmax_stop_sequences = 2\n")
    keys.write_text(f"alice:{alice}\n")
    port = free_port()
    args = ["--port", str(port), "--guardian-config", str(config), "--api-key-file", str(keys)]
    supervised = mode == "supervised"
    env = with_supervisor_hooks(GUARDIAN_TEST_INOTIFY_LIMIT_REACHED="1")
    server = (SessionServer if supervised else Server)(
        spawn_guardian(["--supervise", *args] if supervised else args, tmp_path / "server.log", model_cache, env,
                       **({"start_new_session": True} if supervised else {})), port, tmp_path / "server.log")
    try:
        server.wait_healthy()
        failed = server.wait_for_event("config_watch_failed", count=2)
        assert all("inotify instance limit reached" in e["error_message"] for e in failed), failed
        assert not server.events("config_watch_started")
        config.write_text("[guardian]\nmax_stop_sequences = 3\n")
        keys.write_text(f"alice:{alice}\nbob:{bob}\n")

        def three_stops_allowed() -> bool:
            answer = httpx.post(server.url + CHAT, json=chat_body(max_tokens=2, stop=["a", "b", "c"]),
                                headers={"Authorization": f"Bearer {alice}"}, timeout=30)
            return answer.status_code == 200

        poll(three_stops_allowed, 20, interval=0.25, what="the saved max_stop_sequences read by the poll")
        poll(lambda: httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {bob}"},
                               timeout=10).status_code == 200, 20, interval=0.25, what="bob's key read by the poll")
    finally:
        server.stop()

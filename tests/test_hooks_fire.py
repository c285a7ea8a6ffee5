"""Every hook in guardian/hookspecs.py fires in a real server.

One server runs a scenario that makes each hook fire: start-up, a
completion, a refused request, probe rounds, resource samples, a planted
engine failure and its restarts, a request that fails, a step that blocks
until the watchdog climbs its first rung, a pause of the whole process
(SIGSTOP), and a clean shutdown. The
``hook_recorder`` test plugin, generated from the hookspecs themselves,
writes one JSON line per hook call; the meta-test enumerates the hookspecs
and names any that never fired (datasette's practice: a hook nobody tests
is a hook nobody knows works).

Before this file, five observer hooks were called by no test:
on_engine_restarted, on_request_failed, on_probe_result, on_stall and
on_resource_sample (no plugin in the tests or among the built-ins
implemented them, and test_config only registers one without a server).
"""

from __future__ import annotations

import signal
import textwrap
import time

import httpx
import pytest

from conftest import Server, chat_body, free_port, poll, spawn_guardian
from plugins.hook_recorder import hook_specs, read_records

POISON = "POISON-FOR-HOOKS"
HANG_PENALTY = 1.25
PAUSE_S = 2.0  # past the scenario's stall_min_s (1 s)
STALL_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, model_cache):
    """Run the scenario once; return (records, server)."""
    folder = tmp_path_factory.mktemp("hooks")
    records_path = folder / "hooks.jsonl"
    config_path = folder / "guardian.toml"
    config_path.write_text(textwrap.dedent(f"""
        [guardian]
        plugins = ["tests.plugins.hook_recorder:HookRecorder", "tests.plugins.loop_faults:LoopFaults"]
        [hook_recorder]
        path = "{records_path}"
        [loop_faults]
        hang_repetition_penalty = {HANG_PENALTY}
        hang_at_call = 3
        [fault_injection]
        enabled = true
        poison_marker = "{POISON}"
        # A poison, not the incident's memory failure (that is answered 503, never blamed).
        message = "planted poison"
        [watchdog]
        interval_s = 0.05
        stall_min_s = 1.0
        # The ceiling, for what is new to a loop: on a GPU the loop that replaces
        # the stuck one compiles its kernels and graphs again (more than 1 s).
        stall_timeout_s = {STALL_TIMEOUT_S}
        resource_interval_s = 0.2
        # Each deep check a round of its own: their steps teach the watchdog a new loop's pace.
        deep_check_reuse_s = 0.0
    """))
    port = free_port()
    log_path = folder / "server.log"
    proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config_path)], log_path, model_cache)
    server = Server(proc, port, log_path)
    try:
        server.wait_healthy()
        url = server.url + "/v1/chat/completions"
        with httpx.Client(timeout=60) as client:
            # A completion, and a request the prompt guard refuses at the door.
            assert client.post(url, json=chat_body(max_tokens=4)).status_code == 200
            refused = client.post(url, json=chat_body("word " * 2100, max_tokens=4))
            assert refused.status_code == 400, refused.text
            # An engine failure at every step of one request: two restarts, then it is blamed.
            poisoned = client.post(url, json=chat_body(f"{POISON} pill", max_tokens=4))
            assert poisoned.status_code == 500, poisoned.text
            # Deep probes (no request: nothing admitted) take steps on the loop the
            # restarts left until the watchdog has seen its pace, so the stall below
            # comes at the 1 s floor, not at stall_timeout_s (10 s), the limit for a
            # loop whose steps it has not seen. (Sent while the engine still restarts
            # or backs off, a deep probe does not run, its answer 503: the poll sends another.)
            def pace_known():
                client.get(server.url + "/readyz?deep=1")
                return client.get(server.url + "/guardian/status").json()["stall_limit_s"] < STALL_TIMEOUT_S

            poll(pace_known, 15, interval=0.1, what="the watchdog to know the new loop's pace")
            # A step that blocks: a stall, the ladder's first rung, a probe on the new loop.
            stalled = client.post(url, json=chat_body(max_tokens=8, repetition_penalty=HANG_PENALTY))
            assert stalled.status_code == 200, stalled.text
            poll(lambda: server.status("/readyz") == 200, 30, what="ready after the stall")
        # The whole process paused (SIGSTOP): the watchdog's look comes late.
        proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            poll(lambda: time.monotonic() - stopped_at >= PAUSE_S, PAUSE_S + 5, interval=0.1, what="the pause")
        finally:
            proc.send_signal(signal.SIGCONT)
        poll(lambda: any(r["hook"] == "on_process_paused" for r in read_records(records_path)),
             10, what="on_process_paused")
        # Resource samples come every 0.2 s; wait for one after all of that.
        sampled = len([r for r in read_records(records_path) if r["hook"] == "on_resource_sample"])
        poll(lambda: len([r for r in read_records(records_path) if r["hook"] == "on_resource_sample"]) > sampled,
             10, what="another resource sample")
        # A live setting edited in the file: the new version is put in force.
        config_path.write_text(config_path.read_text().replace("resource_interval_s = 0.2",
                                                               "resource_interval_s = 0.25"))
        poll(lambda: any(r["hook"] == "on_config_reloaded" for r in read_records(records_path)),
             10, what="on_config_reloaded")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        yield read_records(records_path), server
    finally:
        server.stop()


def calls(records: list[dict], hook: str) -> list[dict]:
    return [r["args"] for r in records if r["hook"] == hook]


def test_every_hookspec_fires(scenario):
    records, _ = scenario
    fired = {r["hook"] for r in records}
    never = sorted(set(hook_specs()) - fired)
    assert not never, f"hooks no test makes fire: {', '.join(never)}"


def test_the_recorder_implements_every_hookspec():
    from plugins.hook_recorder import HookRecorder

    specs = hook_specs()
    assert len(specs) >= 13
    assert all(callable(getattr(HookRecorder, name, None)) for name in specs)


def test_lifecycle_hooks_fire_once_each_in_order(scenario):
    records, _ = scenario
    hooks = [r["hook"] for r in records]
    assert hooks.count("guardian_startup") == 1 and hooks.count("guardian_shutdown") == 1
    assert hooks[0] == "guardian_startup"  # before any probe, sample, step or request
    assert hooks.index("guardian_shutdown") > max(i for i, h in enumerate(hooks) if h == "on_stall")
    [shutdown] = calls(records, "guardian_shutdown")
    assert shutdown["exit_code"] == 0


def test_engine_failure_hooks_carry_the_failure(scenario):
    records, _ = scenario
    classified = calls(records, "classify_engine_error")
    # The poison fails three times: run, re-run alone, alone again once a probe proved the engine.
    assert len(classified) == 3
    assert all(c["error"]["exception"] == "RuntimeError" for c in classified)
    decided = calls(records, "on_engine_error")
    assert [d["classification"] for d in decided] == ["unknown"] * 3
    restarted = calls(records, "on_engine_restarted")
    # Three restarts after the failures, one after the stall (once a probe generated).
    assert [r["restarts"] for r in restarted] == [1, 2, 3, 4]
    assert [r["classification"] for r in restarted][:3] == ["unknown"] * 3
    assert all(r["duration_s"] >= 0 for r in restarted)


def test_request_failed_names_the_request_and_its_error(scenario):
    records, server = scenario
    failed = calls(records, "on_request_failed")
    [blamed] = server.events("request_blamed")
    [poison] = [f for f in failed if f["request_id"] == blamed["request_id"]]
    assert poison["error"]["code"] == "request_failed_repeatedly" and poison["error"]["status"] == 500
    # Why it failed is told before that it ended: a plugin can count its failed ends by error.
    told = [r["hook"] for r in records if r["args"].get("request_id") == blamed["request_id"]
            and r["hook"] in ("on_request_failed", "on_request_finished")]
    assert told == ["on_request_failed", "on_request_finished"], told


def test_stall_hook_names_the_rung(scenario):
    records, _ = scenario
    [stall] = calls(records, "on_stall")
    assert stall["action"] == "restart"
    assert stall["heartbeat_age_s"] >= 1.0


def test_pause_hook_says_how_long(scenario):
    records, _ = scenario
    [paused] = [p for p in calls(records, "on_process_paused") if p["paused_s"] >= PAUSE_S - 0.5]
    assert paused["paused_s"] < PAUSE_S + 5


def test_probe_and_resource_hooks(scenario):
    records, _ = scenario
    probes = calls(records, "probe")
    assert len(probes) >= 2 and all(p["timeout_s"] > 0 for p in probes)  # start-up, and on the new loop
    results = calls(records, "on_probe_result")
    assert len(probes) - 1 <= len(results) <= len(probes)  # a round may be under way at shutdown
    assert any(r["results"] and r["results"][0]["name"] == "generation" for r in results)
    assert len(calls(records, "sample_resources")) >= 2
    samples = calls(records, "on_resource_sample")
    assert samples and all("active_memory_bytes" in s["sample"] for s in samples)


def test_admission_and_step_hooks(scenario):
    records, _ = scenario
    # The completion, the refused request, the poison and the stalled request; re-runs are not admitted again.
    assert len(calls(records, "admit_request")) == 4
    steps = [c["step"] for c in calls(records, "on_engine_step")]
    assert len(steps) > 10 and steps[0] >= 1


def test_admission_decisions_and_finished_requests_carry_their_numbers(scenario):
    records, _ = scenario
    decisions = calls(records, "on_admission_decision")
    # Let in: the completion, the poison and the stalled request; turned away: the long prompt.
    assert [d["error"]["code"] for d in decisions if d["error"]] == ["context_length_exceeded"]
    assert sum(d["error"] is None for d in decisions) == 3
    finished = calls(records, "on_request_finished")
    # Users' requests only, each once: no probe, no re-run counted twice.
    assert sorted(f["outcome"] for f in finished) == ["completed", "completed", "failed"]
    completion = finished[0]
    assert completion["outcome"] == "completed" and completion["generated_tokens"] == 4
    assert completion["prompt_tokens"] > 0 and 0 <= completion["cached_prompt_tokens"] <= completion["prompt_tokens"]
    assert completion["time_to_first_token_s"] > 0
    gaps = completion["time_between_tokens_s"]
    assert len(gaps) == 3 and all(gap >= 0 for gap in gaps)
    [poison] = [f for f in finished if f["outcome"] == "failed"]
    assert poison["generated_tokens"] == 0 and poison["time_to_first_token_s"] is None
    assert poison["prompt_tokens"] > 0  # it started, then failed at every step

"""The watchdog and the monitoring endpoints while no model is loaded.

During a reload the provider has no model: stock's ``_load`` first drops the
served one (its model key is None), then reads the weights again. The
watchdog's resource samples read the served model's limits; they raised
``TypeError: 'NoneType' object is not subscriptable`` there
(``watchdog_tick_failed`` at every sample), so sampling failed just when it
mattered most. Here an engine failure's action is a reload whose read of
the weights blocks 3 s (``loop_faults``'s ``hang_model_load``), while the
watchdog samples every 0.1 s and a client reads /guardian/status, /metrics
and /health; meanwhile a live configuration change reaches the plugins that
derive state from the model (the prompt guard's limits, the probe's prompt
kept out of the prompt cache).
"""

from __future__ import annotations

import httpx

from conftest import chat_body, poll
from test_ladder import LOOP_FAULTS, post_in_background, table
from test_watchdog import stamp

COMPLETIONS = "/v1/chat/completions"


def test_sampling_monitoring_and_live_config_go_on_while_the_model_is_reloaded(start_server, tmp_path):
    config = (LOOP_FAULTS
              + table("loop_faults", fail_once_stop_word="FAIL-ONCE", hang_model_load=2, hang_s=3.0)
              + table("recovery", reload_after_failures=1)
              + table("watchdog", interval_s=0.05, resource_interval_s=0.1, restart_timeout_s=60.0))
    server = start_server(config)
    seen_unloaded = []

    def sampled_while_unloaded(client: httpx.Client) -> bool:
        """One look at the monitoring endpoints; whether a sample was taken during the blocked reload."""
        status = client.get(server.url + "/guardian/status")
        assert status.status_code == 200, status.text
        assert client.get(server.url + "/metrics").status_code == 200
        client.get(server.url + "/health")
        body = status.json()
        sample = body["last_resource_sample"] or {}
        if body["state"] == "restarting" and sample.get("at", 0) > hang_began and sample not in seen_unloaded:
            seen_unloaded.append(sample)
        return len(seen_unloaded) >= 3  # three samples taken while the read of the weights blocks

    with httpx.Client(timeout=60) as client:
        result = {}
        sender = post_in_background(server.url + COMPLETIONS, chat_body(max_tokens=8, stop=["FAIL-ONCE"]),
                                    result, "failed_once")
        [hang] = server.wait_for_event("loop_fault_hang", timeout=30)
        hang_began = stamp(hang)
        poll(lambda: sampled_while_unloaded(client), 10, interval=0.1, what="samples while the model is unloaded")
        # A live change while the weights are still being read (the hang lasts 3 s).
        config_path = server.config
        config_path.write_text(config_path.read_text() + table("prompt_guard", max_context_tokens=4000)
                               + table("generation_probe", prompt="another probe prompt"))
        [reloaded] = server.wait_for_event("config_reloaded", timeout=10)
        assert "prompt_guard.max_context_tokens" in reloaded["changed"], reloaded
        assert not server.events("loop_fault_hang_ended"), "the change came after the model was back"
        sender.join(timeout=60)
        assert result["failed_once"].status_code == 200, result["failed_once"].text
    assert server.events("watchdog_tick_failed") == []
    assert server.events("plugin_hook_failed") == []
    # What needs the model is unknown without one; the rest was sampled.
    assert all(s["kv_cache_arrays_estimate"] is None for s in seen_unloaded), seen_unloaded
    assert all(s["memory_used_bytes"] > 0 for s in seen_unloaded)
    server.wait_for_event("loop_fault_hang_ended", timeout=30)
    poll(lambda: server.status("/readyz") == 200, 30, what="ready after the reload")
    later = httpx.get(server.url + "/guardian/status").json()
    assert server.events("engine_stalled") == []
    assert later["restarts"] == 1
    # The new settings are in force: the prompt guard's limit, and the probe's
    # prompt was tokenized once the loop had the model again.
    [models] = httpx.get(server.url + "/v1/models").json()["data"][:1]
    assert models["context_length"] == 4000, models
    assert server.events("probe_prompt_not_tokenized") == []

"""GET /metrics in Prometheus' text format, read back with prometheus-client's own parser.

Two servers for the module: an in-process guardian with a planted engine
failure (the fault-injection plugin's poison marker), and a supervisor
whose child is SIGKILLed. Counters are compared before and after what
moves them, since the tests share a server. The Grafana dashboard's
queries name only metrics a real scrape has.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, Server, chat_body, free_port, poll, read_stream, spawn_guardian, system_tool

pytestmark = pytest.mark.one_version

POISON = "POISON-FOR-METRICS"
COMPLETIONS = "/v1/chat/completions"
DASHBOARD = REPO / "config" / "grafana" / "mlx-guardian.json"
ALERTS = REPO / "config" / "prometheus" / "mlx-guardian-alerts.yml"
PROMETHEUS, WITHOUT_PROMETHEUS = system_tool("prometheus", "make system-packages: Prometheus' server")


class Scrape:
    """One scrape of /metrics, parsed."""

    def __init__(self, url: str):
        response = httpx.get(url + "/metrics", timeout=10)
        assert response.status_code == 200, response.text
        self.content_type = response.headers["content-type"]
        self.families = {family.name: family for family in text_string_to_metric_families(response.text)}
        self.samples = [sample for family in self.families.values() for sample in family.samples]

    @property
    def sample_names(self) -> set[str]:
        return {sample.name for sample in self.samples}

    def value(self, name: str, **labels) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels``; 0 if none."""
        return sum(s.value for s in self.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def moved(url: str, name: str, at_least: float, since: float, **labels) -> Scrape:
    """Poll until ``name`` has grown by ``at_least`` since ``since``: a request's
    counters move on the engine's thread as its client reads the last bytes."""
    def grown():
        scrape = Scrape(url)
        return scrape if scrape.value(name, **labels) - since >= at_least else None

    return poll(grown, 10, what=f"{name}{labels} to grow by {at_least}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_cache):
    folder = tmp_path_factory.mktemp("metrics")
    config = folder / "guardian.toml"
    config.write_text(textwrap.dedent(f"""
        [fault_injection]
        enabled = true
        poison_marker = "{POISON}"
        # A poison, not the incident's memory failure (that is answered 503, never blamed).
        message = "planted poison"
    """))
    port = free_port()
    server = Server(spawn_guardian(["--port", str(port), "--guardian-config", str(config)],
                                   folder / "server.log", model_cache), port, folder / "server.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_metrics_parse_with_the_engine_state_and_memory(served):
    scrape = Scrape(served.url)
    assert scrape.content_type.startswith("text/plain")
    assert scrape.value("mlx_guardian_engine_state", state="ready") == 1
    assert scrape.value("mlx_guardian_engine_state") == 1  # one state at a time
    assert scrape.value("mlx_guardian_mlx_active_memory_bytes") > 0  # the weights
    assert scrape.value("mlx_guardian_mlx_peak_memory_bytes") >= scrape.value("mlx_guardian_mlx_active_memory_bytes")
    assert scrape.value("mlx_guardian_mlx_memory_limit_bytes") > 0
    assert scrape.value("mlx_guardian_device_memory_limit_bytes") > 0
    assert scrape.value("mlx_guardian_engine_steps_total") > 0  # the start-up probe
    assert scrape.value("process_resident_memory_bytes") > 0
    # The start-up probe passed, and took time.
    assert scrape.value("mlx_guardian_probes_total", probe="generation", result="ok") >= 1
    assert scrape.value("mlx_guardian_probe_duration_seconds_count", probe="generation") >= 1
    assert scrape.value("mlx_guardian_probe_last_success", probe="generation") == 1
    assert scrape.families["mlx_guardian_engine_restarts"].type == "counter"
    assert scrape.families["mlx_guardian_time_to_first_token_seconds"].type == "histogram"
    # OpenMetrics when a scraper asks for it.
    openmetrics = httpx.get(served.url + "/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=10)
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


@pytest.mark.parametrize("accept", [";;q=x", "application/openmetrics-text; version=9.9", "*/*;q=-1",
                                    "x" * 4000, "text/plain; version=0.0.4, \u00e9/\u00e9"])
def test_a_hostile_accept_header_still_gets_a_scrape(served, accept):
    response = httpx.get(served.url + "/metrics", headers={"Accept": accept.encode("latin-1")}, timeout=10)
    assert response.status_code == 200
    if "openmetrics" in response.headers["content-type"]:
        assert response.text.rstrip().endswith("# EOF")
    else:
        assert list(text_string_to_metric_families(response.text))


def test_completions_move_the_token_counters_and_histograms(served):
    before = Scrape(served.url)
    url = served.url + COMPLETIONS
    with httpx.Client(timeout=60) as client:
        answer = client.post(url, json=chat_body(max_tokens=8))
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        stream = read_stream(client, url, chat_body("Another story.", max_tokens=8, stream=True))
        assert stream["status"] == 200 and stream["done"]
    after = moved(served.url, "mlx_guardian_requests_finished_total", 2,
                  before.value("mlx_guardian_requests_finished_total", outcome="completed"), outcome="completed")

    def grew(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    assert grew("mlx_guardian_requests_admitted_total") == 2
    assert grew("mlx_guardian_prompt_tokens_total") >= 2 * usage["prompt_tokens"] - 4
    assert grew("mlx_guardian_generation_tokens_total") == 16  # the demo model runs to max_tokens
    assert grew("mlx_guardian_time_to_first_token_seconds_count") == 2
    assert grew("mlx_guardian_time_to_first_token_seconds_sum") > 0
    assert grew("mlx_guardian_time_between_tokens_seconds_count") == 14  # 7 gaps each
    # Each waited in the engine's queue for some time, less than its whole answer took.
    assert grew("mlx_guardian_request_queue_time_seconds_count") == 2
    assert 0 < grew("mlx_guardian_request_queue_time_seconds_sum") < grew("mlx_guardian_time_to_first_token_seconds_sum")
    # Every observation falls in some bucket: +Inf counts them all.
    assert grew("mlx_guardian_time_between_tokens_seconds_bucket", le="+Inf") == 14
    assert after.value("mlx_guardian_requests_in_flight") == 0


def test_refusals_are_counted_by_code(served):
    before = Scrape(served.url)
    url = served.url + COMPLETIONS
    with httpx.Client(timeout=60) as client:
        too_long = client.post(url, json=chat_body("word " * 2100, max_tokens=4))
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        bad_field = client.post(url, json=chat_body(max_tokens=4, stop=7))
        assert bad_field.status_code == 400
        bad_code = bad_field.json()["error"]["code"]
    after = Scrape(served.url)
    refused = "mlx_guardian_requests_refused_total"
    assert after.value(refused, code="context_length_exceeded") - before.value(refused, code="context_length_exceeded") == 1
    assert after.value(refused, code=bad_code) - before.value(refused, code=bad_code) == 1
    assert after.value("mlx_guardian_requests_admitted_total") == before.value("mlx_guardian_requests_admitted_total")


def test_a_planted_failure_moves_the_restart_counter_with_its_classification(served):
    before = Scrape(served.url)
    url = served.url + COMPLETIONS
    with httpx.Client(timeout=60) as client:
        # The engine fails at every step of this request: a restart, a re-run
        # alone, a second restart, a probe that proves the engine, a re-run alone
        # again, a third restart, then it is blamed and quarantined.
        poisoned = client.post(url, json=chat_body(f"{POISON} pill", max_tokens=4))
        assert poisoned.status_code == 500, poisoned.text
        again = client.post(url, json=chat_body(f"{POISON} pill", max_tokens=4))
        assert again.json()["error"]["code"] == "request_quarantined"
    restarts = "mlx_guardian_engine_restarts_total"
    label = {"classification": "unknown"}
    after = moved(served.url, restarts, 3, before.value(restarts, **label), **label)
    assert after.value(restarts) - before.value(restarts) == 3  # no other classification moved
    assert (after.value("mlx_guardian_engine_restart_duration_seconds_count")
            - before.value("mlx_guardian_engine_restart_duration_seconds_count")) == 3
    failed = "mlx_guardian_requests_failed_total"
    assert after.value(failed, code="request_failed_repeatedly") - before.value(failed, code="request_failed_repeatedly") == 1
    refused = "mlx_guardian_requests_refused_total"
    assert after.value(refused, code="request_quarantined") - before.value(refused, code="request_quarantined") == 1
    assert after.value("mlx_guardian_quarantined_requests") == 1
    assert after.value("mlx_guardian_engine_failures_in_window") >= 0
    assert after.value("mlx_guardian_engine_state", state="ready") == 1


# -- subprocess mode ---------------------------------------------------------------
@pytest.fixture(scope="module")
def supervised(tmp_path_factory, model_cache):
    folder = tmp_path_factory.mktemp("supervised-metrics")
    port = free_port()
    proc = spawn_guardian(["--supervise", "--port", str(port)], folder / "supervisor.log", model_cache,
                          start_new_session=True)
    server = Server(proc, port, folder / "supervisor.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and its child
        except (ProcessLookupError, PermissionError):  # gone; macOS: a zombie leader's group
            pass
        proc.wait(timeout=10)


def child_pid(server: Server):
    status = httpx.get(server.url + "/guardian/supervisor", timeout=5).json()
    child = status["child"]
    return child["pid"] if status["state"] == "ready" and child else None


@pytest.mark.subprocess_mode
def test_the_supervisor_counts_a_sigkilled_childs_restart_and_passes_the_childs_metrics_on(supervised):
    first = poll(lambda: child_pid(supervised), 30, what="a ready child")
    with httpx.Client(timeout=60) as client:
        assert client.post(supervised.url + COMPLETIONS, json=chat_body(max_tokens=4)).status_code == 200
    scrape = Scrape(supervised.url)
    assert scrape.value("mlx_guardian_supervisor_state", state="ready") == 1
    assert scrape.value("mlx_guardian_supervisor_child_up") == 1
    assert scrape.value("mlx_guardian_supervisor_child_restarts_total") == 0
    # The child's engine metrics, after the supervisor's own, in one exposition.
    assert scrape.value("mlx_guardian_supervisor_child_metrics_up") == 1
    assert scrape.value("mlx_guardian_engine_state", state="ready") == 1
    assert scrape.value("mlx_guardian_generation_tokens_total") >= 4
    # Each process's own: the supervisor's beside the child's, told apart by name.
    supervisor_rss = scrape.value("mlx_guardian_supervisor_process_resident_memory_bytes")
    assert 0 < supervisor_rss < scrape.value("process_resident_memory_bytes")  # no mlx, no model
    assert scrape.value("mlx_guardian_supervisor_process_open_fds") > 0
    os.kill(first, signal.SIGKILL)
    poll(lambda: (pid := child_pid(supervised)) and pid != first, 60, what="a new ready child")
    after = Scrape(supervised.url)
    assert after.value("mlx_guardian_supervisor_child_restarts_total", reason="SIGKILL") == 1
    assert after.value("mlx_guardian_supervisor_child_restarts_total") == 1
    assert after.value("mlx_guardian_supervisor_restarts_in_window") == 1
    assert after.value("mlx_guardian_supervisor_child_uptime_seconds") < scrape.value(
        "mlx_guardian_supervisor_child_uptime_seconds") + 60
    # The new child's counters start again: only its start-up probe has generated.
    assert after.value("mlx_guardian_generation_tokens_total") == 0


# -- the dashboard -----------------------------------------------------------------
# A PromQL metric name: not a function, keyword or label (those are followed
# by "(" or sit inside {...} / by (...)).
PROMQL_NAME = re.compile(r"\b(mlx_guardian_[a-z0-9_]+|process_[a-z0-9_]+)\b")


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    variables = [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])] + variables


@pytest.mark.subprocess_mode
def test_every_metric_the_dashboard_and_the_alerts_query_is_in_a_scrape(served, supervised):
    expressions = dashboard_expressions()
    assert len(expressions) >= 10
    used = {name for expr in expressions for name in PROMQL_NAME.findall(expr)}
    alerts = set(PROMQL_NAME.findall(ALERTS.read_text()))
    assert len(alerts) >= 12
    used |= alerts
    # A counter by label has no sample before its first event, and this test may
    # run alone (or first, under xdist): one refusal, one failure and its restarts.
    with httpx.Client(timeout=60) as client:
        too_long = client.post(served.url + COMPLETIONS, json=chat_body("word " * 2100, max_tokens=4))
        assert too_long.status_code == 400, too_long.text
        poisoned = client.post(served.url + COMPLETIONS, json=chat_body(f"{POISON} dashboard", max_tokens=4))
        assert poisoned.status_code == 500, poisoned.text
    scraped = Scrape(served.url).sample_names | Scrape(supervised.url).sample_names
    assert used and not used - scraped, f"the dashboard queries metrics no scrape has: {sorted(used - scraped)}"


class Prometheus:
    """A real Prometheus scraping ``targets`` every second as the job "mlx-guardian" (the
    name the alert rules read), with ``rules`` loaded and evaluated every second."""

    def __init__(self, folder, targets: list[str], rules):
        config = folder / "prometheus.yml"
        config.write_text(textwrap.dedent(f"""
            global:
              scrape_interval: 1s
              evaluation_interval: 1s
            rule_files: ["{rules}"]
            scrape_configs:
              - job_name: mlx-guardian
                static_configs:
                  - targets: {json.dumps(targets)}
        """))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = folder / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                          f"--web.listen-address={self.url.removeprefix('http://')}"],
                                         stdout=log, stderr=subprocess.STDOUT)

    def api(self, path: str):
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        try:
            response = httpx.get(self.url + "/api/v1/" + path, timeout=5)
        except httpx.TransportError:
            return None  # not listening yet
        if response.status_code == 503:
            return None  # listening, not ready yet (its storage opening): "Service Unavailable"
        assert response.status_code == 200, response.text
        return response.json()["data"]

    def stop(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.mark.subprocess_mode
@pytest.mark.skipif(PROMETHEUS is None, reason=WITHOUT_PROMETHEUS)
def test_a_real_prometheus_evaluates_every_alert_on_real_scrapes_and_fires_for_a_quarantine(
        served, supervised, tmp_path):
    """config/prometheus/mlx-guardian-alerts.yml loaded into Prometheus, which scrapes an
    in-process server and a supervisor: each rule evaluates without error on what they
    export (a label one series has and another lacks, as device_memory_limit_bytes'
    source, is an error only there), and a request blamed and quarantined fires
    MlxGuardianRequestsQuarantined for that server, at once."""
    targets = [served.url.removeprefix("http://"), supervised.url.removeprefix("http://")]
    prometheus = Prometheus(tmp_path, targets, ALERTS)
    try:
        def evaluated():
            data = prometheus.api("rules")
            rules = [rule for group in (data or {}).get("groups", []) for rule in group["rules"]]
            return len(rules) == 12 and all(rule["health"] != "unknown" for rule in rules) and rules

        def scraped_both():
            data = prometheus.api("targets")
            return data and sorted(t["health"] for t in data["activeTargets"]) == ["up", "up"]

        poll(scraped_both, 30, interval=0.2, what="Prometheus scraping both servers")
        # A poison request of its own: blamed after it fails alone, then quarantined.
        with httpx.Client(timeout=60) as client:
            poisoned = client.post(served.url + COMPLETIONS, json=chat_body(f"{POISON} alerting", max_tokens=4))
            assert poisoned.status_code == 500, poisoned.text
        assert Scrape(served.url).value("mlx_guardian_quarantined_requests") >= 1

        def firing():
            data = prometheus.api("alerts") or {"alerts": []}
            return [alert for alert in data["alerts"] if alert["state"] == "firing"]

        alerts = poll(lambda: [a for a in firing() if a["labels"]["alertname"] == "MlxGuardianRequestsQuarantined"],
                      30, interval=0.2, what="MlxGuardianRequestsQuarantined firing")
        assert [a["labels"]["instance"] for a in alerts] == [targets[0]]
        assert "blamed for engine failures" in alerts[0]["annotations"]["summary"]
        rules = poll(evaluated, 30, interval=0.2, what="every rule evaluated")
        broken = [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
        assert not broken, broken
        # Nothing else is wrong with these servers: no other rule fires.
        assert {a["labels"]["alertname"] for a in firing()} == {"MlxGuardianRequestsQuarantined"}
    finally:
        prometheus.stop()


@pytest.mark.subprocess_mode
def test_an_unhealthy_childs_metrics_are_passed_on_too(tmp_path, model_cache):
    """Its engine's metrics are what an alert reads while it is unhealthy: they were left
    out then, and the alerts in docs/operations.md could never fire under --supervise."""
    config = tmp_path / "guardian.toml"
    config.write_text("[fault_injection]\nenabled = true\n")  # a plugin is enabled at start
    port = free_port()
    proc = spawn_guardian(["--supervise", "--port", str(port), "--guardian-config", str(config)],
                          tmp_path / "supervisor.log", model_cache, start_new_session=True)
    server = Server(proc, port, tmp_path / "supervisor.log")
    try:
        server.wait_healthy()
        config.write_text("[fault_injection]\nenabled = true\nevery_n_steps = 1\n")  # every step fails
        poll(lambda: httpx.get(server.url + "/readyz?deep=1", timeout=30).status_code == 503, 30,
             interval=0.5, what="a probe that fails")

        def while_unhealthy():
            scrape = Scrape(server.url)
            return scrape.value("mlx_guardian_supervisor_state", state="unhealthy") == 1 and scrape

        scrape = poll(while_unhealthy, 30, interval=0.2, what="the supervisor to find its child unhealthy")
        assert scrape.value("mlx_guardian_supervisor_child_up") == 0
        assert scrape.value("mlx_guardian_supervisor_child_metrics_up") == 1
        assert scrape.value("mlx_guardian_engine_failures_total") >= 1
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone; macOS: a zombie leader's group
            pass
        proc.wait(timeout=10)



def test_a_scrape_as_the_supervisor_reaps_its_child_leaves_out_the_childs_metrics():
    """The scrape's thread found the child running, then the supervisor's own thread reaped it
    and closed its client: httpx raises RuntimeError for a closed client, not one of its own
    errors, and the scrape answered nothing at all (a review). The same holds for /readyz
    (``CHILD_GONE_ERRORS``, guardian.supervise.child)."""
    from types import SimpleNamespace

    from guardian.supervise.metrics import SupervisorMetrics

    client = httpx.Client(base_url="http://127.0.0.1:9")
    client.close()  # as reap_child does
    child = SimpleNamespace(hard_killed=False, proc=SimpleNamespace(poll=lambda: None), has_readyz=True, client=client)
    scraper = SimpleNamespace(supervisor=SimpleNamespace(child=child, health_timeout=1.0))
    assert SupervisorMetrics.child_exposition(scraper) is None

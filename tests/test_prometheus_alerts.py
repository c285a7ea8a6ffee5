"""config/prometheus/mlx-guardian-alerts.yml, checked by Prometheus' own tool: promtool
reads every rule (its PromQL, its templates), then runs tests/prometheus/'s unit test, which
feeds each rule the series a scrape would leave and says when it must fire and when not.
No server, no model. tests/test_metrics.py loads the same rules into a real Prometheus that
scrapes real servers."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO, system_tool

pytestmark = [pytest.mark.one_version, pytest.mark.lane_0313]

ALERTS = REPO / "config" / "prometheus" / "mlx-guardian-alerts.yml"
ALERTS_TEST = REPO / "tests" / "prometheus" / "mlx-guardian-alerts.test.yml"
LOG_EVENTS = REPO / "docs" / "reference" / "log-events.md"
PROMTOOL, WITHOUT_PROMTOOL = system_tool("promtool", "make system-packages: Prometheus' promtool")


@pytest.mark.skipif(PROMTOOL is None, reason=WITHOUT_PROMTOOL)
def test_promtool_reads_every_alert_rule():
    checked = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 12 rules found" in checked.stdout, checked.stdout


@pytest.mark.skipif(PROMTOOL is None, reason=WITHOUT_PROMTOOL)
def test_each_alert_fires_when_it_should_and_not_otherwise():
    # From the test file's folder: its rule_files path is relative to it.
    tested = subprocess.run([PROMTOOL, "test", "rules", ALERTS_TEST.name], capture_output=True, text=True,
                            timeout=60, cwd=ALERTS_TEST.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout, tested.stdout


def test_every_alert_rule_has_a_unit_test():
    rules = {line.split(":", 1)[1].strip() for line in ALERTS.read_text().splitlines()
             if line.strip().startswith("- alert:")}
    tested = {line.split(":", 1)[1].strip() for line in ALERTS_TEST.read_text().splitlines()
              if line.strip().startswith("alertname:")}
    assert len(rules) == 12 and rules == tested, (sorted(rules - tested), sorted(tested - rules))


def test_the_log_events_the_alerts_point_to_are_logged():
    """An alert's description sends a person to log lines by event name ("the log's
    engine_error lines"): each is an event the code logs (docs/reference/log-events.md,
    generated from the code). One named engine_failed, an error code, pointed nowhere."""
    event = r"[a-z]+(?:_[a-z]+)+"
    named = {name for pair in re.findall(rf"\b({event})(?: and ({event}))? lines\b", ALERTS.read_text())
             for name in pair if name}
    logged = set(re.findall(r"^\| `([a-z_]+)` \|", LOG_EVENTS.read_text(), flags=re.M))
    assert len(named) >= 4 and not named - logged, sorted(named - logged)

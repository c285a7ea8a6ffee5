"""The notifier plugin (plugins/notifier), tested as a third party's plugin.

It is installed as its own distribution (`make test` runs `pip install -e
plugins/notifier`) and reaches the server through its `mlx_guardian` entry
point: nothing here imports it. Each test starts a real server, plants a
real fault (the fault-injection plugin, or memory limits), and a real HTTP
receiver on 127.0.0.1 (http.server in a thread) records what arrives.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import chat_body, free_port, poll, read_stream, run_guardian, stamp

# What it checks does not depend on mlx-lm's version (the plugin works through the guardian's hooks, above stock):
# `make test` runs it against the newest mlx-lm only.
# Run once, in the 0.31.3 lane of `make test` (tools/test_lanes.sh balances its lanes).
pytestmark = [pytest.mark.one_version, pytest.mark.lane_0313]


@pytest.fixture(scope="module", autouse=True)
def notifier_installed():
    """Fail with the fix when the plugin is not installed (it is a distribution of its own)."""
    listed = run_guardian(["plugins"])
    plugins = {p["name"]: p["hooks"] for p in json.loads(listed.stdout)}
    assert "notifier" in plugins, "the notifier is not installed: pip install -e plugins/notifier (make test does)"
    return plugins


def test_the_notifier_is_loaded_through_its_entry_point(notifier_installed):
    assert {"on_stall", "on_engine_restarted", "on_resource_sample", "guardian_shutdown"} <= set(
        notifier_installed["notifier"])


# -- a real receiver ---------------------------------------------------------------------------
@dataclass
class Received:
    path: str
    headers: dict
    body: bytes
    at: float  # time.monotonic() when it arrived

    def json(self) -> dict:
        return json.loads(self.body)


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that keeps every POST.

    ``statuses`` are answered in order, then 200; ``delay_s`` holds each
    answer back (a slow receiver), until the receiver is closed.
    """

    def __init__(self, statuses=(), delay_s: float = 0.0):
        self.received: list[Received] = []
        self.statuses = list(statuses)
        self.delay_s = delay_s
        self.closing = threading.Event()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    receiver.received.append(Received(self.path, dict(self.headers), body, time.monotonic()))
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                if receiver.delay_s:
                    receiver.closing.wait(receiver.delay_s)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except OSError:  # the sender timed out and left: nobody to answer
                    pass

            def log_message(self, *args):  # quiet: the test reads self.received
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def posts(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, path: str, count: int = 1, timeout: float = 30) -> list[Received]:
        return poll(lambda: len(self.posts(path)) >= count and self.posts(path), timeout,
                    what=f"{count} POST(s) to {path}")

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(**kwargs) -> Receiver:
        made.append(Receiver(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def toml_table(name: str, **settings) -> str:
    def value(v):
        if isinstance(v, bool):
            return str(v).lower()
        return json.dumps(v)  # strings, numbers and lists of strings read the same in TOML

    return f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in settings.items())


# -- what arrives --------------------------------------------------------------------------
SECRET_PATH = "/hook/SECRET-webhook-path"
TOPIC = "/guardian-alerts-SECRET-topic"
TOKEN = "tk_SECRETtoken0123456789"


def test_a_stall_reaches_the_webhook_and_ntfy_and_no_secret_reaches_the_log(start_server, receiver):
    rx = receiver()
    server = start_server(
        toml_table("guardian", log_level="DEBUG")  # httpx's request lines included
        + toml_table("fault_injection", enabled=True, hang_at_step=40)
        + toml_table("notifier", webhook_urls=[rx.url(SECRET_PATH)], ntfy_url=rx.url(TOPIC), ntfy_token=TOKEN))
    with httpx.Client(timeout=60) as client:
        result = read_stream(client, server.url + "/v1/chat/completions", chat_body(max_tokens=200, stream=True))
    assert result["status"] == 200 and result["done"]  # the guardian recovered; the notice is news

    [hook] = rx.wait_for(SECRET_PATH)
    notice = hook.json()
    assert hook.headers["Content-Type"] == "application/json"
    assert notice["source"] == "mlx-guardian" and notice["event"] == "stall"
    assert notice["details"]["action"] == "restart" and notice["details"]["heartbeat_age_s"] > 0
    assert "engine stalled" in notice["title"] and "no progress" in notice["message"]

    [ntfy] = rx.wait_for(TOPIC)
    assert "engine stalled" in ntfy.headers["Title"]
    assert ntfy.headers["Priority"] == "4" and ntfy.headers["Tags"] == "hourglass"
    assert ntfy.headers["Authorization"] == f"Bearer {TOKEN}"
    assert ntfy.body.decode() == notice["message"]  # plain text, the same words

    sent = server.wait_for_event("notification_sent", count=2)
    assert {e["channel"] for e in sent} == {"webhook", "ntfy"}
    assert {e["destination"] for e in sent} == {rx.url("")}  # scheme, host and port only
    assert server.events("resource_sample"), "the log is at debug level"
    assert "SECRET" not in server.log_path.read_text()


def storm(server, requests: range) -> None:
    """Three engine failures per request (a run, its re-run alone, once more after a
    probe): each prompt is poisoned, and each differs, so the quarantine of the one
    before does not refuse it at the door."""
    with httpx.Client(timeout=60) as client:
        for i in requests:
            response = client.post(server.url + "/v1/chat/completions", json=chat_body(f"STORM {i}"))
            assert response.status_code >= 500, response.text


def test_a_restart_storm_is_one_message_and_the_next_says_how_many_were_held_back(
        start_server, receiver, tmp_path):
    rx = receiver()
    notifier = {"webhook_urls": [rx.url("/hook")], "storm_restarts": 2}  # the default dedup window: 300 s
    config = (toml_table("fault_injection", enabled=True, poison_marker="STORM", message="poisoned prompt")
              + toml_table("recovery", max_failures=1000, reload_after_failures=0, backoff_base_s=0.0))
    server = start_server(config + toml_table("notifier", **notifier))
    storm(server, range(5))
    # Each request fails three times: twice, a probe, once more alone (tests/test_blame.py).
    server.wait_for_event("engine_restarted", count=15)  # the last may be logged after its answer
    [notice] = [r.json() for r in rx.wait_for("/hook")]
    assert notice["event"] == "restart_storm" and notice["suppressed"] == 0
    assert len(rx.posts("/hook")) == 1  # 15 restarts, one message
    # The window is live: closed, the next restart's notice counts those held back.
    server.config.write_text(
        config + toml_table("notifier", **notifier, dedup_window_s=0.0))
    server.wait_for_event("config_reloaded", timeout=30)
    storm(server, range(5, 6))
    _, later, *after = [r.json() for r in rx.wait_for("/hook", count=4)]
    assert later["suppressed"] == 13 and "13 more like it" in later["message"], later
    assert [notice["suppressed"] for notice in after] == [0, 0]
    # storm_window_s, live as well: at 0 no two restarts are within it, so a request's
    # three restarts send nothing; the window put back, the next request's first
    # restart counts only the last of those beside itself. One sender sends in order,
    # so a notice of the 0-s window would have come first.
    for version, window in ((2, 0.0), (3, 60.0)):
        server.config.write_text(
            config + toml_table("notifier", **notifier, dedup_window_s=0.0, storm_window_s=window))
        server.wait_for_event("config_reloaded", count=version, timeout=30)
        storm(server, range(4 + version, 5 + version))
        server.wait_for_event("engine_restarted", count=15 + 3 * version)  # all three in this window
    *_, first, second, third = [r.json() for r in rx.wait_for("/hook", count=7)]
    assert [n["details"]["restarts_in_window"] for n in (first, second, third)] == [2, 3, 4]
    assert len(rx.posts("/hook")) == 7
    server.proc.terminate()
    assert server.proc.wait(timeout=60) == 0
    assert len(rx.posts("/hook")) == 7  # a stop is no failure: no exit notice


def test_giving_up_is_a_message_sent_before_the_process_exits(start_server, receiver):
    rx = receiver()
    # Every engine step fails, the probes' included: two restarts (a storm), then
    # exit 4 at the third failure, the next probe's.
    server = start_server(
        toml_table("fault_injection", enabled=True, every_n_steps=1)
        + toml_table("watchdog", probe_interval_s=0.5)
        + toml_table("recovery", max_failures=2, reload_after_failures=0, backoff_base_s=0.0)
        + toml_table("notifier", webhook_urls=[rx.url("/hook")], ntfy_url=rx.url("/topic"), storm_restarts=2),
        wait=False)
    assert server.proc.wait(timeout=60) == 4
    # Read at once, no waiting: the exit notice went out before the process ended.
    hooks = [r.json() for r in rx.posts("/hook")]
    assert [n["event"] for n in hooks] == ["restart_storm", "exit"]
    assert hooks[1]["details"]["exit_code"] == 4 and "kept failing" in hooks[1]["message"]
    ntfy = rx.posts("/topic")
    assert [(r.headers["Priority"], r.headers["Tags"]) for r in ntfy] == [("4", "warning,repeat"),
                                                                          ("5", "rotating_light")]
    assert "exiting with code 4" in ntfy[1].headers["Title"]


def test_memory_pressure_is_one_message_per_crossing(start_server, receiver):
    rx = receiver()
    # Any memory is over a 1-byte limit: every sample finds admission paused.
    server = start_server(
        toml_table("guardian", log_level="DEBUG")
        + toml_table("watchdog", resource_interval_s=0.1)
        + toml_table("resources", refuse_above_bytes=1)
        + toml_table("notifier", webhook_urls=[rx.url("/hook")], dedup_window_s=0.0))
    [hook] = rx.wait_for("/hook")
    notice = hook.json()
    assert notice["event"] == "memory_pressure" and notice["details"]["refuse_above_bytes"] == 1
    assert notice["details"]["memory_used_bytes"] > 1
    # Nothing else in flight, a lone request is let in (the weights alone are over the line);
    # beside it, the next is refused.
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/chat/completions",
                           json=chat_body(max_tokens=1500, stream=True)) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(lines)
            response = client.post(server.url + "/v1/chat/completions", json=chat_body())
    assert response.status_code == 429 and response.json()["error"]["code"] == "memory_pressure"
    # Many more samples over the line: no dedup window, yet still one notice.
    seen = len(server.events("resource_sample"))
    server.wait_for_event("resource_sample", count=seen + 10)
    assert len(rx.posts("/hook")) == 1


# -- when the receiver misbehaves --------------------------------------------------------------
def test_retries_back_off_until_a_receiver_answers_and_a_receiver_that_is_down_is_given_up(
        start_server, receiver):
    flaky = receiver(statuses=[503, 503])
    down = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there
    server = start_server(
        toml_table("fault_injection", enabled=True, at_step=5, max_faults=1)
        + toml_table("notifier", webhook_urls=[down, flaky.url("/hook")], storm_restarts=1,
                     retries=2, backoff_s=0.3, backoff_max_s=0.4))
    response = httpx.post(server.url + "/v1/chat/completions", json=chat_body(), timeout=60)
    assert response.status_code == 200, response.text
    server.wait_for_event("engine_restarted")

    posts = flaky.wait_for("/hook", count=3)
    # Doubled from backoff_s, capped at backoff_max_s: 0.3 s, then 0.4 s (not 0.6).
    waits = [[e["retry_in_s"] for e in server.events("notification_retrying") if e["destination"] == d]
             for d in (down.removesuffix("/hook"), flaky.url(""))]
    assert waits == [[0.3, 0.4], [0.3, 0.4]], waits
    gaps = [later.at - earlier.at for earlier, later in zip(posts, posts[1:])]
    assert gaps[0] >= 0.3 * 0.9 and gaps[1] >= 0.4 * 0.9, gaps
    assert all(p.json() == posts[0].json() for p in posts)  # the same notice each time
    [sent] = server.wait_for_event("notification_sent")
    assert sent["attempts"] == 3 and sent["outcome"] == "HTTP 200"
    [failed] = server.wait_for_event("notification_failed")
    assert failed["attempts"] == 3 and failed["outcome"] == "ConnectError"
    assert failed["destination"] == down.removesuffix("/hook")
    assert len(server.events("notification_retrying")) == 4
    assert len(flaky.posts("/hook")) == 3


def test_a_receiver_that_never_answers_costs_the_engine_nothing(start_server, receiver):
    timeout_s = 4.0
    slow = receiver(delay_s=120)
    # A failure every 25 steps: a restart (and a notice) every few requests. Each
    # notice waits timeout_s in the sender; a hook that waited with it would hold
    # the engine that long at every restart.
    server = start_server(
        toml_table("fault_injection", enabled=True, every_n_steps=25)
        + toml_table("recovery", max_failures=1000, reload_after_failures=0, backoff_base_s=0.0)
        + toml_table("notifier", webhook_urls=[slow.url("/hook")], storm_restarts=1, dedup_window_s=0.0,
                     timeout_s=timeout_s, retries=0, queue_size=1))
    latencies = []
    with httpx.Client(timeout=60) as client:
        for i in range(16):
            started = time.monotonic()
            response = client.post(server.url + "/v1/chat/completions", json=chat_body(f"Story {i}.", max_tokens=8))
            latencies.append(time.monotonic() - started)
            assert response.status_code == 200, response.text
    restarts = len(server.events("engine_restarted"))
    print(f"\nmeasured: {restarts} restarts; request latency median {statistics.median(latencies):.3f} s, "
          f"max {max(latencies):.3f} s (the receiver holds each notice {timeout_s} s)")
    assert restarts >= 3
    assert max(latencies) < timeout_s * 0.75, latencies
    # Behind the receiver, the bounded queue overflowed: counted, not waited for.
    dropped = server.wait_for_event("notification_dropped")
    assert dropped[-1]["dropped_total"] == len(dropped) >= 1 and dropped[0]["queue_size"] == 1
    # And the sender gave each attempt timeout_s, no more.
    failed = server.wait_for_event("notification_failed", timeout=3 * timeout_s)[0]
    assert failed["outcome"] == "ReadTimeout" and failed["attempts"] == 1
    assert timeout_s * 1000 <= failed["duration_ms"] < (timeout_s + 2) * 1000, failed


def test_a_receiver_that_never_answers_holds_the_exit_no_longer_than_exit_flush_s(start_server, receiver):
    flush_s = 1.0
    silent = receiver(delay_s=120)
    server = start_server(
        toml_table("fault_injection", enabled=True, every_n_steps=1)
        + toml_table("watchdog", probe_interval_s=0.5)
        + toml_table("recovery", max_failures=1, reload_after_failures=0, backoff_base_s=0.0)
        + toml_table("notifier", webhook_urls=[silent.url("/hook")], timeout_s=60.0, exit_flush_s=flush_s),
        wait=False)
    assert server.proc.wait(timeout=60) == 4
    [stopping], [stopped] = server.events("server_stopping"), server.events("server_stopped")
    held_s = stamp(stopped) - stamp(stopping)
    print(f"\nmeasured: the exit took {held_s:.2f} s with exit_flush_s = {flush_s}")
    assert flush_s <= held_s < flush_s + 2.0
    [unsent] = server.events("notifications_unsent")
    assert unsent["flush_s"] == flush_s
    assert [r.json()["event"] for r in silent.posts("/hook")] == ["exit"]  # tried; never answered


# -- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("table, message", [
    ('ntfy_url = "ftp://example.invalid/SECRET"', "must start with http:// or https://"),
    ('events = ["stall", "lunch"]', "unknown ['lunch']"),
    ('events = ["stall", "https://hooks.example/SECRET"]', "unknown ['a string of 28 characters']"),
    ("timeout_s = 0", "timeout_s"),
])
def test_bad_settings_stop_the_start_naming_the_key_but_not_the_url(tmp_path, table, message):
    config = tmp_path / "guardian.toml"
    config.write_text(f"[notifier]\n{table}\n")
    result = run_guardian(["plugins", "--guardian-config", str(config)])
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "SECRET" not in result.stderr


def test_a_bad_setting_saved_while_serving_is_refused_whole(start_server, receiver, tmp_path):
    """The plugin's own checks (its Settings' __post_init__) run at every reload, as the types do: a
    mistake saved live is refused, the version in force stays, and the URL is not echoed.
    It was put in force, with a warning, and the bad destination failed every send."""
    rx = receiver()
    server = start_server(toml_table("notifier", webhook_urls=[rx.url("/hook")], events=["stall"]))
    config = server.config
    config.write_text(toml_table("notifier", webhook_urls=["hooks.example/SECRET"], events=["stall"]))
    [failed] = server.wait_for_event("config_reload_failed", timeout=30)
    assert "must start with http:// or https://" in failed["error_message"]
    assert "SECRET" not in server.log_path.read_text()
    status = httpx.get(server.url + "/guardian/status", timeout=10).json()["config"]
    assert status["loads"] == 1 and "[notifier]" in status["last_failure"]["error_message"]
    assert not server.events("config_reloaded")

"""Logs: JSON lines with snake_case events, stock's records in the same shape."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx

from conftest import REPO, chat_body, poll


def test_every_line_is_json_and_stock_records_carry_the_request_id(start_server):
    # Stock's per-request lines are kept at INFO (by default they are written
    # at DEBUG: test_quiet_logs.py).
    server = start_server("[guardian]\nstock_request_logs = true\n")
    response = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=30)
    request_id = response.json()["id"]
    # The access line is written once the response is sent: it may trail the client.
    server.wait_for_event("http_access")
    lines = server.logs()
    assert [line for line in lines if line["event"] == "non_json_line"] == []
    # mlx_lm's own logging (the root logger) went through the same renderer,
    # and lines written while serving the request name it.
    stock_lines = [line for line in lines if line.get("logger") == "root"]
    assert any(line.get("request_id") == request_id for line in stock_lines)
    # At INFO, the prefill's progress and the prompt cache's tables alike.
    events = [line["event"] for line in stock_lines if line["level"] == "info"]
    assert any(e.startswith("Prompt processing progress") for e in events), events
    assert any(e.startswith("Prompt Cache") for e in events), events
    guardian_events = {line["event"] for line in lines if line.get("logger", "").startswith("guardian")}
    assert {"server_started", "engine_ready", "http_access"} <= guardian_events
    # The model's modules and weights, every imported module, frozen out of the
    # collector's walks once loaded (guardian.long_lived): tens of thousands.
    [started] = [line for line in lines if line["event"] == "server_started"]
    assert started["frozen_objects"] > 20_000, started
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", event) for event in guardian_events)


def stock_lines_written(keep: bool) -> list[dict]:
    """What stock's logging calls write once logging is configured, kept or not."""
    code = ("import logging; from guardian.observability.logs import configure_logging, keep_stock_request_lines; "
            f"configure_logging('json', 'INFO'); keep_stock_request_lines({keep}); "
            "logging.info('Prompt processing progress: 1/2'); logging.warning('stock warns'); "
            "logging.error('stock fails')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return [json.loads(text) for text in result.stderr.splitlines()]


def test_stock_warnings_and_errors_stay_visible_and_its_info_lines_only_when_kept():
    assert [(line["level"], line["event"]) for line in stock_lines_written(False)] == [
        ("warning", "stock warns"), ("error", "stock fails")]
    assert [line["level"] for line in stock_lines_written(True)] == ["info", "warning", "error"]


def test_console_format_is_for_people(start_server):
    server = start_server("", "--log-format", "console")
    text = server.log_path.read_text()
    started = [line for line in text.splitlines() if "server_started" in line]
    assert started and not started[0].lstrip().startswith("{")


def test_one_access_line_with_the_status_the_client_got(start_server):
    # A poison request: stock buffers a 200 for it, then the guardian answers 500.
    server = start_server('[fault_injection]\nenabled = true\npoison_marker = "POISON"\nmessage = "planted poison"\n')
    response = httpx.post(server.url + "/v1/chat/completions", json=chat_body("POISON", max_tokens=4),
                          timeout=60)
    assert response.status_code == 500, response.text
    served = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=30)
    assert served.status_code == 200

    def statuses() -> dict[str, list[str]]:
        by_request: dict[str, list[str]] = {}
        for line in server.events("http_access"):
            if line.get("request_id"):
                by_request.setdefault(line["request_id"], []).append(line["line"].rsplit('" ', 1)[1].split()[0])
        return by_request

    # The access line is written once the answer has been sent, so the client
    # can read its 200 before the line is in the log: wait for the second one.
    poll(lambda: served.json()["id"] in statuses(), timeout=10, what="the served request's access line")
    assert list(statuses().values()) == [["500"], ["200"]], statuses()


def test_a_query_is_hidden_to_the_end_of_its_target():
    """A key after a quote, a "#", or a no-break space (which a target may hold, and
    where a regex's \\S stops) was logged whole."""
    from guardian.observability.logs import without_query_values

    for target in ('/v1/models?api_key=A"SEKRIT', "/v1/models?x=1#api-key=SEKRIT", "/v1/models?a=1\xa0key=SEKRIT",
                   "/v1/models?a=1\x85key=SEKRIT", "/v1/models?SEKRIT"):
        line = without_query_values(f'"GET {target} HTTP/1.1" 200 -')
        assert "SEKRIT" not in line and line.endswith(' HTTP/1.1" 200 -'), line
    assert without_query_values("/readyz?deep=1") == "/readyz?deep=***"


def test_a_line_longer_than_the_room_left_in_a_pipe_is_cut_not_waited_for():
    """"Takes a write" promises room for PIPE_BUF bytes: a 20 KB line (a traceback) into a
    pipe with 6 KB free blocked its thread, and every thread that logged behind it (found by
    a review). Now it is cut once its reader has taken nothing for LINE_WAIT_S, and the next
    line, once there is room, begins on a line of its own after the count of those lost."""
    import fcntl
    import logging
    import os
    import threading

    from guardian.observability.logs import LINE_WAIT_S, NeverBlockingStreamHandler

    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    try:
        room = 6000
        os.write(write_end, b"x" * (fcntl.fcntl(write_end, getattr(fcntl, "F_GETPIPE_SZ", 1032)) - room))
        handler = NeverBlockingStreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
        assert handler.takes_a_write()  # room for a piece, not for the line

        def log(message: str) -> threading.Thread:
            thread = threading.Thread(target=handler.handle, daemon=True, args=(
                logging.LogRecord("test", logging.ERROR, __file__, 0, message, None, None),))
            thread.start()
            return thread

        long_line, short_line = log("T" * 20_000), None
        long_line.join(timeout=LINE_WAIT_S + 5)
        assert not long_line.is_alive(), "the long line waited for a reader that does not read"
        short_line = log("short")  # no room left: dropped at once
        short_line.join(timeout=5)
        assert not short_line.is_alive()
        os.set_blocking(read_end, False)
        while True:  # the reader comes back
            try:
                if not os.read(read_end, 1 << 16):
                    break
            except BlockingIOError:
                break
        os.set_blocking(read_end, True)
        log("after").join(timeout=5)
        stream.flush()
        after = os.read(read_end, 1 << 16).decode()
        # The cut line ends, then the count (the cut line and the short one), then the line.
        assert after.startswith("\n"), after[:80]
        assert after.splitlines()[1:] == ["log_lines_dropped", "after"], after
        assert handler.dropped == 0 and not handler.cut
    finally:
        stream.close()
        os.close(read_end)


def test_a_reader_that_keeps_up_gets_every_long_line_whole():
    """Pieces, not lines: a reader that reads, however slowly, gets a 300 KB line (more
    than a pipe holds) whole, and nothing is dropped."""
    import logging
    import os
    import threading

    from guardian.observability.logs import NeverBlockingStreamHandler

    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    received = bytearray()

    def read() -> None:
        while chunk := os.read(read_end, 4096):
            received.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        handler = NeverBlockingStreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
        for line in ("A" * 300_000, "B" * 10):
            handler.handle(logging.LogRecord("test", logging.ERROR, __file__, 0, line, None, None))
        stream.close()
        reader.join(timeout=10)
        assert received.decode().splitlines() == ["A" * 300_000, "B" * 10]
        assert handler.dropped == 0
    finally:
        os.close(read_end)


def test_a_log_reader_that_stops_reading_never_stops_the_server(model_cache, tmp_path):
    """Its output is a pipe nobody reads (a terminal paused with Ctrl-S, a stopped
    mlx.launch, a hung collector): once the pipe was full, every thread that logged
    waited, and the server with them, /health included. Lines are dropped instead, and
    the first line written again says how many."""
    import os
    import time

    from conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "guardian", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "MLX_GUARDIAN_CACHE": str(model_cache)})
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        # Its start-up lines are few: the pipe (64 KiB) has room for them.
        poll(healthy, 60, interval=0.2, what="the server serving")
        with httpx.Client(timeout=5) as client:  # ~400 bytes of access line each: past the pipe's room
            for _ in range(400):
                assert client.get(url + "/v1/models", headers={"X-Request-ID": "x" * 100}).status_code == 200
            asked_at = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            assert time.monotonic() - asked_at < 2
            answer = client.post(url + "/v1/chat/completions", json=chat_body(max_tokens=2))
            assert answer.status_code == 200
        # The reader comes back: what was written is read, and the next line says what was lost.
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            try:
                if not os.read(proc.stdout.fileno(), 1 << 16):
                    break
            except BlockingIOError:
                break
        assert httpx.post(url + "/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30,
                          headers={"X-Request-ID": "after-the-pause"}).status_code == 200
        os.set_blocking(proc.stdout.fileno(), True)
        [dropped] = [json.loads(line) for line in [proc.stdout.readline()]]
        assert dropped["event"] == "log_lines_dropped" and dropped["lines"] > 0, dropped
        # Written by that request's thread, and none of its: no request's fields on it.
        assert "request_id" not in dropped, dropped
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_a_logger_used_before_logging_is_configured_again_follows_the_new_configuration():
    """Each module's ``log`` is cached on its first use. configure_logging made a new list of
    processors each time: a logger used between the command line's configuration and the
    file's kept the first, and structlog's capture_logs (which edits the list in place)
    missed it, so a test that captured a module's lines failed after another test had
    configured logging twice around a use of it."""
    import structlog
    from structlog.testing import capture_logs

    from guardian.observability.logs import configure_logging

    log = structlog.get_logger("guardian.test_logs")
    configure_logging("json", "INFO")
    log.info("cached_on_first_use")
    configure_logging("console", "INFO")
    with capture_logs() as captured:
        log.warning("seen_after_the_second_configuration")
    assert [entry["event"] for entry in captured] == ["seen_after_the_second_configuration"]

"""Real servers for the tests: ``mlx-guardian`` as a child process on 127.0.0.1.

Every server runs the real stock engine with the demo model on mlx's default
device (the CPU on Linux, the GPU on macOS), and is killed at the end of its
test. Waiting is always a poll with a deadline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import weakref
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

import forkserver
from guardian.serving.open_files import raise_open_files_limit

REPO = Path(__file__).resolve().parent.parent

# Nothing may download at run time: every server the tests start is offline (mlx_lm
# then fails at once on a model that is not here), and so is the fork server, which
# imports under this environment (huggingface_hub reads it at import).
os.environ["HF_HUB_OFFLINE"] = "1"


def share_one_tls_context() -> None:
    """httpx makes a TLS context for every client it makes, loading certifi's CA bundle:
    38 ms of CPU each, and a client is made for every top-level ``httpx.get``, each
    poll's included, though nearly every test talks plain HTTP to 127.0.0.1 (cProfile
    of test_recovery.py: 103 loads, 3.5 s of the test process's CPU). Clients that ask
    for the default verification share one context, made at the first; those given a
    context or a CA file of their own (test_tls.py) make theirs as before. Where httpx
    keeps the function elsewhere, nothing changes but the time."""
    try:
        from httpx._transports import default as transports
    except ImportError:
        return
    make = getattr(transports, "create_ssl_context", None)
    if make is None:
        return
    shared: dict[bool, object] = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in shared:
            shared[trust_env] = make(verify=True, trust_env=trust_env)
        return shared[trust_env]

    transports.create_ssl_context = create_ssl_context


share_one_tls_context()


# Test servers listen below every system's range of ephemeral ports (Linux
# 32768-60999, macOS 49152-65535): a port the kernel handed out (to a client's
# connection, a supervisor's child) is never one a test is about to bind, and
# each pytest process of `make test` (a lane, GUARDIAN_TEST_LANE, and its
# pytest-xdist worker, PYTEST_XDIST_WORKER gwN) has its own range, so a server
# of one cannot take the port another's server is still loading to bind. Ports
# go in steps of PORT_STEP: mlx.launch's ring takes the ports after the one it
# is given. A run outside `make test` takes the last range, split among its
# own workers where it has some (-n).
PORTS_PER_LANE = 1500
FIRST_PORT = 20000
PORT_STEP = 8
WORKERS_PER_LANE = 4  # tools/test_lanes.sh's -n, at most
OUTSIDE_LANES = 7  # the last of ranges 0-7 (20000-32000): runs outside `make test`


def _port_range() -> range:
    xdist_worker = os.environ.get("PYTEST_XDIST_WORKER")
    worker = int(xdist_worker.removeprefix("gw")) if xdist_worker else 0
    lane = os.environ.get("GUARDIAN_TEST_LANE")
    if lane is None:
        # Split among this run's workers, however many (-n 12 on the lent GPU's 16 cores:
        # a fixed 8 parts had two workers share one, and a server loading for 15 s there
        # lost its port to the other's).
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if xdist_worker else 1
        part = max(PORT_STEP, PORTS_PER_LANE // workers // PORT_STEP * PORT_STEP)
        start = FIRST_PORT + OUTSIDE_LANES * PORTS_PER_LANE + worker * part
        return range(start, start + part, PORT_STEP)
    index = int(lane) * WORKERS_PER_LANE + worker
    if worker >= WORKERS_PER_LANE or index >= OUTSIDE_LANES:
        raise RuntimeError(f"lane {lane}, worker gw{worker}: past the port ranges: at most {WORKERS_PER_LANE} "
                           "workers a lane, and 7 in all (tools/test_lanes.sh)")
    start = FIRST_PORT + index * PORTS_PER_LANE
    return range(start, start + PORTS_PER_LANE, PORT_STEP)


_lane_ports = _port_range()
_next_port = random.randrange(len(_lane_ports))  # two runs outside the lanes seldom meet


def free_port() -> int:
    """A port of this lane's range that nothing listens on or holds now."""
    global _next_port
    for _ in range(len(_lane_ports)):
        port = _lane_ports[_next_port % len(_lane_ports)]
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_lane_ports}")


def poll(condition: Callable[[], object], timeout: float, interval: float = 0.02, what: str = ""):
    """Call ``condition`` until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)  # the poll loop: bounded by the deadline above


def handlers_settled(read_connections: Callable[[], dict], timeout: float) -> dict:
    """The status's ``connections`` once no handler but the status read's own is busy.

    A handler counts itself out as it ends, just after its answer went out and its
    access line was written: a status read right after an answer may find it still
    counted. Fails at ``timeout`` (each caller's: what a fault it guards would exceed)."""
    def settled():
        connections = read_connections()
        return connections if connections["handlers_active"] <= 1 else None

    return poll(settled, timeout, what="no handler but the status read's own")


def stamp(event: dict) -> float:
    """A JSON log line's time, in seconds since the epoch."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def arm(path: Path, uses: int = 1) -> None:
    """Arm a fault plugin's file (``armed_by``) for ``uses`` faults, all at once: written
    in place, a step in another process could read it between its creation and its
    number, take the empty file for one use and remove it (a CI run's flake: two
    failures armed, one came)."""
    staged = path.with_name(path.name + ".staged")
    staged.write_text(str(uses))
    os.replace(staged, path)


def scraped(server, name: str, via: Optional[httpx.Client] = None, **labels) -> float:
    """The sum of a metric's samples in a scrape of ``server``'s /metrics, of those with
    ``labels`` if given (0 if none has them yet); the metric must be in the scrape.
    ``via``: the client to scrape with (one that trusts an HTTPS server's CA)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (via or httpx).get(server.url + "/metrics", timeout=5).text
    assert f" {name}" in text or f"\n{name}" in text, f"{name} not in the scrape"
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def hold_at_line(code, line: int, paused: threading.Event, go: threading.Event,
                 returned: Optional[threading.Event] = None):
    """A trace function (sys.settrace, threading.settrace) that holds a thread at the
    ``line``-th line it runs inside ``code``: it sets ``paused``, then waits for ``go``;
    ``returned`` is set when that frame returns. Where a thread the scheduler preempted, or
    a signal handler's moment, could meet the others: tests walk ``line`` over every line."""
    def trace(frame, event, arg):
        if frame.f_code is not code:
            return None
        lines = 0

        def local(frame, event, arg):
            nonlocal lines
            if event == "line":
                lines += 1
                if lines == line:
                    paused.set()
                    go.wait(10)
            elif event == "return" and returned is not None:
                returned.set()
            return local
        return local
    return trace


def pace(seconds: float) -> None:
    """Let ``seconds`` pass, where time itself is what a test waits for (a slow reader's
    pace between reads): a poll on the clock, with its deadline."""
    until = time.monotonic() + seconds
    poll(lambda: time.monotonic() >= until, seconds + 5, interval=min(seconds, 0.01), what=f"{seconds} s")


def parse_log(text: str) -> list[dict]:
    """A server's log lines, parsed; a line not a JSON object is ``non_json_line`` (two
    processes writing one file, as an mlx.launch group's ranks do, can leave a fragment
    such as ``123`` on a line of its own, which is JSON but no log line). A last line
    without its newline is one the server is writing now: left for the next read."""
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    lines = []
    for line in text.splitlines():
        try:
            parsed = json.loads(line)
        except json.JSONDecodeError:
            parsed = None
        lines.append(parsed if isinstance(parsed, dict) else {"event": "non_json_line", "line": line})
    return lines


# Every server a test may use (a module's shared ones too): a failing test's report shows
# what each one logged during it (``pytest_runtest_makereport``), since the workers' temporary
# folders, where the logs are, are gone by the time a flaky CI run is read.
SERVERS: "weakref.WeakSet[Server]" = weakref.WeakSet()
LOG_LINES_SHOWN = 150
LOG_LINE_CHARS = 600


class Server:
    # The file given as --guardian-config, which ``save_config`` writes; None: none.
    config: Optional[Path] = None

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"
        self.log_at_test_start = 0  # set as each test starts (a server started in it: 0)
        SERVERS.add(self)

    def config_in_force(self) -> Optional[str]:
        """The sha256 of the version of its file the server acts on now."""
        return httpx.get(self.url + "/guardian/status", timeout=10).json()["config"]["sha256"]

    def save_config(self, text: str, timeout: float = 30) -> None:
        """Save ``text`` as the server's file; return once that version is in force. A
        behaviour seen before then may still be the last version's (a linger_s left by a
        test before, under load, once passed for max_lingering = 0 at the supervisor).
        The file's modification time is set a second back once it is written, as a copy that
        keeps it leaves a file (``rsync -t``): a whole file, which the server reads without
        waiting for it to hold still (guardian.config.loading.STILL_S, half a second a save,
        ~90 s a lane). tests/test_file_watch.py and test_live_config.py time that wait."""
        self.config.write_text(text)
        written = time.time() - 1.0
        os.utime(self.config, (written, written))
        wanted = hashlib.sha256(text.encode()).hexdigest()
        poll(lambda: self.config_in_force() == wanted, timeout, what="the server to load its new configuration")

    def logs(self) -> list[dict]:
        return parse_log(self.log_path.read_text())

    def events(self, name: str) -> list[dict]:
        return [line for line in self.logs() if line.get("event") == name]

    def wait_for_event(self, name: str, timeout: float = 10, count: int = 1) -> list[dict]:
        return poll(lambda: len(self.events(name)) >= count and self.events(name), timeout, what=name)

    def health(self) -> int:
        return self.status("/health")

    def status(self, path: str) -> int:
        try:
            return httpx.get(self.url + path, timeout=5).status_code
        except httpx.TransportError:
            return 0

    def wait_healthy(self, timeout: float = 60) -> None:
        """Wait for /readyz: the model is loaded and the start-up probe passed,
        so no probe shares the engine with a test's first requests."""
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            return self.listening_here() and self.status("/readyz") == 200

        poll(ready, timeout, interval=0.05, what="/readyz 200")

    def listening_here(self) -> bool:
        """Whether this server's own log says it listens on its port (JSON or console
        lines): only then is an answer there this server's, not another's."""
        port = re.compile(rf"\b{self.port}\b")
        return any(("server_started" in line or "supervisor_started" in line) and port.search(line)
                   for line in self.log_path.read_text().splitlines())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


class NotifyReceiver:
    """systemd's side of sd_notify: an AF_UNIX datagram socket that keeps what it hears."""

    def __init__(self):
        # A short folder: AF_UNIX paths are limited to ~108 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="sd", dir="/tmp"))
        self.address = str(self.folder / "notify")
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(self.address)
        self.socket.settimeout(0.2)
        self.messages: list[str] = []

    def received(self, wanted: str) -> bool:
        """Read at most one datagram (waiting up to 0.2 s); whether ``wanted`` came yet."""
        try:
            self.messages.append(self.socket.recv(4096).decode())
        except socket.timeout:
            pass
        return wanted in self.messages

    def wait_for(self, wanted: str, timeout: float) -> None:
        poll(lambda: self.received(wanted), timeout, interval=0, what=wanted)

    def close(self) -> None:
        self.socket.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def root_logging_restored():
    """Each test's root logger as it found it. One that configures the guardian's logging
    in this process (configure_logging) points it at the stderr pytest captured for that
    test, closed once the test ends: a later test's library line (httpx's request line)
    then printed a "Logging error" traceback into the run's output."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def notify_receiver():
    receiver = NotifyReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """The demo model, built once for the session, shared by every server."""
    from guardian.demo_model import ensure_demo_model

    cache = tmp_path_factory.mktemp("model-cache")
    ensure_demo_model(cache)
    return cache


def spawn_guardian(args: list[str], log_path: Path, model_cache: Path, env: Optional[dict] = None,
                   fork: bool = True, python: str = sys.executable, **popen_kwargs) -> subprocess.Popen:
    """``python -m guardian ARGS`` with its output in ``log_path`` and the session's demo model:
    forked from the session's fork server where it can be (tests/forkserver.py; ``fork``
    False: never), else a ``subprocess`` (of ``python``: another venv's, another mlx-lm)."""
    child_env = {**os.environ, "MLX_GUARDIAN_CACHE": str(model_cache), **(env or {})}
    # A supervisor carries no mlx (it would, forked from the fork server), and starts in ~0.1 s.
    forking = (fork and not popen_kwargs and python == sys.executable and "--supervise" not in args
               and forkserver.serving(child_env))
    if forking:
        return forking.spawn(args, log_path, child_env, REPO)
    with open(log_path, "w") as log_file:
        return subprocess.Popen([python, "-m", "guardian", *args], stdout=log_file,
                                stderr=subprocess.STDOUT, env=child_env, cwd=REPO, **popen_kwargs)


def run_guardian(args: list[str], env: Optional[dict] = None, timeout: float = 60,
                 cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python -m guardian ARGS`` to its end, as ``subprocess.run(..., capture_output=True,
    text=True)`` gives it: forked from the session's fork server where it can be (a second
    of imports saved on each of the CLI's many short runs), else a ``subprocess``."""
    child_env = {**os.environ, **(env or {})}
    forking = "--supervise" not in args and forkserver.serving(child_env)
    if not forking:
        return subprocess.run([sys.executable, "-m", "guardian", *args], capture_output=True, text=True,
                              timeout=timeout, env=child_env, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="guardian-run-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        proc = forking.spawn(list(args), out, child_env, cwd, err_path=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
        return subprocess.CompletedProcess(proc.args, code, out.read_text(), err.read_text())


@pytest.fixture
def start_server(tmp_path, model_cache):
    servers: list[Server] = []

    def start(config: str = "", *args: str, wait: bool = True, env: Optional[dict] = None) -> Server:
        port = free_port()
        config_path = tmp_path / f"guardian-{port}.toml"
        config_path.write_text(textwrap.dedent(config))
        log_path = tmp_path / f"server-{port}.log"
        proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config_path), *args],
                              log_path, model_cache, env)
        server = Server(proc, port, log_path)
        server.config = config_path
        servers.append(server)
        if wait:
            server.wait_healthy()
        return server

    yield start
    for server in servers:
        server.stop()


# The two ways to run a server: tests parametrized over both run the same
# assertions against one process and against a supervisor's public port
# (`make test` runs the supervised ones against the newest mlx-lm only).
BOTH_MODES = ["one_process", pytest.param("supervised", marks=pytest.mark.subprocess_mode)]


def _hands_off() -> bool:
    from guardian import handoff

    return handoff.supported()


# A third, for modules where it matters: under --supervise, every request relayed through the
# supervisor. On Linux a supervisor hands most requests to its child (guardian.handoff); macOS
# cannot, so there "supervised" already is this, and only Linux runs it as a mode of its own.
RELAYED = pytest.param("relayed", marks=[
    pytest.mark.subprocess_mode,
    pytest.mark.skipif(not _hands_off(), reason="a supervisor relays every request here: the supervised mode is this")])


class SessionServer(Server):
    """A server started in a session of its own (``start_new_session=True``):
    stopping it kills its process group, a supervisor's children too."""

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # macOS: EPERM for a group whose leader is a zombie
            pass
        self.proc.wait(timeout=10)


class ModeServer(SessionServer):
    """A server a module's tests share, reconfigured live through ``self.config``:
    one process, or (``kind`` "supervised", or "relayed": ``RELAYED``) a supervisor in a
    session of its own."""

    def __init__(self, kind: str, folder: Path, model_cache: Path, config: str = "", *args: str,
                 headers: Optional[dict] = None):
        self.kind = kind
        self.supervised = kind in ("supervised", "relayed")
        self.status_headers = headers or {}
        self.config = folder / "guardian.toml"
        self.config.write_text(config + ("\n[supervisor]\nhand_off = false\n" if kind == "relayed" else ""))
        port = free_port()
        argv = ["--port", str(port), "--guardian-config", str(self.config), *args]
        if self.supervised:
            argv = ["--supervise", *argv]
        log_path = folder / f"{kind}.log"
        super().__init__(spawn_guardian(argv, log_path, model_cache, start_new_session=True), port, log_path)
        self.wait_healthy()
        if self.supervised:  # its /readyz is the child's: ready once a child is
            poll(lambda: httpx.get(self.url + "/guardian/supervisor", headers=headers or {},
                                   timeout=5).json()["state"] == "ready", 60, what="a ready child")

    def config_in_force(self) -> Optional[str]:
        """Under --supervise the supervisor's (which takes a version once its child runs it)."""
        if self.supervised:
            return httpx.get(self.url + "/guardian/supervisor", headers=self.status_headers,
                             timeout=10).json()["config_sha256"]
        return super().config_in_force()

    def check_passed_as_its_mode_says(self) -> None:
        """Under --supervise, the requests so far went to the child as this mode says:
        relayed, every one; supervised, handed off where this platform can."""
        if not self.supervised:
            return
        name = "mlx_guardian_supervisor_requests_passed_total"
        handed_off, relayed = scraped(self, name, how="handed_off"), scraped(self, name, how="relayed")
        if self.kind == "relayed":
            assert handed_off == 0 and relayed > 0, (handed_off, relayed)
        elif _hands_off():
            assert handed_off > 0, (handed_off, relayed)


class SharedServer(ModeServer):
    """One process a module's tests share, each reconfiguring it live: ``configure``
    saves the whole file (the keys read at start as they were, the live ones as the
    test wants) and waits until the server runs that version; ``logs`` (so
    ``events``) then hold only the lines since, the test's own. With
    ``[fault_injection] armable`` at start, a save arms or disarms faults."""

    def __init__(self, folder: Path, model_cache: Path, config: str = "", *args: str):
        super().__init__("one_process", folder, model_cache, config, *args)
        self.log_start = 0  # where in the log the current test's lines start

    def logs(self) -> list[dict]:
        with open(self.log_path, "rb") as log:
            log.seek(self.log_start)
            text = log.read().decode(errors="replace")
        return parse_log(text)

    def configure(self, text: str, then: str = "", mid_test: bool = False) -> "SharedServer":
        """Save ``text`` as the configuration; return once its version is in force
        and, if named, the event ``then`` is logged (a plugin that applies its
        change just after the new version is in force). The test's own log lines
        start here, unless ``mid_test`` (a test that changes the settings as it goes)."""
        if not mid_test:
            self.log_start = self.log_path.stat().st_size
        self.save_config(text, timeout=10)
        if then:
            self.wait_for_event(then)
        return self

    def alive(self) -> bool:
        """Running, its engine up (not restarting): fit for the next test. (Not
        /readyz: a server that lives past probe_max_age_s idle, probes off, is
        not ready, and healthy still.)"""
        return self.proc.poll() is None and self.health() == 200


# A tool the demo model's chat template renders into the prompt.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The name of the city"}},
                "required": ["city"],
            },
        },
    }
]


def read_to_the_end(sock) -> bytes:
    """What ``sock`` (a socket, TLS or not) receives until its peer closes (a reset raises)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def send_raw(port: int, body: dict, rcvbuf: int = 0, path: str = "/v1/chat/completions") -> socket.socket:
    """POST ``body`` on a socket of its own, its answer left unread: the caller reads it, or
    closes the socket to leave. ``rcvbuf``: a small receive buffer, for a client that reads
    nothing (its answer then waits in the server's buffers)."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def chat_body(content: str = "Tell me a story.", max_tokens: int = 16, stream: bool = False, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def read_stream(client: httpx.Client, url: str, body: dict) -> dict:
    """Send a streaming request; return its status, data events and whether [DONE] came."""
    result = {"status": None, "events": [], "done": False, "errors": []}
    with client.stream("POST", url, json=body) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            response.read()
            result["body"] = response.json()
            return result
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result["done"] = True
                continue
            event = json.loads(data)
            result["events"].append(event)
            if "error" in event:
                result["errors"].append(event["error"])
                result["error_at"] = time.time()
    return result


def pytest_collection_modifyitems(items):
    """Mark the supervisor's tests: `make test` runs them in one venv only (see the
    Makefile); skip a test marked ``linux(reason)`` elsewhere, saying why."""
    for item in items:
        if item.path.name.startswith("test_supervisor"):
            item.add_marker(pytest.mark.subprocess_mode)
        # The tiers: a test that needs no model (so no engine, no server that
        # serves one) is a unit test, run alone by `make test-fast`.
        if "model_cache" not in item.fixturenames:
            item.add_marker(pytest.mark.unit)
        linux = item.get_closest_marker("linux")
        if linux is not None and not sys.platform.startswith("linux"):
            item.add_marker(pytest.mark.skip(reason=f"Linux only: {linux.args[0]}"))


def system_tool(name: str, install: str) -> tuple[Optional[str], str]:
    """(the path of a system tool on PATH or None, the reason to skip without it).

    PATH only, so that a machine without the tool can be tried by hiding it
    from PATH; ``install`` says how to get it (``make system-packages`` does).
    """
    return shutil.which(name), f"{name} is not on PATH ({install}; Debian puts some in /usr/sbin)"


def needs_tool(name: str, install: str):
    """Skip unless ``name`` is on PATH."""
    path, reason = system_tool(name, install)
    return pytest.mark.skipif(path is None, reason=reason)


def _log_size(server: Server) -> int:
    try:
        return server.log_path.stat().st_size
    except OSError:
        return 0


def pytest_runtest_setup(item):
    for server in list(SERVERS):
        server.log_at_test_start = _log_size(server)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the last lines each server logged during it."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or hasattr(report, "wasxfail"):
        return
    for server in list(SERVERS):
        if _log_size(server) <= server.log_at_test_start:
            continue
        with open(server.log_path, "rb") as log:
            log.seek(server.log_at_test_start)
            lines = log.read().decode(errors="replace").splitlines()
        shown = [line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS] + " [...]"
                 for line in lines[-LOG_LINES_SHOWN:]]
        skipped = f"({len(lines) - len(shown)} earlier lines left out)\n" if len(lines) > len(shown) else ""
        report.sections.append((f"server log {server.log_path} ({report.when})", skipped + "\n".join(shown)))


def pytest_configure(config):
    # Some tests hold hundreds of connections to a server in this process (a wave of 768 in
    # test_connection_deadlines: ~1,540 descriptors): raised as a server raises its own, not
    # left to an import that happens to raise it (guardian.stock). A Mac's soft limit is 256.
    raise_open_files_limit()
    # Before any test can change the environment the fork server imports under. Not in
    # pytest-xdist's controller (-n), which runs no test: each worker starts its own.
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    forkserver.start(Path(tempfile.gettempdir()) / f"guardian-forkserver-{os.getpid()}.log")


def pytest_unconfigure(config):
    forkserver.close()

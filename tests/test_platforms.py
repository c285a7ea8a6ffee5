"""The product's Linux-only paths, and their branch elsewhere (macOS), tried
here by simulating the platform: the parent-death signal (prctl), /proc reads,
sd_notify's socket flags, the open-files limit, macOS's errors. No server, no model."""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import structlog

from conftest import poll
from guardian.errors import CLIENT_GONE, write_error_as_client_gone
from guardian.observability import metrics as observability_metrics
from guardian.supervise.client_writes import client_writer
from guardian.serving import connection, open_files, sockets
from guardian.health import parent_watch
from guardian.health.sd_notify import SystemdNotifier
from guardian.stock.import_guard import never_lowered


def test_on_macos_no_prctl_is_asked_for(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("prctl is Linux's: no libc call on macOS"))
    parent_watch.ask_for_sigterm_when_parent_dies()


# A process that watches its parent as on macOS (no prctl): when the parent
# dies it writes ORPHANED to the file named by its argument, then exits.
ORPHAN = textwrap.dedent("""
    import os, sys, threading
    sys.platform = "darwin"
    from guardian.health import parent_watch
    parent_watch.POLL_S = 0.05
    def orphaned():
        open(sys.argv[1], "w").write("ORPHANED")
        os._exit(0)
    parent_watch.die_with_parent(orphaned)
    open(sys.argv[1] + ".ready", "w").write(str(os.getpid()))
    threading.Event().wait(60)  # until the watch ends it (bounded: the test kills it too)
""")
# Its parent: starts it, then waits to be killed.
PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    child.wait(timeout=60)  # until the test kills this process
""")


def test_on_macos_the_parent_watch_notices_the_parent_die(tmp_path):
    marker = tmp_path / "orphan"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, ORPHAN, str(marker)])
    try:
        ready = tmp_path / "orphan.ready"
        poll(ready.exists, 30, what="the child watching its parent")
        poll(lambda: ready.read_text().strip().isdigit(), 5, what="the child's pid")
        child = int(ready.read_text())
        parent.kill()
        parent.wait(timeout=10)
        poll(lambda: marker.exists() and marker.read_text() == "ORPHANED", 10, what="the orphaned child's callback")
    finally:
        parent.kill()
        if "child" in locals():
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_without_procs_somaxconn_the_backlog_asked_is_the_default(monkeypatch, tmp_path):
    monkeypatch.setattr(sockets, "SOMAXCONN_PATH", str(tmp_path / "absent"))  # macOS has no /proc
    assert sockets.listen_backlog() == sockets.LISTEN_BACKLOG


def test_a_readable_somaxconn_caps_the_backlog_at_no_less_than_1024(monkeypatch, tmp_path):
    somaxconn = tmp_path / "somaxconn"
    monkeypatch.setattr(sockets, "SOMAXCONN_PATH", str(somaxconn))
    somaxconn.write_text("128\n")
    assert sockets.listen_backlog() == 1024
    somaxconn.write_text("2048\n")
    assert sockets.listen_backlog() == 2048


def test_sd_notify_needs_no_linux_socket_flag(monkeypatch, notify_receiver):
    monkeypatch.delattr(socket, "SOCK_CLOEXEC", raising=False)  # as on macOS
    notifier = SystemdNotifier(notify_receiver.address)
    assert notifier.notify("READY=1")
    notify_receiver.wait_for("READY=1", 5)


def test_on_macos_the_open_files_limit_is_raised_within_what_the_kernel_takes(monkeypatch):
    """macOS reports an unlimited hard limit but refuses a soft one above
    kern.maxfilesperproc (10240 here, simulated)."""
    applied = []

    def setrlimit(kind, limits):
        if limits[0] > 10240:
            raise ValueError("not allowed to raise maximum limit")
        applied.append(limits)

    monkeypatch.setattr(resource, "getrlimit", lambda kind: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert open_files.raise_open_files_limit() == 10240
    assert applied == [(10240, resource.RLIM_INFINITY)]


def test_a_library_may_raise_the_soft_open_files_limit_but_lower_neither(monkeypatch):
    limits = {"now": (4096, 8192)}
    monkeypatch.setattr(resource, "getrlimit", lambda kind: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda kind, value: limits.update(now=value))
    with never_lowered():
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 4096))  # what mlx_lm.utils asks
        assert limits["now"] == (4096, 8192)
        resource.setrlimit(resource.RLIMIT_NOFILE, (6000, 9000))
        assert limits["now"] == (6000, 8192)  # the hard limit is not the library's to raise
        limits["now"] = (256, 256)  # a hard limit under mlx_lm's 4096: its import must not fail
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 4096))
        assert limits["now"] == (256, 256)


def test_on_macos_a_write_refused_with_eprototype_is_the_client_leaving():
    """macOS answers a write to a connection its peer is tearing down with EPROTOTYPE
    now and then: the relay (and a handler) must take it for the client's leaving
    (BrokenPipeError), not for its child's failure (a crash suspect, a relay error)."""

    class TearingDown:  # a TLS socket's send, under the connection layer's (handoff.send_all)
        def send(self, data):
            raise OSError(errno.EPROTOTYPE, "Protocol wrong type for socket")

    write = client_writer(connection.BufferedConnection(TearingDown(), b""))
    with pytest.raises(BrokenPipeError):
        write(b"data: {}\n\n")
    assert isinstance(write_error_as_client_gone(OSError(errno.EPROTOTYPE, "x")), CLIENT_GONE)
    other = OSError(errno.EIO, "x")
    assert write_error_as_client_gone(other) is other


def test_a_send_buffer_the_kernel_refuses_is_logged_once_and_the_request_served():
    """macOS refuses SO_SNDBUF past ~7 MiB (ENOBUFS) where Linux caps it."""

    class RefusesBigBuffers(socket.socket):
        def setsockopt(self, *args):
            raise OSError(errno.ENOBUFS, "No buffer space available")

    server = connection.HeldConnections.__new__(connection.HeldConnections)
    with RefusesBigBuffers() as sock, structlog.testing.capture_logs() as logged:
        server.set_send_buffer(sock, 8 << 20)
        server.set_send_buffer(sock, 8 << 20)
    assert [line["event"] for line in logged] == ["http_send_buffer_refused"]


@pytest.mark.parametrize("namespace", ["", "mlx_guardian_supervisor"])  # a process's own; a supervisor's beside its child's
def test_without_procs_process_metrics_they_come_from_psutil(monkeypatch, namespace):
    """prometheus-client's process collector reads /proc, and reports nothing on macOS."""
    from prometheus_client import ProcessCollector
    from prometheus_client.parser import text_string_to_metric_families

    def scraped(registry) -> dict[str, float]:
        text = observability_metrics.exposition(registry, None)[0].decode()
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    from_proc = observability_metrics.new_registry()
    observability_metrics.register_process_metrics(from_proc, namespace)
    monkeypatch.setattr(observability_metrics, "ProcessCollector", lambda registry, namespace="": ProcessCollector(
        namespace=namespace, proc="/no-proc-here", registry=registry))
    from_psutil = observability_metrics.new_registry()
    observability_metrics.register_process_metrics(from_psutil, namespace)
    linux, portable = scraped(from_proc), scraped(from_psutil)
    assert set(portable) == set(linux) and len(linux) == 6
    p = namespace + "_" if namespace else ""
    assert portable[p + "process_resident_memory_bytes"] > 10e6 and portable[p + "process_open_fds"] > 2
    assert abs(portable[p + "process_start_time_seconds"] - linux[p + "process_start_time_seconds"]) < 2


def test_a_child_whose_supervisor_died_before_the_child_looked_is_orphaned_at_once(monkeypatch):
    """A supervised child starts watching seconds after it starts (mlx_lm's import): it
    watches the supervisor named in its environment, not whatever parent it has by then."""
    monkeypatch.setattr(parent_watch, "ask_for_sigterm_when_parent_dies", lambda: None)
    monkeypatch.setenv(parent_watch.PARENT_PID_ENV, str(os.getppid() + 100_000))  # not our parent
    orphaned = []
    parent_watch.die_with_parent(lambda: orphaned.append(True), parent=parent_watch.supervisor_pid())
    poll(lambda: orphaned, 5, what="the orphaned callback")
    monkeypatch.setenv(parent_watch.PARENT_PID_ENV, "")
    assert parent_watch.supervisor_pid() is None


def test_on_macos_the_machines_names_need_no_reverse_lookup(monkeypatch):
    """getfqdn is a reverse lookup: seconds at every start on a Mac whose name no DNS knows."""
    from guardian.access import policy

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(socket, "getfqdn", lambda *a: pytest.fail("no reverse lookup on macOS"))
    monkeypatch.setattr(socket, "gethostname", lambda: "Studio-Mac.local")
    assert policy.machine_names() == {"studio-mac.local", "studio-mac"}


def test_a_rank_watches_its_supervisor_beside_its_launcher(monkeypatch):
    """On macOS (no prctl) mlx.launch outlives a killed supervisor, and its ranks with it,
    holding the model's memory: a rank on the supervisor's machine watches the supervisor too."""
    monkeypatch.setattr(parent_watch, "POLL_S", 0.05)
    # A stand-in that lives until it is killed (or its stdin closes, should the test fail first).
    supervisor = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gone = []
    try:
        parent_watch.die_with_process(supervisor.pid, lambda: gone.append(True))
        assert not gone
        supervisor.kill()
        supervisor.wait(timeout=10)
        poll(lambda: gone, 5, what="the supervisor's end seen")
    finally:
        supervisor.kill()
        supervisor.stdin.close()
        supervisor.wait(timeout=10)
    # Only a process that started this one is watched: a pid from another host's environment is not.
    assert parent_watch.is_ancestor(os.getppid()) and not parent_watch.is_ancestor(supervisor.pid)

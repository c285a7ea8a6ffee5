"""Loaded at start-up by a process a test starts with this folder on PYTHONPATH
(tests/test_supervisor.py, tests/test_reader_crash.py). Nothing here runs without its
variable; the guardian's own code is not changed.

- ``GUARDIAN_TEST_LATE_RESUME_S``: the supervisor's handler thread that takes back a
  request the reader handed off (the child died with it or gave it back) starts that
  many seconds late, as on a loaded machine.
- ``GUARDIAN_TEST_CRASH_READER_ARMED_BY`` (a path) and ``GUARDIAN_TEST_CRASH_READER_IN``
  (``supervisor`` or ``server``): once the path exists, the HTTP reader of that process
  (the supervisor's public port, or a one-process server's) raises from its loop, once.
  A supervisor's child inherits the variables, and its own reader is left alone.
- ``GUARDIAN_TEST_DIE_BEFORE_SEND`` (bytes, as latin-1) and ``GUARDIAN_TEST_DIE_ARMED_BY``
  (a path): once the path exists, a supervised child SIGKILLs itself just before the
  first socket write that holds those bytes, once: where a native crash would cut an
  answer between two of its writes.
- ``GUARDIAN_TEST_STOCK_STEP_RAISES_ARMED_BY`` (a path): in stock's own server (a
  supervisor's stock child, ``python -m guardian.supervise.stock_child server``), once
  the path exists, the next call of stock's ``BatchGenerator.next`` raises the
  incident's error and removes the path (one holding a number N: N such failures, one a
  process): its generation thread dies (tests/plugins/stock_step_faults.py plants the
  same in a guardian).
- ``GUARDIAN_TEST_LATE_IDLE_STOP_S``: a supervisor that found its child idle for
  ``[supervisor] idle_stop_s`` (and logged ``test_idle_stop_late``) stops it SIGTERM that many
  seconds later, as on a loaded machine: a request may come between the verdict and the signal.
- ``GUARDIAN_TEST_INOTIFY_LIMIT_REACHED`` (Linux): every inotify instance the process asks
  for fails as at the kernel's limit (EMFILE, watchdog's "inotify instance limit reached"),
  which the user's other processes reach on a busy host."""

import os
import sys

if os.environ.get("GUARDIAN_TEST_LATE_RESUME_S"):
    import threading

    import guardian.supervise.proxy as proxy

    _late_s = float(os.environ["GUARDIAN_TEST_LATE_RESUME_S"])
    _resumed_outcome = proxy.ProxyHandler.resumed_outcome

    def _late_resumed_outcome(handler, passed):
        threading.Event().wait(_late_s)
        return _resumed_outcome(handler, passed)

    proxy.ProxyHandler.resumed_outcome = _late_resumed_outcome

if os.environ.get("GUARDIAN_TEST_CRASH_READER_ARMED_BY"):
    import guardian.serving.reader as reader

    _armed_by = os.environ["GUARDIAN_TEST_CRASH_READER_ARMED_BY"]
    _in_supervisor = os.environ.get("GUARDIAN_TEST_CRASH_READER_IN") == "supervisor"
    _take_arrivals = reader.RequestReader._take_arrivals

    def _crashing_take_arrivals(self):
        # Read at the call: sys.argv is not set yet while sitecustomize runs.
        if ("--supervise" in sys.argv) == _in_supervisor and os.path.exists(_armed_by):
            os.remove(_armed_by)
            raise RuntimeError("planted in the HTTP reader's loop")
        return _take_arrivals(self)

    reader.RequestReader._take_arrivals = _crashing_take_arrivals

if os.environ.get("GUARDIAN_TEST_DIE_ARMED_BY"):
    import signal
    import socket

    _die_armed_by = os.environ["GUARDIAN_TEST_DIE_ARMED_BY"]
    _die_before = os.environ["GUARDIAN_TEST_DIE_BEFORE_SEND"].encode("latin-1")

    def _dying(send):
        def send_or_die(sock, data, *args):
            # Read at the call: sys.argv is not set yet while sitecustomize runs.
            if ("--supervise" not in sys.argv and _die_before in bytes(data)
                    and os.path.exists(_die_armed_by)):
                os.remove(_die_armed_by)
                os.kill(os.getpid(), signal.SIGKILL)
            return send(sock, data, *args)
        return send_or_die

    socket.socket.send = _dying(socket.socket.send)
    socket.socket.sendall = _dying(socket.socket.sendall)

if os.environ.get("GUARDIAN_TEST_STOCK_STEP_RAISES_ARMED_BY"):
    # sys.argv is not set yet while sitecustomize runs; the interpreter's own is.
    if sys.orig_argv[1:4] == ["-m", "guardian.supervise.stock_child", "server"]:
        from mlx_lm.generate import BatchGenerator

        from tests.plugins.arming import disarm  # the repository is on PYTHONPATH (with_supervisor_hooks)

        _step_armed_by = os.environ["GUARDIAN_TEST_STOCK_STEP_RAISES_ARMED_BY"]
        _next = BatchGenerator.next

        def _raising_next(self, *args, **kwargs):
            if disarm(_step_armed_by):
                raise RuntimeError("[metal::malloc] Resource limit (499000) exceeded.")
            return _next(self, *args, **kwargs)

        BatchGenerator.next = _raising_next

if os.environ.get("GUARDIAN_TEST_LATE_IDLE_STOP_S") and "--supervise" in sys.orig_argv:
    import threading

    import guardian.supervise.supervisor as supervisor

    _idle_late_s = float(os.environ["GUARDIAN_TEST_LATE_IDLE_STOP_S"])
    _stop_idle_child = supervisor.Supervisor.stop_idle_child

    def _late_stop_idle_child(self, child, idle_s):
        supervisor.log.info("test_idle_stop_late", pid=child.pid, idle_s=round(idle_s, 3), late_s=_idle_late_s)
        threading.Event().wait(_idle_late_s)
        return _stop_idle_child(self, child, idle_s)

    supervisor.Supervisor.stop_idle_child = _late_stop_idle_child

if os.environ.get("GUARDIAN_TEST_INOTIFY_LIMIT_REACHED") and sys.platform == "linux":
    import errno

    from watchdog.observers.inotify_c import InotifyFD

    def _limit_reached(cls):
        # What watchdog raises when inotify_init fails with EMFILE (the user's instances
        # are all taken: fs.inotify.max_user_instances).
        raise OSError(errno.EMFILE, "inotify instance limit reached")

    InotifyFD._create_inotify_fd = classmethod(_limit_reached)

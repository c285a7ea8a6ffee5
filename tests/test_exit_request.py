"""A signal handler runs on the main thread between two of its lines, wherever the main
thread is; serve's SIGTERM handler asks for the exit (guardian.serving.exit_request). It
once took the lock of the ``threading.Event`` the main thread waited on: a signal landing
while the main thread held that lock deadlocked the process for good (a supervised child
logged ``parent_gone`` after its supervisor's SIGKILL and never stopped)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import hold_at_line, poll

# Run in a process of its own: the failure is a deadlock. A trace function is called
# where a handler could run, at every line the main thread runs inside ``wait`` (the
# standard library's included), and does what serve's SIGTERM handler does, at the
# first line, then the second, and so on, until a wait ends before the call comes.
AT_EVERY_LINE_OF_WAIT = textwrap.dedent("""
    import sys, threading
    from guardian.exit_codes import EXIT_OK
    from guardian.serving.exit_request import ExitRequest

    def wait_with_a_handler_at(line):
        exit_request = ExitRequest()
        lines = 0

        def handler_here(frame, event, arg):
            nonlocal lines
            if event == "line":
                lines += 1
                if lines == line:
                    exit_request(EXIT_OK)  # what serve's SIGTERM handler does
            return handler_here

        # No handler call at all past the last line: the exit then comes from a thread.
        threading.Timer(0.2, exit_request, (EXIT_OK,)).start()
        sys.settrace(handler_here)
        try:
            assert exit_request.wait() == EXIT_OK
        finally:
            sys.settrace(None)
        return lines >= line

    line = 1
    while wait_with_a_handler_at(line):
        print("returned with the handler at line", line, flush=True)
        line += 1
    print("every line", line - 1, flush=True)
""")


def test_a_signal_handler_asking_for_the_exit_at_any_line_of_the_wait_never_deadlocks():
    try:
        done = subprocess.run([sys.executable, "-c", AT_EVERY_LINE_OF_WAIT], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired as e:
        shown = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        last = shown.strip().splitlines()[-1:] or ["before the first line"]
        raise AssertionError(f"the wait deadlocked after: {last[0]}") from None
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("every line")


def test_a_failure_wins_over_a_clean_stop_asked_for_first_and_not_the_other_way():
    """serve gives the engine ``fail`` for its give-up: a SIGTERM landing as the engine gave
    up (exit 4) made the process exit 0, and launchd or systemd read a clean stop."""
    from guardian.exit_codes import EXIT_OK
    from guardian.serving.exit_request import ExitRequest

    stopped_then_failed = ExitRequest()
    stopped_then_failed(EXIT_OK)
    stopped_then_failed.fail(4)
    assert stopped_then_failed.wait() == 4
    failed_then_stopped = ExitRequest()
    failed_then_stopped.fail(4)
    failed_then_stopped(EXIT_OK)
    assert failed_then_stopped.wait() == 4


def test_work_left_for_the_main_thread_runs_there_and_a_failure_of_it_ends_nothing():
    """SIGHUP's reload runs on the main thread, in wait: one that raises is logged, and the
    server goes on waiting for its exit."""
    import threading

    from guardian.serving.exit_request import ExitRequest

    exit_request = ExitRequest()
    ran_on = []
    exit_request.run_on_main_thread(lambda: 1 / 0)
    exit_request.run_on_main_thread(lambda: ran_on.append(threading.current_thread()))
    exit_request.run_on_main_thread(lambda: exit_request(3))
    assert exit_request.wait() == 3
    assert ran_on == [threading.current_thread()]


def test_a_failure_set_while_a_clean_stop_is_half_asked_for_still_wins():
    """The clean stop (a signal's) and the failure (the engine's give-up, on its thread) each
    looked at one shared code, then wrote it: a failure written between the stop's look and
    its write was overwritten with 0. The stop's caller is held at each line in turn."""
    import sys
    import threading

    from guardian.exit_codes import EXIT_OK
    from guardian.serving.exit_request import ExitRequest

    line = 1
    while True:
        exit_request = ExitRequest()
        paused, go = threading.Event(), threading.Event()
        held = hold_at_line(ExitRequest.__call__.__code__, line, paused, go)

        def stop():
            sys.settrace(held)
            try:
                exit_request(EXIT_OK)
            finally:
                sys.settrace(None)

        stopper = threading.Thread(target=stop)
        stopper.start()
        poll(lambda: paused.is_set() or not stopper.is_alive(), 10, what="the stop held or done")
        reached = paused.is_set()
        exit_request.fail(4)
        go.set()
        stopper.join(10)
        assert exit_request.wait() == 4, f"the stop held at line {line}"
        if not reached:
            break
        line += 1
    assert line > 2


def test_work_a_signal_queued_as_the_exit_came_from_elsewhere_still_runs():
    """A rank's SIGTERM queues its asking rank 0 to stop; rank 0's own word to stop may set
    the exit first, and ``wait`` returned with the asking (and its log line) never run."""
    from guardian.exit_codes import EXIT_OK
    from guardian.serving.exit_request import ExitRequest

    exit_request = ExitRequest()
    ran = []
    exit_request(EXIT_OK)  # rank 0's word, first
    exit_request.run_on_main_thread(lambda: ran.append("asked"))  # the signal's work, just after
    assert exit_request.wait() == EXIT_OK
    exit_request.run_pending()
    assert ran == ["asked"]

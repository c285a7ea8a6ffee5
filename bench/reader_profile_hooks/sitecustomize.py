"""Loaded at start-up by every server ``bench/reader_profile.py`` starts (on PYTHONPATH):
wraps the steps a request takes through the connection layer's reader, the supervisor's
fast hand-off and the child's taking of it, and adds up each step's thread CPU
(``time.thread_time_ns``, system calls included) and calls, and each request's handler
thread from start to end (``handler``: stock's handler, or the supervisor's). Every second a daemon thread
writes the sums to ``$READER_PROFILE_DIR/<pid>.json``, and the names of the threads Python
started to ``<pid>.threads.json`` (the engine's loop as ``generation-loop``). Nothing here runs without that
variable; the guardian's own code is not changed."""

import os

if os.environ.get("READER_PROFILE_DIR"):
    import json
    import selectors
    import socketserver
    import sys
    import threading
    import time

    import guardian.access.policy as policy
    import guardian.handoff as handoff
    import guardian.quarantine.crashes as crashes
    import guardian.serving.connection as connection
    import guardian.serving.reader as reader_module
    import guardian.supervise.fast_handoff as fast_handoff
    import guardian.supervise.proxy as proxy

    _sums: dict = {}
    _clock = time.thread_time_ns

    def _timed(step, function, reader_thread_only=False):
        def wrapper(*args, **kwargs):
            if reader_thread_only and threading.current_thread().name != "http-reader":
                return function(*args, **kwargs)
            started = _clock()
            try:
                return function(*args, **kwargs)
            finally:
                sums = _sums.setdefault(step, [0, 0])
                sums[0] += _clock() - started
                sums[1] += 1
        return wrapper

    reader = reader_module.RequestReader
    for name, step in (("_accept", "accept"), ("_on_readable", "read"), ("_on_ready", "child_word"),
                       ("_take_handoffs", "take_handoffs"), ("_drain_wakeups", "wake"),
                       ("_on_watched", "watched"), ("_take_arrivals", "loop"), ("_expire", "loop"),
                       ("_run_timers", "loop")):
        setattr(reader, name, _timed(step, getattr(reader, name)))
    selectors.DefaultSelector.select = _timed("select", selectors.DefaultSelector.select, reader_thread_only=True)
    connection.HeldConnections.dispatch = _timed("dispatch", connection.HeldConnections.dispatch)
    proxy.PublicServer.dispatch = _timed("dispatch", proxy.PublicServer.dispatch)
    fast_handoff.RequestHead.parse = classmethod(_timed("hand_off.parse", fast_handoff.RequestHead.parse.__func__))
    policy.AccessPolicy.check = _timed("hand_off.door", policy.AccessPolicy.check, reader_thread_only=True)
    fast_handoff.child_request = _timed("hand_off.child_request", fast_handoff.child_request)
    crashes.CrashQuarantine.start_fast_relay = _timed("hand_off.quarantine", crashes.CrashQuarantine.start_fast_relay)
    handoff.Channel.hand = _timed("hand_off.hand", handoff.Channel.hand)
    handoff.HandedOff.progress = _timed("hand_off.progress", handoff.HandedOff.progress)
    handoff.receive = _timed("take_handoffs.receive", handoff.receive)
    # A handler's whole life (setup, handle, finish) runs in this __init__, on its own thread.
    socketserver.BaseRequestHandler.__init__ = _timed("handler", socketserver.BaseRequestHandler.__init__)

    def _write(path: str, data) -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    def _runs_engine_loop(frame) -> bool:
        """Whether a thread's stack holds the guardian's engine loop (GuardianEngine.run_guarded),
        found by the guardian's own code: stock starts that thread unnamed, and importing the
        engine here would bring mlx into the supervisor."""
        while frame is not None:
            code = frame.f_code
            if code.co_name == "run_guarded" and code.co_filename.endswith(os.path.join("engine", "generator.py")):
                return True
            frame = frame.f_back
        return False

    def _thread_names() -> dict:
        """This process's threads that Python started, by native id: their names, the engine's
        loop as ``generation-loop`` (the rest are mlx's own)."""
        frames = sys._current_frames()
        return {str(thread.native_id): "generation-loop" if _runs_engine_loop(frames.get(thread.ident))
                else thread.name for thread in threading.enumerate()}

    def _write_sums(path: str) -> None:
        while True:
            time.sleep(1.0)  # a benchmark's sampling pace
            _write(path, _sums)
            _write(path.removesuffix(".json") + ".threads.json", _thread_names())

    threading.Thread(target=_write_sums, daemon=True, name="reader-profile",
                     args=(os.path.join(os.environ["READER_PROFILE_DIR"], f"{os.getpid()}.json"),)).start()

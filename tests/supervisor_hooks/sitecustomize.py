"""Loaded at start-up by a supervisor a test starts with this folder on PYTHONPATH
(tests/test_supervisor.py): with ``GUARDIAN_TEST_LATE_RESUME_S`` set, the handler
thread that takes back a request the reader handed off (the child died with it or
gave it back) starts that many seconds late, as on a loaded machine. Nothing here
runs without that variable; the guardian's own code is not changed."""

import os

if os.environ.get("GUARDIAN_TEST_LATE_RESUME_S"):
    import threading

    import guardian.supervise.proxy as proxy

    _late_s = float(os.environ["GUARDIAN_TEST_LATE_RESUME_S"])
    _resumed_outcome = proxy.ProxyHandler.resumed_outcome

    def _late_resumed_outcome(handler, passed):
        threading.Event().wait(_late_s)
        return _resumed_outcome(handler, passed)

    proxy.ProxyHandler.resumed_outcome = _late_resumed_outcome

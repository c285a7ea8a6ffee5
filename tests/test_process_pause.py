"""A pause is not a stall; a step that computes or pages is not a stuck one.

Measured before this: a 5 s SIGSTOP then SIGCONT of a one-process server,
with one long request in flight, counted a stall and an engine restart and
left a parked loop thread; three such pauses a few seconds apart climbed the
whole ladder (restart, reload, exit 5), and the request in flight during the
third got a 503. A whole process pauses like that under swap storms, cgroup
freezes, VM pauses or a debugger; on an H200 it paused ~5 s while servers
started and CUDA kernels compiled, and both engines restarted needlessly.

Now the watchdog measures its own lateness (``process_paused``), and a step
past the stall limit whose engine threads compute, or whose process pages (reads
its memory back from disk, a page a fault), gets ``stall_busy_extra_s`` more,
while one that waits is a stall at the limit (faults planted inside stock's own
``BatchGenerator.next``: tests/plugins/stock_step_faults.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from conftest import chat_body, poll, stamp
from guardian.health.step_cpu import BUSY_CPU_SHARE, PAGING_FAULTS_PER_S, RUNNABLE_SHARE, StepCpu, ThreadsReading
from test_stall_detection import STEP_FAULTS, table

COMPLETIONS = "/v1/chat/completions"
PAUSE_S = 3.0
# Small limits for a fast test, which a 3 s pause exceeds (the incident's was
# 5 s): the floor, and the ceiling for what the pace cannot know.
WATCHDOG = dict(interval_s=0.05, stall_min_s=1.0, stall_timeout_s=2.0)


def post_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST in a thread; the dict gets ``response`` (or ``error``)."""
    result: dict = {}

    def send():
        try:
            with httpx.Client(timeout=120) as client:
                result["response"] = client.post(url, json=body)
        except httpx.TransportError as e:
            result["error"] = e

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, result


def in_flight(server) -> bool:
    try:
        return httpx.get(server.url + "/guardian/status", timeout=5).json()["in_flight"] >= 1
    except httpx.TransportError:
        return False


def pause(proc, seconds: float, interval: float = 0.1) -> None:
    """SIGSTOP the whole process for ``seconds``, then SIGCONT it."""
    proc.send_signal(signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        # Nothing to poll for but time itself: the process cannot answer meanwhile.
        poll(lambda: time.monotonic() - stopped_at >= seconds, seconds + 5, interval=interval, what="the pause")
    finally:
        proc.send_signal(signal.SIGCONT)


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP/SIGCONT are POSIX signals")
def test_three_pauses_of_the_whole_process_with_requests_in_flight_are_not_stalls(start_server):
    # Every stock step 0.1 s longer: a request of 20 tokens stays in flight ~2 s,
    # paused as soon as it is seen in flight, its steps going on after the pause.
    config = STEP_FAULTS + table("stock_step_faults", delay_s=0.1) + table("watchdog", **WATCHDOG)
    server = start_server(config)
    for round_ in range(1, 4):
        sender, result = post_in_background(server.url + COMPLETIONS, chat_body(max_tokens=20))
        poll(lambda: in_flight(server), 30, interval=0.05, what="the request in flight")
        pause(server.proc, PAUSE_S)
        sender.join(timeout=120)
        assert "response" in result, result
        assert result["response"].status_code == 200, result["response"].text
        assert result["response"].json()["usage"]["completion_tokens"] > 0
        paused = server.wait_for_event("process_paused", timeout=10, count=round_)
        assert paused[-1]["paused_s"] >= PAUSE_S - 0.5, paused[-1]
    assert server.proc.poll() is None, "the server exited"
    assert server.events("engine_stalled") == []
    status = httpx.get(server.url + "/guardian/status").json()
    assert status["restarts"] == 0 and status["stalls"] == 0, status
    assert status["abandoned_loop_threads"] == 0
    long_pauses = [e for e in server.events("process_paused") if e["paused_s"] >= PAUSE_S - 0.5]
    assert len(long_pauses) == 3
    assert status["process_pauses"] >= 3 and status["process_paused_s"] >= 3 * (PAUSE_S - 0.5), status
    metrics = httpx.get(server.url + "/metrics").text
    assert metric(metrics, "mlx_guardian_process_pauses_total") >= 3
    assert metric(metrics, "mlx_guardian_process_paused_seconds_total") >= 3 * (PAUSE_S - 0.5)
    assert metric(metrics, "mlx_guardian_engine_restarts_total") == 0
    assert metric(metrics, "mlx_guardian_engine_stalls_total") == 0


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP/SIGCONT are POSIX signals")
def test_pauses_shorter_than_the_stall_limit_are_not_stalls_either(start_server):
    """A pause just under the limit went unnoticed, and with the step it fell in went
    past it: three 2.8 s SIGSTOPs of a server of 0.5 s steps (limit 3 s) were three
    stalls, restart, reload and exit 5, the stream cut. Here the limit is 1 s (floor and
    ceiling; steps of 0.2 s), each pause 0.93 s, landing anywhere in a step: on the code
    before, most pauses went past the limit with their step."""
    watchdog = {**WATCHDOG, "stall_timeout_s": 1.0}
    config = STEP_FAULTS + table("stock_step_faults", delay_s=0.2) + table("watchdog", **watchdog)
    server = start_server(config)
    sender, result = post_in_background(server.url + COMPLETIONS, chat_body(max_tokens=60))
    poll(lambda: in_flight(server), 30, interval=0.05, what="the request in flight")
    for _ in range(3):
        steps = httpx.get(server.url + "/guardian/status", timeout=5).json()["steps"]
        poll(lambda: httpx.get(server.url + "/guardian/status", timeout=5).json()["steps"] >= steps + 2, 10,
             what="two steps between the pauses")
        pause(server.proc, 0.93, interval=0.01)
    sender.join(timeout=120)
    assert result["response"].status_code == 200, result["response"].text
    assert result["response"].json()["usage"]["completion_tokens"] == 60
    assert server.events("engine_stalled") == []
    status = httpx.get(server.url + "/guardian/status").json()
    assert status["stalls"] == 0 and status["restarts"] == 0, status


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP/SIGCONT are POSIX signals")
def test_a_pause_that_lands_inside_one_of_the_watchdogs_looks_is_still_a_pause(start_server):
    # Seen once in CI: the watchdog's look (here a resource sample that takes
    # 0.6 s) was under way when SIGSTOP came; the next look was reckoned from
    # the end of that one, so the 3 s pause vanished into it. Now the time a
    # look spent not running is lateness too.
    config = ('[guardian]\nplugins = ["tests.plugins.slow_sample:SlowSample"]\n'
              + table("slow_sample", hold_s=0.6) + table("watchdog", resource_interval_s=0.5, **WATCHDOG))
    server = start_server(config)
    samples = len(server.wait_for_event("slow_sample_started", timeout=30))
    # The next sample: the pause follows its log line at once, well inside its 0.6 s.
    server.wait_for_event("slow_sample_started", timeout=30, count=samples + 1)
    pause(server.proc, PAUSE_S)
    long_pauses = lambda: [e for e in server.events("process_paused") if e["paused_s"] >= PAUSE_S - 0.5]
    assert len(poll(long_pauses, 10, what="a process_paused of the whole pause")) == 1
    assert server.proc.poll() is None, "the server exited"


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="SIGSTOP/SIGCONT are POSIX signals")
@pytest.mark.one_version  # the guardian's watchdog, whatever stock's version: once, in the lane that ends first
@pytest.mark.lane_0313
def test_a_pause_while_a_replacement_loop_is_probed_is_no_second_stall(start_server):
    """A stall's replacement loop is on trial until a probe generates on it. The process
    paused past that probe's deadline: its thread woke to a timed-out probe before the
    watchdog had looked, and a failed trial is a second stall (the ladder climbed). Now
    the probe's thread waits for the watchdog's looks, which see the pause, and the loop
    is probed again. The request's step blocks once (loop_faults); every step takes 0.5 s,
    so the probe takes a second or more, and the pause comes once it is under way."""
    config = ('[guardian]\nplugins = ["tests.plugins.loop_faults:LoopFaults", '
              '"tests.plugins.stock_step_faults:StockStepFaults"]\n'
              + table("loop_faults", hang_repetition_penalty=1.25, hang_at_call=2, hang_times=1)
              + table("stock_step_faults", delay_s=0.5)
              + table("watchdog", interval_s=0.05, stall_min_s=1.0, stall_timeout_s=2.0, probe_timeout_s=2.5))
    server = start_server(config)
    sender, result = post_in_background(server.url + COMPLETIONS,
                                        chat_body(max_tokens=4, repetition_penalty=1.25))
    server.wait_for_event("engine_stalled", timeout=60)
    # The re-run and the replacement's probe both taken: the probe under way (a clean clone's
    # run paused before the probe had begun, and it passed after the pause).
    poll(lambda: httpx.get(server.url + "/guardian/status", timeout=5).json()["in_flight"] >= 2, 30,
         interval=0.01, what="the replacement's probe under way")
    pause(server.proc, PAUSE_S + 1.0)
    sender.join(timeout=120)
    assert result["response"].status_code == 200, result
    poll(lambda: server.status("/readyz") == 200, 30, what="the replacement loop proven")
    assert len(server.events("engine_stalled")) == 1
    [paused_probe] = server.events("replacement_probe_paused")
    assert paused_probe["paused_s"] >= PAUSE_S and paused_probe["ran_s"] < 2.5, paused_probe
    assert [e for e in server.events("process_paused") if e["paused_s"] >= PAUSE_S]


HOG = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"


@contextlib.contextmanager
def starved(pid: int, hogs: int = 2):
    """Every thread of process ``pid`` pinned at nice 19 to one core that ``hogs`` processes
    burn at nice 0 (a machine too busy to run it on time): its threads wait in the run
    queue, and are not stopped. Its threads' affinity and priority are given back after."""
    tasks = lambda: [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    cores = os.sched_getaffinity(pid)
    core = min(cores)
    burners = [subprocess.Popen([sys.executable, "-c", HOG, str(core)]) for _ in range(hogs)]
    try:
        for tid in tasks():  # threads started meanwhile (a replacement loop) inherit both
            os.sched_setaffinity(tid, {core})
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        for tid in tasks():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cores)
                os.setpriority(os.PRIO_PROCESS, tid, 0)


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                    reason="threads' waits for a core are read from Linux's schedstat, and the test "
                           "pins the server to a core (not macOS)")
def test_a_stuck_step_on_a_machine_too_busy_to_run_the_watchdog_on_time_is_a_stall_not_a_pause(start_server):
    """A loaded machine makes the watchdog's looks late, and lateness the process did not
    spend on the CPU was taken for a pause: taken off the stuck step's heartbeat age (or,
    past the floor, restarting its clock), its stall came up to a stall limit late. Here
    stock's own step blocks for good, then the whole server waits for a core at nice 19
    beside two busy processes: the wait is no pause (at most half the limit is taken off
    the age; on the code before, 1.0 s was, the whole limit), the stall comes at the limit,
    and the replacement loop serves the request."""
    config = (STEP_FAULTS + table("stock_step_faults", hang_at_call=20)
              + table("watchdog", **WATCHDOG))
    server = start_server(config)
    sender, result = post_in_background(server.url + COMPLETIONS, chat_body(max_tokens=40))
    [hang] = server.wait_for_event("stock_step_hang", timeout=60)
    with starved(server.proc.pid):
        [stalled] = server.wait_for_event("engine_stalled", timeout=60)
    print(f"\nmeasured: stalled {stamp(stalled) - stamp(hang):.2f} s after stock's step blocked, at a "
          f"heartbeat age of {stalled['heartbeat_age_s']} s, {stalled['paused_credit_s']} s taken for pauses")
    # The longest one thread's wait is what is taken off (guardian.health.run_queue): a look
    # late behind a chain of waits (the GIL's holder's, then its own) may keep a part of it
    # as a pause (0.19 s in a clean clone's run), never the whole limit as before (1.0 s).
    assert stalled["paused_credit_s"] <= 0.5, stalled
    assert server.events("process_paused") == []
    assert stalled["action"] == "restart", stalled
    sender.join(timeout=120)
    assert result["response"].status_code == 200, result
    assert result["response"].json()["usage"]["completion_tokens"] > 0


BUSY_S = 3.0  # past the 2 s ceiling and the 1 s floor, well within 2 s + the allowance
ALLOWANCE_S = 10.0


def pages_fault_here() -> bool:
    """Whether a page of a file in the temporary folder, evicted, is read back from disk
    with a major fault (not on a tmpfs; posix_fadvise: not on macOS)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    with tempfile.TemporaryFile() as file:
        file.write(b"\1" * mmap.PAGESIZE)
        file.flush()
        os.fsync(file.fileno())
        with mmap.mmap(file.fileno(), mmap.PAGESIZE, prot=mmap.PROT_READ) as page:
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            page[0]
            return resource.getrusage(resource.RUSAGE_SELF).ru_majflt > before


FAULTS = {"computes": dict(busy_at_call=20, busy_s=BUSY_S),
          "computes on a busy core": dict(busy_at_call=20, busy_s=BUSY_S, busy_starved=True),
          "pages": dict(page_at_call=20, page_s=BUSY_S), "waits": dict(hang_at_call=20, hang_s=BUSY_S)}


@pytest.mark.parametrize("step", FAULTS)
def test_a_step_past_the_stall_limit_is_a_stall_only_if_it_waits(start_server, step):
    if step.startswith("computes") and not StepCpu().reads_threads:
        pytest.skip("the engine's threads' own CPU times are not read here (no /proc: macOS): "
                    "a step that computes is judged by the limit")
    if step == "pages" and not pages_fault_here():
        pytest.skip("an evicted page of a file in the temporary folder is no major fault here "
                    "(no posix_fadvise, or a tmpfs): the step could not page")
    # Stock's own step, at its 20th call (a request's decode), computes (on a core of its
    # own, or on one a process of higher priority burns: ~1-2% of it, as on a loaded
    # machine), pages (reads pages from disk at ~150 major faults a second, with little
    # CPU: its memory swapped out) or waits for 3 s, with a stall limit of 1-2 s and 10 s
    # more for a step that computes or pages. On the code before paging counted, the
    # paging step was a stall; before waits for a core counted, the starved one was.
    fault = FAULTS[step]
    config = (STEP_FAULTS + table("stock_step_faults", **fault)
              + table("watchdog", stall_busy_extra_s=ALLOWANCE_S, **WATCHDOG))
    server = start_server(config)
    with httpx.Client(timeout=120) as client:
        response = client.post(server.url + COMPLETIONS, json=chat_body(max_tokens=40))
    assert response.status_code == 200, response.text
    if step.startswith("computes"):
        server.wait_for_event("stock_step_busy_ended", timeout=10)
        assert server.events("engine_stalled") == []
        [busy] = server.events("engine_step_busy")
        assert busy["how"] == "computing", busy
        assert busy["heartbeat_age_s"] < BUSY_S, busy
        if step == "computes on a busy core":  # its CPU time alone would not have told it
            assert busy["cpu_share"] < BUSY_CPU_SHARE and busy["runnable_share"] >= RUNNABLE_SHARE, busy
        assert httpx.get(server.url + "/guardian/status").json()["restarts"] == 0
    elif step == "pages":
        [paged] = server.wait_for_event("stock_step_paging_ended", timeout=10)
        assert paged["major_faults"] >= PAGING_FAULTS_PER_S * BUSY_S, paged
        assert server.events("engine_stalled") == []
        [busy] = server.events("engine_step_busy")
        print(f"\nmeasured: the paging step, {busy['major_faults_per_s']} major faults a second at "
              f"{busy['cpu_share']} of a core")
        assert busy["how"] == "paging" and busy["major_faults_per_s"] >= PAGING_FAULTS_PER_S, busy
        assert busy["heartbeat_age_s"] < BUSY_S, busy
        if busy["cpu_share"] is not None:  # little CPU: the CPU alone would not have told it
            assert busy["cpu_share"] < BUSY_CPU_SHARE, busy
        assert httpx.get(server.url + "/guardian/status").json()["restarts"] == 0
    else:
        [stalled] = server.wait_for_event("engine_stalled", timeout=10)
        assert stalled["heartbeat_age_s"] < BUSY_S, stalled  # at the limit, before the step returned
        assert server.events("engine_step_busy") == []
        if StepCpu().reads_threads:
            assert "of a core" in stalled["reason"], stalled


def test_a_stuck_step_beside_an_abandoned_loop_that_pages_is_a_stall_at_the_limit(start_server):
    """A step that pages past its allowance is a stall; its loop is abandoned and pages on
    (its step goes on). The next step, stuck in a wait, is judged by its own threads: a
    stall at the limit. The whole process's faults made it "paging" too, a stall only at
    the limit and the allowance (a hunt: 14 s where the limit was 4)."""
    if not pages_fault_here():
        pytest.skip("an evicted page of a file in the temporary folder is no major fault here "
                    "(no posix_fadvise, or a tmpfs): the step could not page")
    if not StepCpu().reads_threads:
        pytest.skip("the engine's threads are not read apart here (macOS): paging is the whole "
                    "process's, and not believed while an abandoned loop lives")
    allowance_s = 5.0
    config = (STEP_FAULTS + table("stock_step_faults", page_at_call=20, page_s=60.0, hang_at_call=60, hang_s=60.0)
              + table("watchdog", stall_busy_extra_s=allowance_s, **WATCHDOG))
    server = start_server(config)
    post_in_background(server.url + COMPLETIONS, chat_body(max_tokens=300))
    paged, stuck = server.wait_for_event("engine_stalled", timeout=60, count=2)
    assert paged["reason"].startswith("a step paging past its allowance"), paged
    server.wait_for_event("stock_step_hang", timeout=10)  # the second stall is the stuck step's
    assert stuck["reason"].startswith("no engine step or prompt progress"), stuck
    assert stuck["heartbeat_age_s"] < WATCHDOG["stall_timeout_s"] + allowance_s / 2, stuck
    busy = server.events("engine_step_busy")
    assert [e["how"] for e in busy] == ["paging"], busy  # the first step's, not the stuck one's


def test_paging_is_not_believed_while_an_abandoned_loop_is_still_in_its_step():
    """A loop a stall abandoned may go on working in its step, on mlx's threads (which it
    shares with the live loop) and, where only the whole process is read (macOS), anywhere:
    its faults would make a stuck step beside it "paging". A loop that left its step and
    parked runs nothing more: paging is believed again (parked loops never end, so counting
    them turned it off for good). The watchdog's judgement, with stand-ins for the engine
    and the fault counts."""
    import pluggy

    from guardian import hookspecs
    from guardian.config.tables import WatchdogSettings
    from guardian.health.stall_detection import StallDetector

    engine = SimpleNamespace(steps_wait_busily=False, abandoned_loops_in_a_step=0)
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for reads_threads in (True, False):
        faults = iter(range(0, 10_000, 50))  # 50 major faults a reading, 5 readings a second
        detector = StallDetector(engine, pm, WatchdogSettings())
        if reads_threads:  # Linux's reading of the engine's threads: CPU idle, faults climbing
            detector.step_cpu = StepCpu(reader=lambda loop_ident: ThreadsReading(0.0, False, next(faults)))
        else:  # macOS's: no thread's own figures, the whole process's faults
            detector.step_cpu = StepCpu(process_faults=lambda: next(faults))
            detector.step_cpu.reader = None
        for look in range(6):
            detector.step_cpu.observe(beat=1.0, now=10.0 + look * 0.2, loop_ident=threading.get_ident())
        assert detector.step_cpu.faults_per_s >= PAGING_FAULTS_PER_S and not detector.step_cpu.computing()
        engine.abandoned_loops_in_a_step = 0
        assert detector._step_moves() == "paging"
        engine.abandoned_loops_in_a_step = 1
        assert detector._step_moves() is None


def test_a_heartbeat_already_still_at_its_first_look_is_read_at_that_look():
    """A look that comes late (a loaded machine) to a heartbeat already still reads the
    engine's threads at once: half a second later the step is measured. Before, that first
    look only noted the beat and the window began a look later: a starved step, its looks
    late, was called a stall at 1.04 s of a 1 s limit with nothing read. A heartbeat that
    moves between looks is never read (the cost a reading per look would add)."""
    readings = []

    def reader(loop_ident):
        readings.append(loop_ident)
        return ThreadsReading(0.0, True, 0)  # starved: no CPU, ready to run at every look

    step_cpu, loop = StepCpu(reader=reader), threading.get_ident()
    for look in range(5):  # a heartbeat that moves: each look finds a new one, 50 ms old
        step_cpu.observe(beat=10.0 + look * 0.25, now=10.05 + look * 0.25, loop_ident=loop)
    assert readings == [] and step_cpu.runnable_share is None
    # A still beat first seen 0.45 s old, then looks 0.25 s apart, as late ones come.
    for look in range(3):
        step_cpu.observe(beat=20.0, now=20.45 + look * 0.25, loop_ident=loop)
    assert len(readings) == 3
    assert step_cpu.runnable_share == 1.0 and step_cpu.computing()  # at 0.95 s: measured

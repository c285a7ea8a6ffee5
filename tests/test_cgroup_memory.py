"""A control group's memory limit is the memory the guard measures against (Linux, the CPU).

The kernel ends a process whose group reaches its limit (systemd's ``MemoryMax=``,
a container's limit): SIGKILL, no exception to recover from. mlx's CPU backend
knows only the machine's memory, so the memory guard's thresholds and the KV
budget were fractions of memory the process could never have. Here a server
runs in a memory group of its own (cgroup v1's memory controller, or v2, as root),
and its thresholds and KV budget come from that group's limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from conftest import REPO, Server, chat_body, free_port, poll
from test_supervisor import KILLED_BY_ANOTHER_PROCESS, post_in_thread
from guardian.admission.cgroup_memory import V1_MEMORY_ROOT, V2_ROOT, cgroup_memory_limit, group_paths
from guardian.supervise.child import Child, exit_reason
from guardian.supervise.oom_kills import dying, killed_for_memory, note_memory_group, oom_kills_in

LIMIT_BYTES = 3 << 30  # far above what the demo model's server needs, far below this machine's memory


def swap_in_use() -> bool:
    try:
        with open("/proc/swaps") as swaps:
            return len(swaps.read().splitlines()) > 1  # a header, then a line a device
    except OSError:
        return False


def make_group(name: str, limit_bytes: int = LIMIT_BYTES) -> Path:
    """A memory group of this process's, limited to ``limit_bytes`` (swap too, where there
    is swap: else a process past the limit swaps instead of being killed). Skips where none
    can be made (not Linux, not root, no memory controller here)."""
    v2, v1 = group_paths()
    tries = []
    if v1 is not None:
        tries.append((Path(V1_MEMORY_ROOT, v1.lstrip("/"), name), "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
    if v2 is not None and os.path.exists(os.path.join(V2_ROOT, "cgroup.controllers")):
        tries.append((Path(V2_ROOT, v2.lstrip("/"), name), "memory.max", "memory.swap.max"))
    why = "no memory controller of this process's to make a group under (not Linux?)"
    for folder, limit_file, swap_file in tries:
        try:
            folder.mkdir()
        except OSError as e:
            why = f"cannot make a memory group at {folder}: {e}"
            continue
        try:
            (folder / limit_file).write_text(str(limit_bytes))
            if (folder / swap_file).exists():
                (folder / swap_file).write_text(str(limit_bytes) if swap_file.endswith("memsw.limit_in_bytes") else "0")
            elif swap_in_use():
                raise OSError("swap is in use and its use cannot be limited here")
            return folder
        except OSError as e:
            why = f"cannot limit the memory group at {folder}: {e}"
            folder.rmdir()
    pytest.skip(why)


def remove_group(folder: Path) -> None:
    """Remove a group made here, any process still in it moved back to its parent first
    (a group with a process in it cannot be removed)."""
    procs = folder / "cgroup.procs"
    for pid in procs.read_text().split():
        try:
            (folder.parent / "cgroup.procs").write_text(pid)
        except OSError:  # gone meanwhile
            pass
    poll(lambda: not procs.read_text().split(), 10, what="the group emptied")
    folder.rmdir()


@pytest.fixture
def memory_group():
    """A memory group of this process's, limited to LIMIT_BYTES, made before anything starts:
    where none can be, the test skips first."""
    existing = cgroup_memory_limit()
    if existing is not None and existing[0] <= LIMIT_BYTES:
        pytest.skip(f"this process's group is limited already, to {existing[0]} bytes ({existing[1]})")
    folder = make_group(f"guardian-test-{os.getpid()}")
    yield folder
    remove_group(folder)


def test_a_servers_memory_guard_and_kv_budget_measure_against_its_groups_limit(tmp_path, model_cache, memory_group):
    folder = memory_group
    port = free_port()
    config = tmp_path / "guardian.toml"
    config.write_text(textwrap.dedent(""))
    log_path = tmp_path / "server.log"
    procs = folder / "cgroup.procs"
    # Into the group before it runs anything, by the shell it execs from: all it allocates
    # is counted there.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), sys.executable, "-m",
                                 "guardian", "--port", str(port), "--guardian-config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "MLX_GUARDIAN_CACHE": str(model_cache)})
    server = Server(proc, port, log_path)
    try:
        server.wait_healthy()
        assert str(proc.pid) in procs.read_text().split()
        [thresholds] = server.events("memory_thresholds")
        assert thresholds["device_memory_bytes"] == LIMIT_BYTES, thresholds
        limit_file = "memory.limit_in_bytes" if str(folder).startswith(V1_MEMORY_ROOT) else "memory.max"
        assert thresholds["device_memory_source"] == f"cgroup {folder / limit_file}", thresholds
        assert thresholds["refuse_above_bytes"] == int(0.95 * LIMIT_BYTES), thresholds
        [guard] = server.events("prompt_guard_ready")
        assert guard["kv_budget_bytes"] < LIMIT_BYTES, guard  # a share of the group's, not the machine's
        response = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=60)
        assert response.status_code == 200, response.text
    finally:
        server.stop()


# Room the group leaves above what it holds once the child is ready and idle: a child's next
# requests (three, each past 256 tokens, when the KV cache grows by a block) overflow it, and
# the kernel's OOM killer ends the biggest process in the group, the child (no swap here;
# with swap, its use is limited too).
ROOM_BYTES = 4 << 20


def usage_file(group: Path) -> Path:
    return group / ("memory.usage_in_bytes" if str(group).startswith(V1_MEMORY_ROOT) else "memory.current")


def limit_file(group: Path) -> Path:
    return group / ("memory.limit_in_bytes" if str(group).startswith(V1_MEMORY_ROOT) else "memory.max")


@pytest.mark.subprocess_mode
def test_a_child_the_kernels_oom_killer_ends_blames_no_request_in_flight(tmp_path, model_cache, memory_group):
    """A supervisor and its children in one memory group whose limit leaves little room (a
    service under systemd's MemoryMax=): two children killed by the kernel with the same
    requests in flight. Struck at each kill as at a crash, and run alone on the second
    child, they were quarantined (500, and refused for quarantine_s) though each fits, as
    requests that each fitted alone were in a hunt (memory grown over many requests). Now
    the kill is told (the group's count of OOM kills rose) and blames nobody: the requests
    get what a restart gives them, and the same bodies sent again are answered."""
    from test_supervisor import Supervised

    group = memory_group  # a whole service's, as systemd's unit is: the supervisor and its children
    config = tmp_path / "slow.toml"
    config.write_text("[fault_injection]\nenabled = true\nstep_delay_s = 0.01\n")  # decoding for seconds
    port = free_port()
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"),
                                 sys.executable, "-m", "guardian", "--supervise", "--port", str(port),
                                 "--guardian-config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, "MLX_GUARDIAN_CACHE": str(model_cache)})
    supervised = Supervised(proc, port, log_path)
    try:
        pid = supervised.wait_ready(timeout=60)
        counter = supervised.supervisor()["child"]["oom_counter"]
        assert counter is not None and counter.startswith(str(group)), counter
        # Past 256 tokens the KV cache grows by a block while they decode.
        bodies = [chat_body(f"Tell me a long story, number {n}, about the sea.", max_tokens=700) for n in range(3)]
        results: list = []
        for kill in range(2):
            pid = supervised.wait_ready(not_pid=pid if kill else 0, timeout=60)
            limit_file(group).write_text(str(int(usage_file(group).read_text()) + ROOM_BYTES))
            if kill == 0:
                threads = [post_in_thread(supervised.url, body, results) for body in bodies]
            # (The second child got them sent again as it was ready: they decode on it now.)
            [exited] = poll(lambda: supervised.supervisor_events("child_exited")[kill:], 60,
                            what="the child killed for memory")
            limit_file(group).write_text(str(LIMIT_BYTES))  # room again, for the next child's start
            assert exited["pid"] == pid, exited
            assert exited["reason"] == "killed by SIGKILL: the kernel's OOM killer (out of memory)", exited
        supervised.wait_ready(not_pid=pid, timeout=60)
        for thread in threads:
            thread.join(timeout=120)
        codes = [repr(outcome) if isinstance(outcome, Exception)
                 else 200 if outcome.status_code == 200 else outcome.json()["error"]["code"] for outcome, _ in results]
        assert "request_quarantined" not in codes, codes
        not_blamed = supervised.supervisor_events("crash_not_blamed")
        assert len(not_blamed) == 2 and not_blamed[0]["in_flight"] == 3, not_blamed
        assert not supervised.supervisor_events("crash_suspects")
        quarantine = supervised.supervisor()["quarantine"]
        assert quarantine["quarantined"] == [] and quarantine["refused"] == 0, quarantine
        # Sent again (as Retry-After says), each is answered: nothing of theirs is held against them.
        again: list = []
        for thread in [post_in_thread(supervised.url, body, again) for body in bodies]:
            thread.join(timeout=120)
        assert [outcome.status_code for outcome, _ in again] == [200] * 3, again
        metrics = httpx.get(supervised.url + "/metrics", timeout=10).text
        assert 'mlx_guardian_supervisor_child_restarts_total{reason="oom_killed"} 2.0' in metrics
    finally:
        supervised.stop()


@pytest.fixture
def freezer_group():
    """A group of cgroup v1's freezer, of this process's: a task frozen there keeps a SIGKILL
    pending until it is thawed, an exit held open (v2's freezer lets SIGKILL through)."""
    try:
        with open("/proc/self/cgroup") as groups:
            path = next(line.rstrip("\n").split(":", 2)[2] for line in groups if line.split(":")[1] == "freezer")
    except (OSError, StopIteration, IndexError):
        pytest.skip("no cgroup v1 freezer here (cgroup v2 only, or not Linux)")
    folder = Path("/sys/fs/cgroup/freezer", path.lstrip("/"), f"guardian-test-{os.getpid()}")
    try:
        folder.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a freezer group at {folder}: {e}")
    yield folder
    (folder / "freezer.state").write_text("THAWED")
    remove_group(folder)


def oom_kill_one(group: Path) -> None:
    """A process that the kernel's OOM killer ends in ``group``: one kill more in its count."""
    limit_file(group).write_text(str(int(usage_file(group).read_text()) + (32 << 20)))
    try:
        hog = subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"),
                              sys.executable, "-c", "hog = b'x' * (512 << 20)"], timeout=60)
    finally:
        limit_file(group).write_text(str(LIMIT_BYTES))
    assert hog.returncode == -signal.SIGKILL, hog


def test_a_check_while_the_child_is_being_killed_keeps_its_oom_kill(memory_group, freezer_group):
    """The kernel counts an OOM kill just before it sends its SIGKILL, and the child is reaped
    only once its exit is done. A CI run's health check landed between: it took the group's
    count afresh, and the child's own kill was "perhaps out of memory?", a crash. Here the
    child's exit is held open (frozen, SIGKILL pending) while the group's count rises by a
    real OOM kill: the checks keep the count as it was, and the kill is told as the child
    is reaped. A rise the child lives through (another process's kill, found at two checks)
    is taken, as before: a kill -9 after it is no OOM kill."""
    child_proc = subprocess.Popen(["sleep", "600"])
    try:
        (memory_group / "cgroup.procs").write_text(str(child_proc.pid))
        (freezer_group / "cgroup.procs").write_text(str(child_proc.pid))
        child = Child(child_proc, port=0, generation=1, stock=False, client=None)
        note_memory_group(child)  # at its start
        assert child.oom_counter and child.oom_counter.startswith(str(memory_group)), child.oom_counter
        assert child.oom_kills_seen == 0, child.oom_kills_seen

        oom_kill_one(memory_group)  # another process's, the child living on
        note_memory_group(child)
        assert child.oom_kills_seen == 0  # one check could fall in a kill's first moment
        note_memory_group(child)
        assert child.oom_kills_seen == 1  # the next finds the child outlived it

        (freezer_group / "freezer.state").write_text("FROZEN")
        poll(lambda: (freezer_group / "freezer.state").read_text().strip() == "FROZEN", 10, what="the child frozen")
        child_proc.send_signal(signal.SIGKILL)
        poll(lambda: dying(child_proc.pid), 10, what="the SIGKILL pending")
        oom_kill_one(memory_group)  # standing for the child's own, counted before its exit is done
        for _ in range(3):
            note_memory_group(child)
        assert child.oom_kills_seen == 1 and child_proc.poll() is None, (child.oom_kills_seen, child_proc.returncode)

        (freezer_group / "freezer.state").write_text("THAWED")
        assert child_proc.wait(timeout=30) == -signal.SIGKILL
        child.out_of_memory = killed_for_memory(child)
        assert exit_reason(child) == "killed by SIGKILL: the kernel's OOM killer (out of memory)"
    finally:
        (freezer_group / "freezer.state").write_text("THAWED")
        child_proc.kill()
        child_proc.wait(timeout=30)


def test_a_sigkill_is_told_by_its_groups_count_where_one_is_kept(tmp_path):
    """A SIGKILL's reason: the OOM killer's where the child's memory group counted a kill more,
    another process's where it counted none, and maybe the OOM killer's where no count is
    kept (macOS, a group without one). A real process, killed; the count a file of the
    kernel's format (cgroup v1's ``memory.oom_control``), so this runs anywhere."""
    counter = tmp_path / "memory.oom_control"
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    killed = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # until killed
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL

    def reason(counted_before: "int | None") -> str:
        child = Child(killed, port=0, generation=1, stock=False, client=None)
        child.oom_counter, child.oom_kills_seen = str(counter), counted_before
        child.out_of_memory = killed_for_memory(child)
        return exit_reason(child)

    assert oom_kills_in(str(counter)) == 3
    assert reason(2) == "killed by SIGKILL: the kernel's OOM killer (out of memory)"
    assert reason(3) == KILLED_BY_ANOTHER_PROCESS
    assert reason(None) == "killed by SIGKILL: perhaps out of memory?"  # no count was read at its start
    counter.unlink()  # a count that can no longer be read says nothing either
    assert reason(3) == "killed by SIGKILL: perhaps out of memory?"

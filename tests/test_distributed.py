"""mlx-guardian under mlx.launch: two ranks on localhost, the ring backend, the CPU.

Stock serves a group on both mlx-lm versions (rank 0 serves HTTP and
broadcasts each request to the others), so a group's serving and its end
at a failure are tested on both; what does not depend on mlx-lm's version
(a stopped rank, the supervised group) on the newest only. Every group is launched in a session of its own, so cleanup
kills the launcher and every rank even when a test fails, and each test
checks by pid that no rank outlived its group.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import httpx
import psutil
import pytest

from conftest import REPO, Server, SessionServer, chat_body, free_port, pace, poll, read_stream
from guardian.exit_codes import EXIT_BOOT_ERROR, EXIT_GROUP_FAILED, EXIT_OK

COMPLETIONS = "/v1/chat/completions"
LAUNCHER = str(Path(sys.executable).with_name("mlx.launch"))
# A client must have its answer this soon after a rank failed or died.
ANSWER_BOUND_S = 10.0
# Long generations, so the burst is surely in flight when a rank fails.
BURST = [chat_body("Tell me a story.", max_tokens=3000, stream=stream) for stream in (False, False, True, True)]
# Under --supervise the burst is sent again to the next group: short enough to finish there
# (at 0.05 s a step, 3.2 s), and long enough that all four overlap on a loaded machine
# (at 32 tokens a clean-clone CI run once waited 30 s in vain for all four in flight together).
MAX_TOKENS = 64


def free_ring_port() -> int:
    """The first of two consecutive free ports for the ring's ranks, below the
    ephemeral range: a client's connection elsewhere cannot take one meanwhile
    (the ranks bind them after they start, and again in a replacement group)."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20000, 32000)
        try:
            for candidate in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise AssertionError("no two consecutive free ports")


def rank_pids(marker: str) -> dict[int, int]:
    """{rank: pid} of the live ranks whose environment carries ``marker``."""
    ranks = {}
    for process in psutil.process_iter():
        try:
            environ = process.environ()
            if environ.get("GROUP_TEST") != marker or process.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        if "MLX_RANK" in environ:
            ranks[int(environ["MLX_RANK"])] = process.pid
    return ranks


# Rank 0's door is the one-process server's: the first test gives the group a
# key file. A key sent to a server without keys is ignored.
GROUP_KEY = "sk-group-0123456789"
WITH_KEY = {"Authorization": f"Bearer {GROUP_KEY}"}


def answer(url: str, body: dict) -> dict:
    """One client: its status (and error or error event), and when its answer ended."""
    with httpx.Client(timeout=60, headers=WITH_KEY) as client:
        if body["stream"]:
            result = read_stream(client, url, body)
        else:
            response = client.post(url, json=body)
            result = {"status": response.status_code, "body": response.json(),
                      "retry_after": response.headers.get("retry-after")}
    result["ended"] = time.monotonic()
    return result


def engine_steps(server: Server) -> int:
    """Rank 0's engine steps so far (its /guardian/status)."""
    return httpx.get(server.url + "/guardian/status", headers=WITH_KEY, timeout=5).json()["steps"]


def generating(server: Server, steps_before: int, requests: int = len(BURST)) -> bool:
    """The burst is being generated: the failure comes mid-burst."""
    try:
        status = httpx.get(server.url + "/guardian/status", headers=WITH_KEY, timeout=5).json()
    except httpx.TransportError:
        return False
    # Every request of the burst taken by the loop: none still on its way in
    # when the group goes (its connection would be reset by the exit).
    return status["in_flight"] >= requests and status["steps"] > steps_before + 3


class Group(SessionServer):
    """An mlx.launch group (or a supervisor running one), in a session of its own."""

    def __init__(self, proc, port, log_path, marker):
        super().__init__(proc, port, log_path)
        self.marker = marker

    def ranks(self) -> dict[int, int]:
        return rank_pids(self.marker)

    def logs(self) -> list[dict]:
        """As a server's. mlx.launch writes its own lines ("[WARN] Node with rank 1
        exited ...") to the same output, and a rank's JSON line once landed right
        after such a line's colour prefix: the JSON is read from where it starts."""
        lines = []
        for line in super().logs():
            text = line.get("line", "")
            if line.get("event") == "non_json_line" and "{" in text:
                try:
                    line = json.loads(text[text.index("{"):])
                except json.JSONDecodeError:
                    pass
            lines.append(line)
        return lines

    def rank_events(self, name: str, rank: int) -> list[dict]:
        return [e for e in self.events(name) if e.get("rank") == rank]

    def stop(self) -> None:
        super().stop()
        # A supervised group's launcher leads a session of its own: its ranks too.
        for pid in self.ranks().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def launch(tmp_path, model_cache):
    groups: list[Group] = []

    def start(command: list[str], config: Optional[str] = "") -> Group:
        """``config``: the file's text; None, no file (no ``--guardian-config``)."""
        port = free_port()
        config_path = tmp_path / f"guardian-{port}.toml"
        config_path.write_text(config or "")
        log_path = tmp_path / f"group-{port}.log"
        marker = uuid.uuid4().hex
        # mlx.launch leaves each rank's pid file and host file (``mktemp``) in TMPDIR: here, in
        # the test's folder, not four files a group in /tmp. mlx keeps its CPU kernels in
        # TMPDIR too (mlx/VERSION/cpu): shared, or each rank compiles them again (~3 s).
        launch_tmp = tmp_path / f"tmp-{port}"
        launch_tmp.mkdir()
        kernels = Path(tempfile.gettempdir()) / "mlx"
        kernels.mkdir(exist_ok=True)
        (launch_tmp / "mlx").symlink_to(kernels, target_is_directory=True)
        env = {**os.environ, "MLX_GUARDIAN_CACHE": str(model_cache), "GROUP_TEST": marker, "TMPDIR": str(launch_tmp)}
        with open(log_path, "w") as log_file:
            config_flags = ["--guardian-config", str(config_path)] if config is not None else []
            proc = subprocess.Popen([*command, "--port", str(port), *config_flags],
                                    stdout=log_file, stderr=subprocess.STDOUT,
                                    # As a terminal's: input that never comes. At /dev/null's end,
                                    # mlx.launch's loop that passes its input on spun a core.
                                    stdin=subprocess.PIPE if command[0] == LAUNCHER else subprocess.DEVNULL,
                                    env=env, cwd=REPO, start_new_session=True)
        group = Group(proc, port, log_path, marker)
        group.config_path = config_path
        group.temp_folder = launch_tmp
        groups.append(group)
        return group

    yield start
    for group in groups:
        group.stop()
        if group.proc.stdin is not None:
            group.proc.stdin.close()


def ring_group(ring_port: int) -> list[str]:
    """mlx.launch with two ranks of mlx-guardian on 127.0.0.1."""
    return [LAUNCHER, "--backend", "ring", "-n", "2", "--starting-port", str(ring_port),
            "--python", sys.executable, "--", "-m", "guardian"]


def test_rank_0_serves_and_a_failure_on_rank_1_ends_the_group_with_503s(launch, tmp_path):
    arm = tmp_path / "arm"
    keys = tmp_path / "keys.txt"
    keys.write_text(f"group:{GROUP_KEY}\n")
    group = launch(ring_group(free_ring_port()), config=(
        '[guardian]\nplugins = ["tests.plugins.rank_faults:RankFaults"]\n'
        f'[rank_faults]\nrank = 1\narm_file = "{arm}"\n[access]\napi_key_file = "{keys}"\n'))
    group.wait_healthy()
    ranks = group.ranks()
    assert sorted(ranks) == [0, 1]

    # Rank 0 serves, as in stock, behind the same door as one process; rank 1 follows its broadcast.
    assert httpx.post(group.url + COMPLETIONS, json=chat_body(max_tokens=8), timeout=60).status_code == 401
    response = httpx.post(group.url + COMPLETIONS, json=chat_body(max_tokens=8), headers=WITH_KEY, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert [e["rank"] for e in group.events("server_started")] == [0]
    assert group.events("server_started")[0]["access"] == "api_keys"
    assert [e["rank"] for e in group.events("rank_started")] == [1]
    assert {e["rank"] for e in group.events("group_joined")} == {0, 1}
    # The group as rank 0 sees it: its status and its metrics name rank 1, and when it was heard.
    seen = httpx.get(group.url + "/guardian/status", headers=WITH_KEY, timeout=10).json()["group"]
    assert (seen["rank"], seen["size"], seen["stopping"], seen["lost"]) == (0, 2, False, None)
    [peer] = seen["peers"]
    assert peer["rank"] == 1 and peer["pid"] == ranks[1] and not peer["gone"]
    assert peer["last_heard_s"] < seen["peer_timeout_s"]
    metrics = httpx.get(group.url + "/metrics", headers=WITH_KEY, timeout=10).text
    assert "mlx_guardian_group_ranks 2.0" in metrics
    assert 'mlx_guardian_group_peer_last_heard_seconds{rank="1"}' in metrics
    guardian_lines = [e for e in group.logs() if "event" in e and "logger" in e]
    assert guardian_lines and all("rank" in e for e in guardian_lines)

    # A failure planted in rank 1's step, mid-burst.
    steps = engine_steps(group)
    with ThreadPoolExecutor(len(BURST)) as pool:
        clients = [pool.submit(answer, group.url + COMPLETIONS, body) for body in BURST]
        poll(lambda: generating(group, steps), 30, what="the burst generating")
        arm.touch()
        armed_at = time.monotonic()
        results = [c.result(timeout=60) for c in clients]

    for result in results:
        assert result["ended"] - armed_at < ANSWER_BOUND_S, result
        if result["status"] == 200:  # a stream that had begun: an error event ends it
            assert result["errors"] and result["errors"][0]["code"] == "engine_failed", result
        else:
            assert result["status"] == 503, result
            assert result["body"]["error"]["code"] == "engine_failed"
            assert "rank 1 failed" in result["body"]["error"]["message"]
            assert result["retry_after"] is not None

    # The whole group exits with the group's code; no rank outlives it.
    poll(lambda: group.proc.poll() is not None, ANSWER_BOUND_S, what="the launcher's exit")
    print(f"rank 1 failed: clients answered within {max(r['ended'] for r in results) - armed_at:.3f} s, "
          f"the group gone within {time.monotonic() - armed_at:.3f} s")
    assert group.ranks() == {}
    assert [e["exit_code"] for e in group.rank_events("server_stopped", 0)] == [EXIT_GROUP_FAILED]
    assert [e["exit_code"] for e in group.rank_events("rank_stopped", 1)] == [EXIT_GROUP_FAILED]
    assert group.rank_events("group_rank_lost", 0)[0]["lost_rank"] == 1


@pytest.mark.one_version
def test_a_stopped_rank_is_lost_and_killed_so_the_group_ends(launch):
    """A rank that cannot act (SIGSTOP; or wedged with the interpreter held) stops
    sending beats: rank 0 loses it after peer_timeout_s, exits with code 7, and
    kills it, or the launcher would wait for it for ever."""
    # 6 s: a loaded machine starved a rank's beats for 1 s as the group started (CI: rank 0
    # "sent nothing for 1 s", and the group ended before it served), and for 3 s beside 4
    # busy processes (rank 1, just after it joined).
    group = launch(ring_group(free_ring_port()), config="[watchdog]\npeer_timeout_s = 6.0\n")
    group.wait_healthy()
    ranks = group.ranks()
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    poll(lambda: group.proc.poll() is not None, 20, what="the launcher's exit")
    print(f"rank 1 stopped: the group gone within {time.monotonic() - stopped_at:.3f} s")
    assert group.ranks() == {}
    lost = group.rank_events("group_rank_lost", 0)
    assert lost and "sent nothing for 6 s" in lost[0]["reason"], lost  # peer_timeout_s, not its 10
    assert group.rank_events("rank_killed", 0)[0]["killed_rank"] == 1
    assert [e["exit_code"] for e in group.rank_events("server_stopped", 0)] == [EXIT_GROUP_FAILED]


def test_ranks_whose_launcher_dies_before_they_serve_end_at_once(launch):
    """Each rank asked to die with its launcher only as it joined the group, seconds after
    it started (mlx's import, the ring's start, the plugins): a launcher killed before that
    left both ranks serving for good, adopted by init (a review's run: 60 s later, /readyz
    200), and a next group started beside them with a second copy of the model. They now
    ask first thing. The start is held before the model loads (tests/plugins/slow_start.py)."""
    group = launch(ring_group(free_ring_port()),
                   config='[guardian]\nplugins = ["tests.plugins.slow_start:SlowStart"]\n'
                          '[slow_start]\nhold_s = 0.0\nhold_before_load_s = 60.0\n')
    poll(lambda: len(group.events("slow_start_loading")) == 2, 60, what="both ranks held before their load")
    assert len(group.ranks()) == 2
    os.kill(group.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    poll(lambda: group.ranks() == {}, 10, what="both ranks gone with their launcher")
    print(f"\nmeasured: both ranks gone {time.monotonic() - killed_at:.2f} s after the launcher's SIGKILL")


@pytest.mark.one_version
def test_supervised_group_is_replaced_after_sigkill_of_rank_1_and_its_clients_see_no_failure(launch):
    ring_port = free_ring_port()
    group = launch([sys.executable, "-m", "guardian", "--supervise", "--supervisor-interval", "0.2",
                    "--launch-args", f"--backend ring -n 2 --starting-port {ring_port}"],
                   # Slow steps (rank 0's delay holds the other rank in the collective too):
                   # the burst is surely in flight at the kill, whatever the machine's pace.
                   config="[fault_injection]\nenabled = true\nstep_delay_s = 0.05\nrank = 0\n")
    group.wait_healthy()
    first = group.ranks()
    assert sorted(first) == [0, 1]
    # Idle, the launcher waits: mlx.launch's own loops spun (select on an idle rank's input
    # pipe, always writable, and on /dev/null), 1.2 cores for two ranks
    # (guardian.distributed.shim.run_launcher_without_busy_waits).
    [launcher] = [p for p in psutil.Process(group.proc.pid).children() if "mlx.launch" in " ".join(p.cmdline())]
    ranks = [psutil.Process(pid) for pid in first.values()]
    before = [p.cpu_times() for p in (launcher, *ranks)]
    pace(2.0)
    used = [sum(after[:2]) - sum(then[:2]) for then, after in zip(before, [p.cpu_times() for p in (launcher, *ranks)])]
    print(f"\nmeasured over 2 s idle: the launcher {used[0]:.3f} s of CPU, the ranks {used[1]:.3f} and {used[2]:.3f} s")
    assert used[0] < 0.2, used

    burst = [chat_body("Tell me a story.", max_tokens=MAX_TOKENS, stream=stream) for stream in (False, False, True, True)]
    steps = engine_steps(group)
    with ThreadPoolExecutor(len(burst)) as pool:
        clients = [pool.submit(answer, group.url + COMPLETIONS, body) for body in burst]
        poll(lambda: generating(group, steps, len(burst)), 30, what="the burst generating")
        os.kill(first[1], signal.SIGKILL)
        killed_at = time.monotonic()
        results = [c.result(timeout=120) for c in clients]

    # Rank 0 exits at once, leaving its requests to the supervisor as a crashed
    # child does: each is sent again to the next group, a stream continued there.
    for result in results:
        assert result["status"] == 200, result
        if "events" in result:
            assert result["done"] and not result["errors"], result
            assert result["events"][-1]["choices"][0]["finish_reason"] in ("length", "stop"), result
        else:
            assert result["body"]["usage"]["completion_tokens"] <= MAX_TOKENS
    print(f"rank 1 killed: every client answered 200 within {max(r['ended'] for r in results) - killed_at:.3f} s")
    supervisor = [e for e in group.logs() if e.get("logger") == "guardian.supervisor"]
    assert {e["event"] for e in supervisor} >= {"request_resent", "stream_continuing"}
    # No rank of the first group outlives it; rank 0 said why it left.
    poll(lambda: not (set(first.values()) & set(group.ranks().values())), ANSWER_BOUND_S,
         what="the first group's ranks gone")
    assert group.rank_events("group_failed", 0)[0]["exit_code"] == EXIT_GROUP_FAILED

    # The new group serves.
    second = group.ranks()
    assert sorted(second) == [0, 1] and not set(second.values()) & set(first.values())
    response = httpx.post(group.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=90)
    assert response.status_code == 200, response.text
    ready = [e for e in group.events("child_ready") if e.get("logger") == "guardian.supervisor"]
    assert len(ready) == 2
    print(f"group replaced: downtime {ready[1]['downtime_s']} s")

    # A SIGHUP (read the files again) is the supervisor's alone: mlx.launch would die of it.
    group.proc.send_signal(signal.SIGHUP)
    poll(lambda: group.events("signal_not_forwarded"), 10, what="the SIGHUP kept from the group")
    assert not group.events("signal_forwarded")
    assert group.ranks() == second

    # A stop drains and ends every rank cleanly.
    group.proc.send_signal(signal.SIGTERM)
    assert group.proc.wait(timeout=30) == EXIT_OK
    assert group.ranks() == {}
    # Rank 1 stopped cleanly: asked by its own SIGTERM (its handler leaves the asking to the
    # main thread), or told by rank 0 first, which an idle group's drain may be (the launcher
    # signals the ranks one after another). test_a_signalled_rank_asks_rank_0_... signals rank 1 alone.
    assert group.rank_events("rank_signalled", 1) or [
        e for e in group.rank_events("group_stopping", 1) if e["by_rank"] == 0]
    assert group.rank_events("rank_stopped", 1)[-1]["exit_code"] == EXIT_OK


@pytest.mark.one_version
def test_a_rank_stuck_in_its_step_is_a_stall_at_the_limit_though_rank_0_waits_busily(launch):
    """Rank 1 hangs inside stock's step, its interpreter free (so its beats still come): rank 0
    waits in the collective, its threads using CPU (the ring backend polls), and its watchdog
    must not take that for a step computing: a stall at the limit, not 30 s more. The hang
    comes at rank 1's 120th step (not its 40th: beside 4 busy processes a client of the
    burst connected only after the group had ended, refused). The limit is at most 6 s
    (``stall_timeout_s``): beside busy processes the ranks' steps came 2.65 s apart at
    times, and four times that gap (the pace's limit) was past the test's bound."""
    group = launch(ring_group(free_ring_port()),
                   config=('[guardian]\nplugins = ["tests.plugins.rank_faults:RankFaults"]\n'
                           "[rank_faults]\nrank = 1\nhang_at_call = 120\n[watchdog]\nstall_timeout_s = 6.0\n"))
    group.wait_healthy()
    with ThreadPoolExecutor(len(BURST)) as pool:
        clients = [pool.submit(answer, group.url + COMPLETIONS, body) for body in BURST]
        group.wait_for_event("rank_step_hang", timeout=60)
        results = [c.result(timeout=90) for c in clients]
    for result in results:
        assert result["status"] == 503 or result["errors"], result
    # The launcher relays the ranks' lines: once it is gone, every line is in the log.
    poll(lambda: group.proc.poll() is not None, ANSWER_BOUND_S, what="the launcher's exit")
    assert group.ranks() == {}
    [stalled] = group.rank_events("engine_stalled", 0)
    assert "computing" not in stalled["reason"], stalled
    assert group.rank_events("engine_step_busy", 0) == []
    # At the limit (the pace's, 3 to 6 s here); it was 30 s later before.
    assert stalled["heartbeat_age_s"] < 10, stalled


def test_a_signalled_rank_asks_rank_0_to_drain_with_its_grace_as_it_stands_now(launch, tmp_path):
    """SIGTERM to rank 1 alone: rank 0 drains its clients, then every rank exits 0. Rank 1
    used to leave by its own copy of exit_grace_s, read at its start: a grace raised since
    (rank 0 follows the file, no other rank does) cut a request rank 0 was still draining."""
    config = "[fault_injection]\nenabled = true\nstep_delay_s = 0.05\nrank = 0\n"
    group = launch(ring_group(free_ring_port()), config=config + "[guardian]\nexit_grace_s = 1.0\n")
    group.wait_healthy()
    group.config_path.write_text(config + "[guardian]\nexit_grace_s = 30.0\n")
    poll(lambda: [e for e in group.rank_events("config_reloaded", 0) if "guardian.exit_grace_s" in e["changed"]],
         20, what="rank 0 following the raised grace")
    steps = engine_steps(group)
    with ThreadPoolExecutor(1) as pool:
        # 80 steps of >= 0.05 s: still generating well past the old grace (1 s + 2 s).
        client = pool.submit(answer, group.url + COMPLETIONS, chat_body("Tell me a story.", max_tokens=80))
        poll(lambda: generating(group, steps, 1), 30, what="the request generating")
        # A SIGHUP to rank 1 changes nothing (rank 0 alone follows the file), and says so.
        os.kill(group.ranks()[1], signal.SIGHUP)
        poll(lambda: group.rank_events("sighup_ignored", 1), 10, what="rank 1 saying it ignored the SIGHUP")
        os.kill(group.ranks()[1], signal.SIGTERM)
        result = client.result(timeout=60)
    assert result["status"] == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 80
    assert group.proc.wait(timeout=30) == 0
    assert group.ranks() == {}
    assert [e["by_rank"] for e in group.rank_events("group_stopping", 0)] == [1]
    assert [e["exit_code"] for e in group.rank_events("server_stopped", 0)] == [EXIT_OK]
    assert [e["exit_code"] for e in group.rank_events("rank_stopped", 1)] == [EXIT_OK]


def test_a_rank_lost_after_it_asked_rank_0_to_stop_still_fails_the_group(launch):
    """Rank 1 asked rank 0 to stop the group (SIGTERM), then died while rank 0 drained.
    Rank 0 stopped reading rank 1's connection at the ask, and took no loss as a failure
    once asked: its collective waited for the dead rank, the client got nothing more, then
    503 at the stall limit or the end of the drain (30 s here), and rank 0 exited 0."""
    config = "[fault_injection]\nenabled = true\nstep_delay_s = 0.05\nrank = 0\n[guardian]\nexit_grace_s = 30.0\n"
    group = launch(ring_group(free_ring_port()), config=config + "[watchdog]\nstall_min_s = 20.0\n")
    group.wait_healthy()
    steps = engine_steps(group)
    with ThreadPoolExecutor(1) as pool:
        client = pool.submit(answer, group.url + COMPLETIONS, chat_body("Tell me a story.", max_tokens=2000))
        poll(lambda: generating(group, steps, 1), 30, what="the request generating")
        rank_1 = group.ranks()[1]
        os.kill(rank_1, signal.SIGTERM)
        poll(lambda: group.rank_events("group_stopping", 0), 10, what="rank 0 asked to stop the group")
        os.kill(rank_1, signal.SIGKILL)
        killed_at = time.monotonic()
        result = client.result(timeout=60)
    print(f"\nmeasured: answered {result['ended'] - killed_at:.2f} s after rank 1's SIGKILL")
    assert result["status"] == 503, result
    assert result["ended"] - killed_at < ANSWER_BOUND_S
    assert group.proc.wait(timeout=30) is not None and group.ranks() == {}
    assert [e["exit_code"] for e in group.rank_events("server_stopped", 0)] == [EXIT_GROUP_FAILED]
    [lost] = group.rank_events("group_rank_lost", 0)
    assert lost["lost_rank"] == 1


@pytest.mark.one_version
def test_supervised_group_whose_rank_1_fails_ends_at_once_and_kills_nothing(launch, tmp_path):
    """Rank 1 fails in its step, says so and exits: rank 0 leaves its request to the supervisor
    at once. It waited a second for rank 1's end, which only its own blocked thread would
    have seen, then sent SIGKILL to rank 1's pid, which by then could be anyone's."""
    arm = tmp_path / "arm"
    group = launch([sys.executable, "-m", "guardian", "--supervise", "--supervisor-interval", "0.2",
                    "--launch-args", f"--backend ring -n 2 --starting-port {free_ring_port()}"],
                   config=('[guardian]\nplugins = ["tests.plugins.rank_faults:RankFaults"]\n'
                           f'[rank_faults]\nrank = 1\narm_file = "{arm}"\n'))
    group.wait_healthy()
    first = group.ranks()
    arm.touch()
    # The request makes a step; it is left to the supervisor (the test of a SIGKILL of rank 1
    # above sees such requests answered by the next group), so this client is not waited for.
    def send():
        try:
            httpx.post(group.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=30)
        except httpx.TransportError:
            pass  # the supervisor stopped at the test's end, holding it

    threading.Thread(target=send, daemon=True).start()
    group.wait_for_event("group_failed", timeout=60)
    poll(lambda: not (set(first.values()) & set(group.ranks().values())), ANSWER_BOUND_S,
         what="the first group's ranks gone")
    # The launcher relays the ranks' lines: once the supervisor saw it exit, every line is in.
    poll(lambda: [e for e in group.events("child_exited") if e.get("generation") == 1], ANSWER_BOUND_S,
         what="the first group's exit")
    assert group.rank_events("rank_killed", 0) == []


@pytest.mark.one_version
def test_a_supervised_group_whose_model_cannot_load_ends_with_code_3_at_its_boot_attempts(launch, tmp_path):
    """mlx.launch exits 0 whatever its ranks did: rank 0 leaves its code for the supervisor,
    which gives up on a model that cannot load at ``boot_attempts`` groups in a row (two by
    default), as for one child, not after its restart budget (six group starts, each of
    them a model load). With no configuration file too: the ranks' codes went to the
    supervisor's private folder, made only for one, and without it the group read as a
    crash each time (exit 6 after six). mlx.launch's pid and host files (``mktemp``, never
    removed) went in the group's own TMPDIR, gone with it: four were left in TMPDIR a group."""
    group = launch([sys.executable, "-m", "guardian", "--supervise", "--supervisor-interval", "0.2",
                    "--launch-args", f"--backend ring -n 2 --starting-port {free_ring_port()}",
                    "--model", str(tmp_path / "no-such-model")], config=None)
    assert group.proc.wait(timeout=120) == EXIT_BOOT_ERROR
    supervisor = [e for e in group.logs() if e.get("logger") == "guardian.supervisor"]
    started = [e for e in supervisor if e.get("event") == "child_started"]
    exited = [e for e in supervisor if e.get("event") == "child_exited"]
    assert len(started) == 2, started
    # Nothing of the groups' nor of the supervisor's is left in TMPDIR but mlx's kernels.
    assert [p.name for p in group.temp_folder.iterdir()] == ["mlx"]
    # Whichever rank failed first (the launcher may kill the other before it says so).
    assert all("'s exit code 3: the model could not be loaded" in e["reason"] for e in exited), exited
    [gave_up] = [e for e in supervisor if e.get("event") == "supervisor_gave_up"]
    assert gave_up["exit_code"] == EXIT_BOOT_ERROR


@pytest.mark.one_version
def test_a_supervised_stock_group_serves_the_demo_model_and_leaves_nothing_in_tmpdir(launch):
    """`--engine stock --launch-args` with no --model: stock's rank 0 answered its health
    checks and failed every completion (404: it was started with no model), and each group
    left mlx.launch's four ``mktemp`` files in TMPDIR (a TMPDIR of its own was made for a
    guardian group only)."""
    group = launch([sys.executable, "-m", "guardian", "--supervise", "--supervisor-interval", "0.2",
                    "--engine", "stock", "--launch-args", f"--backend ring -n 2 --starting-port {free_ring_port()}"],
                   config=None)
    group.wait_healthy()
    answer = httpx.post(group.url + COMPLETIONS, json=chat_body(max_tokens=4), timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text
    # mlx.launch's files are in the group's own TMPDIR, in the supervisor's private folder.
    assert not [p.name for p in group.temp_folder.iterdir() if p.name.startswith("tmp.")]
    group.proc.send_signal(signal.SIGTERM)
    assert group.proc.wait(timeout=30) == EXIT_OK
    assert [p.name for p in group.temp_folder.iterdir()] == ["mlx"]
    # Stock's ranks log no code of theirs: the group's end says so, naming no such lines.
    [exited] = group.events("child_exited")
    assert "whatever its stock ranks did" in exited["reason"], exited


@pytest.mark.one_version
def test_a_groups_own_tmpdir_is_made_with_the_shared_kernels_and_not_for_mpi(tmp_path, monkeypatch):
    from guardian.distributed.launch import own_temp_folder, starts_its_ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = own_temp_folder(str(tmp_path / "group-1-tmp"))
    assert folder == str(tmp_path / "group-1-tmp")
    assert (tmp_path / "group-1-tmp" / "mlx").resolve() == (tmp_path / "mlx").resolve()
    assert (tmp_path / "mlx").is_dir()
    assert own_temp_folder(folder) is None  # there already: not one of the group's own
    assert starts_its_ranks("--backend ring -n 2") and starts_its_ranks("--hosts a,b")
    assert starts_its_ranks("--backend=jaccl --hostfile h.json")
    assert not starts_its_ranks("--backend mpi -n 2") and not starts_its_ranks("-n 2 --backend=mpi")
    # A hostfile's backend, as mlx.launch reads it: unless --backend names another.
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "mpi", "hosts": [{"ssh": "localhost"}]}))
    assert not starts_its_ranks(f"--hostfile {hostfile}")
    assert starts_its_ranks(f"--hostfile={hostfile} --backend ring")
    hostfile.write_text(json.dumps([{"ssh": "localhost"}]))  # a list of hosts alone: ring, or NCCL
    assert starts_its_ranks(f"--hostfile {hostfile}")
    assert starts_its_ranks(f"--hostfile {tmp_path / 'none.json'}")  # mlx.launch says what is wrong


def test_the_groups_exit_code_is_a_rank_that_failed_of_its_own_and_its_files_are_taken(tmp_path):
    from guardian.distributed.launch import LauncherProcess, take_group_exit_code

    path = str(tmp_path / "group-1-exit-code")
    assert take_group_exit_code(path) is None  # no rank left one: the launcher's code stands

    def leave(*codes: int) -> None:
        for rank, code in enumerate(codes):
            (tmp_path / f"group-1-exit-code.rank{rank}").write_text(str(code))

    leave(7, 3)  # rank 1's model failed; rank 0 left for that
    assert take_group_exit_code(path) == (1, 3)
    leave(7, 0)
    assert take_group_exit_code(path) == (0, 7)
    # A launcher that exited 0 takes its ranks' word once, and their files go: a group
    # restarted for weeks leaves none behind in the supervisor's folder.
    # Whichever of the threads that poll it sees the exit first, each reads the group's.
    leave(0, 3)
    launcher = LauncherProcess([sys.executable, "-c", "pass"], exit_code_file=path)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda _: poll(launcher.poll, 30, interval=0.001, what="the launcher's exit"),
                             range(8)))
    assert seen == [3] * 8 and launcher.ranks_code == (1, 3) and launcher.wait(timeout=30) == 3
    assert list(tmp_path.iterdir()) == []


@pytest.mark.one_version
def test_a_group_that_ends_unasked_with_no_ranks_code_is_a_failure(tmp_path):
    """mlx.launch exits 0 whatever its ranks did. A rank that crashed before it could leave
    its code (a ring port taken: RuntimeError, exit 1; its peer then killed) left the group's
    end reading as a clean stop: child_exited with returncode 0, exit_0 in the metrics."""
    from types import SimpleNamespace

    from guardian.distributed.launch import LauncherProcess
    from guardian.supervise.child import exit_reason

    code_file = str(tmp_path / "group-1-exit-code")
    unasked = LauncherProcess([sys.executable, "-c", "pass"], exit_code_file=code_file)
    assert unasked.wait(timeout=30) == EXIT_GROUP_FAILED and unasked.codes_missing
    reason = exit_reason(SimpleNamespace(proc=unasked, hard_killed=False, kill_reason=None, stopped_on_its_own=False))
    assert "no rank left its exit code" in reason and f"exit code {EXIT_GROUP_FAILED}" in reason
    # Asked to stop, a group that leaves no code ended as asked: the launcher's 0 stands.
    # A stand-in launcher that waits for its signal (SIGALRM ends it after 30 s if none comes).
    waiting = ("import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
               "print('ready', flush=True); signal.alarm(30); signal.pause()")
    asked = LauncherProcess([sys.executable, "-c", waiting], exit_code_file=code_file, stdout=subprocess.PIPE)
    assert asked.stdout.readline() == b"ready\n"  # its handler is in place
    asked.send_signal(signal.SIGTERM)
    assert asked.wait(timeout=30) == EXIT_OK and not asked.codes_missing
    asked.stdout.close()


@pytest.mark.one_version
def test_fault_injection_aims_at_one_rank():
    """[fault_injection] rank: faults planted on that rank only (a process alone is rank 0)."""
    from guardian.plugins.fault_injection import FaultInjection, FaultInjectionSettings

    def active(**table):
        return FaultInjection(FaultInjectionSettings.from_toml({"enabled": True, **table})).active

    assert active() and active(rank=0)
    assert not active(rank=1)


@pytest.mark.one_version
def test_rank_0_waits_join_timeout_s_for_its_ranks_and_holds_only_so_many_silent_connections():
    """A rank that never reaches rank 0 (a firewall) ends the join at [watchdog]
    join_timeout_s, naming who joined; a flood of silent connections meanwhile holds
    at most MAX_PENDING_HELLOS descriptors, the oldest let go."""
    from guardian.distributed.control import MAX_PENDING_HELLOS, ControlLinks

    def links(rank: int) -> ControlLinks:
        return ControlLinks(rank, 3, beat_s=1.0, peer_timeout_s=10.0, on_lost=lambda *_: None,
                            on_stopping=lambda _: None, join_timeout_s=2.0)

    leader = links(0)
    address = leader.listen("127.0.0.1")
    failed = []

    def accept_all():
        try:
            leader.accept_all()
        except TimeoutError as e:
            failed.append(str(e))

    started = time.monotonic()
    joining = threading.Thread(target=accept_all, daemon=True)
    joining.start()
    silent = []
    rank_1 = links(1)
    try:
        for _ in range(MAX_PENDING_HELLOS + 6):
            silent.append(socket.create_connection(address, timeout=10))
        silent[0].settimeout(5)
        assert silent[0].recv(1) == b""  # the oldest let go while the join goes on
        rank_1.connect(address, leader.token)  # rank 2 never comes
        joining.join(timeout=15)
        took = time.monotonic() - started
        assert not joining.is_alive() and 2.0 <= took < 6, took
        assert failed and "join_timeout_s" in failed[0] and "[0, 1]" in failed[0], failed
        silent[-1].settimeout(5)
        assert silent[-1].recv(1) == b""  # every connection let go as the join ended
    finally:
        for sock in silent:
            sock.close()
        for member in (leader, rank_1):
            member.close()


def test_rank_0_lets_in_only_its_groups_ranks_while_they_join():
    """Rank 0 listens on the network until every rank has joined. A first line that was no
    hello (a scan, an HTTP request) failed the group's start (its JSON read raised), one
    naming a rank was taken as that rank, and one that said nothing held up the join
    for its 30 s. Now a hello needs the token the rendezvous gave the group's members,
    and hellos are read side by side."""
    from guardian.distributed.control import ControlLinks

    def links(rank: int) -> ControlLinks:
        return ControlLinks(rank, 3, beat_s=1.0, peer_timeout_s=10.0, on_lost=lambda *_: None,
                            on_stopping=lambda _: None)

    leader = links(0)
    address = leader.listen("127.0.0.1")
    joining = threading.Thread(target=leader.accept_all, daemon=True)
    joining.start()
    strangers = [socket.create_connection(address, timeout=10)]  # says nothing, holds on
    for line in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b'{"kind": "hello", "rank": 1}\n',
                 b'{"kind": "hello", "rank": 2, "token": "%s"}\n' % (b"0" * 32), b"{" * 10_000,
                 b"[" * 4000 + b"\n",  # past the JSON parser's recursion (a review)
                 b'{"kind": "hello", "rank": 1, "token": "\\ud800"}\n'):  # a token that does not encode
        stranger = socket.create_connection(address, timeout=10)
        stranger.sendall(line)
        strangers.append(stranger)
    ranks = [links(1), links(2)]
    started = time.monotonic()
    try:
        for rank in ranks:
            rank.connect(address, leader.token)
        joining.join(timeout=10)
        assert not joining.is_alive() and time.monotonic() - started < 5
        assert sorted(c.peer for c in leader.connections) == [1, 2]
        for stranger in strangers:  # each refused, or let go as the join ended
            try:
                assert stranger.recv(100) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in strangers:
            sock.close()
        for member in (leader, *ranks):
            member.close()

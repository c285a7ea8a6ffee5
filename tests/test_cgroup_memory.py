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
import textwrap
from pathlib import Path

import httpx
import pytest

from conftest import Server, chat_body, free_port, poll, spawn_guardian
from guardian.admission.cgroup_memory import V1_MEMORY_ROOT, V2_ROOT, group_paths

LIMIT_BYTES = 3 << 30  # far above what the demo model's server needs, far below this machine's memory


def make_group(name: str) -> tuple[Path, str]:
    """A memory group of this process's, limited to LIMIT_BYTES: (its folder, its limit's file
    name). Skips where none can be made (not Linux, not root, no memory controller here)."""
    v2, v1 = group_paths()
    tries = []
    if v1 is not None:
        tries.append((Path(V1_MEMORY_ROOT, v1.lstrip("/"), name), "memory.limit_in_bytes"))
    if v2 is not None and os.path.exists(os.path.join(V2_ROOT, "cgroup.controllers")):
        tries.append((Path(V2_ROOT, v2.lstrip("/"), name), "memory.max"))
    why = "no memory controller of this process's to make a group under (not Linux?)"
    for folder, limit_file in tries:
        try:
            folder.mkdir()
        except OSError as e:
            why = f"cannot make a memory group at {folder}: {e}"
            continue
        try:
            (folder / limit_file).write_text(str(LIMIT_BYTES))
            return folder, limit_file
        except OSError as e:
            why = f"cannot limit the memory group at {folder}: {e}"
            folder.rmdir()
    pytest.skip(why)


@pytest.fixture
def memory_group():
    group = make_group(f"guardian-test-{os.getpid()}")
    yield group
    folder, _ = group
    # Its processes are gone (killed by the test's end); a group with none can be removed.
    poll(lambda: not (folder / "cgroup.procs").read_text().split(), 10, what="the group emptied")
    folder.rmdir()


def test_a_servers_memory_guard_and_kv_budget_measure_against_its_groups_limit(tmp_path, model_cache, memory_group):
    folder, limit_file = memory_group
    port = free_port()
    config = tmp_path / "guardian.toml"
    config.write_text(textwrap.dedent(""))
    log_path = tmp_path / "server.log"
    procs = folder / "cgroup.procs"
    # Into the group before it runs anything: all it allocates is counted there.
    proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config)], log_path, model_cache,
                          preexec_fn=lambda: procs.write_text(str(os.getpid())))
    server = Server(proc, port, log_path)
    try:
        server.wait_healthy()
        assert str(proc.pid) in procs.read_text().split()
        [thresholds] = server.events("memory_thresholds")
        assert thresholds["device_memory_bytes"] == LIMIT_BYTES, thresholds
        assert thresholds["device_memory_source"] == f"cgroup {folder / limit_file}", thresholds
        assert thresholds["refuse_above_bytes"] == int(0.95 * LIMIT_BYTES), thresholds
        [guard] = server.events("prompt_guard_ready")
        assert guard["kv_budget_bytes"] < LIMIT_BYTES, guard  # a share of the group's, not the machine's
        response = httpx.post(server.url + "/v1/chat/completions", json=chat_body(max_tokens=4), timeout=60)
        assert response.status_code == 200, response.text
    finally:
        server.stop()

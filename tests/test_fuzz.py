"""Hostile request bodies against a live guardian, with another client streaming meanwhile.

Hypothesis draws bodies for both completion endpoints, streamed and not, from
tests/strategies.py: wrong types, extreme numbers, NaN/Infinity, empty and
huge strings and arrays, unicode, unknown fields, nested junk, bodies that
are not JSON objects. For every body:

- the process is alive, and the engine neither restarted nor counted a
  failure (``/guardian/status``);
- the answer is a 2xx (a stream ends with ``[DONE]`` and no error event) or
  a 4xx whose body has OpenAI's shape; a 5xx, a dropped connection or a
  timeout is a failure;

and a bystander streaming normal requests back to back the whole time has
every stream end with ``[DONE]`` and no error event.

Every body is judged and every failure is kept (a dead server is started
again), so one run lists all the bodies that break the contract, not only
the first. Hypothesis does not shrink: the failing bodies are shown whole.
The run is derandomized, so CI sees the same bodies every time; both venvs
run it, so both mlx-lm versions are covered.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from conftest import Server, free_port, poll, spawn_guardian
from guardian.relay_protocol import RELAY_KEY_ENV
from fuzz_client import Bystander, send
from strategies import CHAT, FUZZ_RELAY_KEY, TEXT, FuzzCase, cases

EXAMPLES_PER_ENDPOINT = 150
REQUEST_TIMEOUT_S = 60.0


class FuzzTarget:
    """One guardian for the module; started again (and the death recorded) if a body kills it."""

    def __init__(self, folder: Path, model_cache: Path):
        self.folder = folder
        self.model_cache = model_cache
        self.server: Optional[Server] = None
        self.restarts_seen = 0
        self.failures_seen = 0
        self.start()

    def start(self) -> None:
        port = free_port()
        config = self.folder / f"guardian-{port}.toml"
        config.write_text(textwrap.dedent(""))
        hf_cache = self.folder / "hf-cache"
        hf_cache.mkdir(exist_ok=True)
        # Offline: a body naming a hub id must fail at once, not wait on the network.
        env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_cache),
               # Cases that carry this key reach the continuation header's parsing.
               RELAY_KEY_ENV: FUZZ_RELAY_KEY}
        log_path = self.folder / f"server-{port}.log"
        proc = spawn_guardian(["--port", str(port), "--guardian-config", str(config)], log_path,
                              self.model_cache, env)
        self.server = Server(proc, port, log_path)
        self.server.wait_healthy()
        self.restarts_seen = self.failures_seen = 0

    @property
    def url(self) -> str:
        return self.server.url

    def engine_status(self) -> Optional[dict]:
        try:
            return httpx.get(self.url + "/guardian/status", headers=AS_SUPERVISOR, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None

    def harm_done(self) -> Optional[str]:
        """What the last body did to the server (died, engine restarted or failed), or None.

        A dead server is started again so the run can go on.
        """
        code = self.server.proc.poll()
        if code is not None:
            self.start()
            return f"process died: exit {code}" + (" (signal)" if code < 0 else "")
        status = self.engine_status()
        if status is None:
            return "process alive but /guardian/status does not answer"
        harm = []
        if status["restarts"] > self.restarts_seen:
            harm.append(f"engine restarted ({status['restarts'] - self.restarts_seen}x)")
        if status["failures_in_window"] > self.failures_seen:
            harm.append(f"engine failure counted ({status['failures_in_window']} in window)")
        self.restarts_seen = status["restarts"]
        self.failures_seen = status["failures_in_window"]
        if status["state"] not in ("ready",):
            harm.append(f"engine state {status['state']}")
        return "; ".join(harm) or None

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory, model_cache):
    target = FuzzTarget(tmp_path_factory.mktemp("fuzz"), model_cache)
    yield target
    target.stop()


# The target runs as a supervised child (to reach the continuation header's
# parsing), which serves only its supervisor: every case carries the relay key
# but those that draw a guess (refused 403 not_from_supervisor).
AS_SUPERVISOR = {"X-Guardian-Relay-Key": FUZZ_RELAY_KEY}


def judge(target: FuzzTarget, client: httpx.Client, case: FuzzCase) -> list[str]:
    """Every way this body broke the contract; empty when it did not."""
    answer = send(client, target.url, case, timeout=REQUEST_TIMEOUT_S, default_headers=AS_SUPERVISOR)
    problems = []
    if answer.problem():
        problems.append(answer.problem())
    harm = target.harm_done()
    if harm:
        problems.append(harm)
    return [f"{'; '.join(problems)}\n    {case.describe()}"] if problems else []


def relayed(path: str, continue_from: str, key: str = FUZZ_RELAY_KEY) -> FuzzCase:
    """A stream the supervisor would continue, with a hostile continuation header."""
    body = {"max_tokens": 4, "stream": True,
            **({"messages": [{"role": "user", "content": "Go on."}]} if path == CHAT else {"prompt": "Go on."})}
    return FuzzCase(path, json.dumps(body).encode(), ("relay header",), body,
                    (("X-Guardian-Continue-From", continue_from), ("X-Guardian-Relay-Key", key)))


# Always tried: every way the continuation header can be wrong once the key is right
# (not numbers, an id past the vocabulary, nothing left of max_tokens), and a guessed key.
RELAYED = {path: [relayed(path, value) for value in ("1,x", "-1", str(1 << 40), "1,2,3,4", "")]
           + [relayed(path, "1,2", key="guess")] for path in (CHAT, TEXT)}


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_no_body_hurts_the_server_or_a_bystander(fuzz_target, path):
    failures: list[str] = []
    judged = []
    started = time.monotonic()
    with httpx.Client() as client, Bystander(fuzz_target.url, headers=AS_SUPERVISOR) as bystander:
        # No shrinking: every body is judged and kept, so a failure has nothing to shrink.
        def fuzz(case):
            judged.append(case)
            failures.extend(judge(fuzz_target, client, case))
            if fuzz_target.url != bystander.base_url:
                # The server died and was started again on a new port.
                bystander.base_url = fuzz_target.url

        for case in RELAYED[path]:
            fuzz = example(case)(fuzz)
        fuzz = settings(max_examples=EXAMPLES_PER_ENDPOINT, derandomize=True, database=None, deadline=None,
                        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(
            given(cases(paths=[path]))(fuzz))
        fuzz()
        # The bystander's stream in progress finishes too.
        finished_before = bystander.finished
        poll(lambda: bystander.finished > finished_before or bystander.hurt, 60,
             what="the bystander's last stream")
    assert len(judged) >= EXAMPLES_PER_ENDPOINT // 2, "hypothesis drew too few bodies"
    report = "\n".join(failures)
    hurt = "\n".join(f"  {outcome}" for _, outcome in bystander.hurt)
    assert not failures and not bystander.hurt, (
        f"{len(failures)} of {len(judged)} bodies broke the contract "
        f"({time.monotonic() - started:.0f} s):\n{report}\n"
        f"bystander: {bystander.finished} streams finished, {len(bystander.hurt)} hurt:\n{hurt}")
    assert bystander.finished > 0

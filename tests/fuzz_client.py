"""Send a FuzzCase to a live server and say what came back, in a few words.

Shared by tests/test_fuzz.py and bench/fuzz_campaign.py, so the test and
the campaign judge an answer the same way. The case's bytes are sent as
they are (``content=``): a client's own JSON encoder would refuse NaN or
re-encode surrogates.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Optional

import httpx

from strategies import FuzzCase

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Answer:
    """What a server did with one request."""

    status: Optional[int] = None      # None: no status line came
    code: Optional[str] = None        # the error's ``code``, or stock's error text
    shaped: bool = False              # an error body in OpenAI's shape
    transport: Optional[str] = None   # "dropped" or "timeout" when no full answer came
    stream_done: bool = False
    stream_error: Optional[str] = None  # the code of an SSE error event
    seconds: float = 0.0

    @property
    def outcome(self) -> str:
        """E.g. ``200``, ``400 invalid_request``, ``200 stream cut``, ``dropped``."""
        if self.status is None:
            return self.transport or "no answer"
        if self.status == 200 and self.stream_error:
            return f"200 stream error event {self.stream_error}"
        if self.status == 200 and self.transport:
            return f"200 then {self.transport}"
        if self.status < 300:
            return str(self.status)
        return f"{self.status} {self.code}" + ("" if self.shaped else " (not OpenAI-shaped)")

    def problem(self) -> Optional[str]:
        """Why this answer breaks the contract (2xx, or an OpenAI-shaped 4xx), or None."""
        if self.status is None:
            return f"no answer: {self.transport}"
        if self.status >= 500:
            return f"server error {self.outcome}"
        if self.status >= 300 and not self.shaped:
            return f"error body not in OpenAI's shape: {self.outcome}"
        if self.status == 200 and (self.transport or self.stream_error):
            return self.outcome
        return None


def error_code(payload: object) -> tuple[Optional[str], bool]:
    """An error body's code (or stock's text) and whether it has OpenAI's shape."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        shaped = OPENAI_ERROR_KEYS <= set(error)
        return (error.get("code") or error.get("type") or str(error.get("message"))[:60]), shaped
    if error is not None:
        return str(error)[:80], False
    return None, False


def send(client: httpx.Client, base_url: str, case: FuzzCase, timeout: float = 60.0,
         default_headers: Optional[dict] = None) -> Answer:
    """POST the case's bytes; read the whole answer (a stream to its end) within ``timeout``.
    ``default_headers``: sent unless the case has a header of the same name."""
    answer = Answer()
    started = time.monotonic()
    deadline = started + timeout
    headers = {"Content-Type": "application/json", **(default_headers or {}),
               **{name: value.encode("latin-1") for name, value in case.headers}}
    try:
        with client.stream("POST", base_url + case.path, content=case.raw, headers=headers,
                           timeout=timeout) as response:
            answer.status = response.status_code
            is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if response.status_code == 200 and is_sse:
                read_events(response, answer, deadline)
            else:
                response.read()
                if response.status_code >= 300:
                    try:
                        answer.code, answer.shaped = error_code(response.json())
                    except ValueError:
                        answer.code = response.text[:60]
    except httpx.TimeoutException:
        answer.transport = "timeout"
    except httpx.TransportError:
        answer.transport = "dropped"
    answer.seconds = round(time.monotonic() - started, 3)
    return answer


def read_events(response: httpx.Response, answer: Answer, deadline: float) -> None:
    for line in response.iter_lines():
        if time.monotonic() > deadline:  # keepalives must not stretch the timeout
            raise httpx.ReadTimeout("client deadline")
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            answer.stream_done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            answer.stream_error, _ = error_code(event)
    if not answer.stream_done:
        answer.transport = "cut"  # closed without [DONE]


class Bystander(threading.Thread):
    """Another client: normal chat streams back to back while the fuzzing runs.

    Each stream must end with ``data: [DONE]`` and no error event; any other
    ending is kept, with the time it happened, in ``hurt``.
    """

    BODY = {"messages": [{"role": "user", "content": "I am an innocent bystander."}],
            "max_tokens": 24, "stream": True}

    def __init__(self, base_url: str, path: str = "/v1/chat/completions", headers: Optional[dict] = None):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.path = path
        self.headers = headers
        self.stopped = threading.Event()
        self.finished = 0
        self.hurt: list[tuple[float, str]] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stopped.is_set():
                answer = send(client, self.base_url, FuzzCase(self.path, json.dumps(self.BODY).encode()),
                              default_headers=self.headers)
                if answer.status == 200 and answer.stream_done and not answer.stream_error:
                    self.finished += 1
                else:
                    self.hurt.append((time.time(), answer.outcome))
                    # A dead server refuses at once: do not spin on it.
                    self.stopped.wait(0.2)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=90)

    def __enter__(self) -> "Bystander":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

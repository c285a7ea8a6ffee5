"""Fill mlx's CUDA kernel cache before the tests, and say what a cold one costs.

mlx's CUDA backend compiles most kernels at their first use (NVRTC), and
keeps the PTX on disk (MLX_PTX_CACHE_DIR, by default $TMPDIR/mlx/VERSION/ptx)
for later processes. On a fresh machine the suite's first dozen servers all
compile at once: a first step took 7 s there, and tests whose stall limit is
1 s saw stalls that were compiles. This serves the demo model twice, each
time in a fresh process, with the sampling options and batch sizes the tests
use, and prints how long each pass took: the first fills the cache, the
second shows what a warm one costs.

    python3 tools/gpu/warm_kernels.py [--out warm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
VARIANTS = [
    {},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 5, "min_p": 0.05},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 1.25},
    {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"logit_bias": {"5": 2.0}},
    {"logprobs": True, "top_logprobs": 3},
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def body(content: str, max_tokens: int = 8, **options) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **options}


def one_pass(cache: Path, log_path: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLX_GUARDIAN_CACHE": str(cache)}
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "guardian", "--port", str(port)], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timings = {}
    try:
        with httpx.Client(timeout=300) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get(url + "/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the guardian did not become ready:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.1)
            timings["ready_s"] = round(time.monotonic() - started, 2)
            for options in VARIANTS:
                for stream in (False, True):
                    name = ",".join(options) or "greedy"
                    began = time.monotonic()
                    response = client.post(url + CHAT, json=body(f"warm {name}", stream=stream, **options))
                    response.raise_for_status()
                    timings[f"{name}{' stream' if stream else ''}_s"] = round(time.monotonic() - began, 3)
            for batch in (2, 4, 8):
                began = time.monotonic()
                with ThreadPoolExecutor(batch) as pool:
                    answers = list(pool.map(lambda i: client.post(url + CHAT, json=body(
                        f"batch of {batch}, number {i} " * (1 + i), max_tokens=16,
                        **VARIANTS[i % len(VARIANTS)])), range(batch)))
                assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
                timings[f"batch_{batch}_s"] = round(time.monotonic() - began, 3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    timings["total_s"] = round(time.monotonic() - started, 2)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="warm-kernels-"))
    results = {}
    for name in ("first", "second"):
        results[name] = one_pass(workdir / "models", workdir / f"{name}.log")
        print(name, json.dumps(results[name]), flush=True)
    if options.out:
        options.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The incident for real: a GPU allocator failure, stock and mlx-guardian side by side.

Nothing is planted. On a CUDA machine (issue 14; tools/gpu/run_on_device.md
says how to get there) each server in turn:

1. loads a demo-built model with a large KV cache per token (64 KiB: 8
   layers x 8 KV heads x 128 x float32, K and V) and is warmed up;
2. then another process (torch) takes all but ``--keep-free-gib`` of the
   GPU's free memory and holds it;
3. wave "pressure": ``--long`` prompts of ``--prompt-tokens`` tokens at once
   (each needs ~0.75 GiB of KV cache), then one short request;
4. wave "pressure_again": the same, memory still held;
5. wave "sdk_retries_across_release": the same long requests through the
   openai SDK (``--sdk-retries``, 8); once each has been answered (the
   shortage), the holder exits, and the SDK's own retries, after each
   answer's Retry-After, meet the memory back;
6. wave "freed": the same again, with the memory back.

Reported per request: the status and error code each client got, its time;
per server: /health after each wave, whether the process lived, and for
mlx-guardian the engine errors (classification), restart times, blamed
requests and the KV budget it admitted by (kv_budget_lowered / _restored).

    python bench/gpu_oom.py                      # on the GPU: JSON into bench/results/
    python bench/gpu_oom.py --hold none --prompt-tokens 300 --kv-layers 2   # plumbing, on a CPU

It is a rehearsal, not a test: it records what happened and never fails on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import httpx
from servers import Server, free_port, poll_until
from stats import environment

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Holds all but KEEP bytes of the GPU's free memory with plain cudaMalloc
# (torch's allocator), until killed.
HOLDER = textwrap.dedent("""
    import sys, time, torch
    free, total = torch.cuda.mem_get_info()
    keep = int(float(sys.argv[1]) * 2**30)
    held = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print(json.dumps({"held_bytes": held.numel(), "free_before": free, "total": total}), flush=True)
    while True:
        time.sleep(60)
""").replace("import sys,", "import json, sys,")

GUARDIAN_CONFIG = """
[watchdog]
# Look at memory often: the KV budget follows the device back up.
resource_interval_s = 0.5
[prompt_guard]
# Requests that wait for KV budget are told 429 within 5 s (default 30).
max_queue_wait_s = 5.0
"""

GUARDIAN_EVENTS = ("engine_error", "engine_restarted", "engine_gave_up", "kv_budget_lowered",
                   "kv_budget_restored", "request_blamed", "request_rerun", "engine_backoff",
                   "request_failed")


def gpu_memory() -> Optional[dict]:
    """nvidia-smi's used and free MiB, or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        used, free = (int(x) for x in out.stdout.split(",")[:2])
        return {"used_mib": used, "free_mib": free}
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def build_model(folder: Path, layers: int, kv_heads: int, head_dim: int, context: int) -> Path:
    from guardian.demo_model import write_demo_model

    path = folder / f"oom-model-{layers}x{kv_heads}x{head_dim}"
    if not path.exists():
        write_demo_model(path, seed=0, num_hidden_layers=layers, num_attention_heads=kv_heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=context)
    return path


def prompt_of(tokenizer, n_tokens: int, tag: str) -> str:
    """A prompt of about ``n_tokens`` tokens that starts with ``tag`` (no shared prefix)."""
    words = ("the guardian watches a language model server and keeps it alive when a request "
             "arrives the server reads the prompt ").split()
    text = f"{tag}:"
    chunk = " ".join(words)
    per_chunk = len(tokenizer.encode(" " + chunk))
    text += (" " + chunk) * max(1, n_tokens // per_chunk)
    return text


class Run:
    """One server through the waves; what its clients got."""

    def __init__(self, kind: str, model: Path, args, folder: Path, tokenizer):
        self.kind, self.model, self.args, self.folder, self.tokenizer = kind, model, args, folder, tokenizer
        self.report: dict = {"kind": kind, "waves": [], "health": {}}
        self.server: Optional[Server] = None

    def start(self) -> None:
        port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.kind == "stock":
            command = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model), "--port", str(port)]
        else:
            config = self.folder / "guardian.toml"
            config.write_text(GUARDIAN_CONFIG)
            command = [sys.executable, "-m", "guardian", "--model", str(self.model), "--port", str(port),
                       "--guardian-config", str(config)]
        started = time.monotonic()
        self.server = Server(self.kind, command, port, self.folder / f"{self.kind}.log", env)
        ready = self.server.wait_ready(timeout=180)
        self.report["start_s"] = round(time.monotonic() - started, 2)
        if not ready:
            raise RuntimeError(f"{self.kind} did not start:\n" + "\n".join(self.server.log_tail(30)))

    def request(self, client: httpx.Client, prompt: str, max_tokens: int, name: str) -> dict:
        started = time.monotonic()
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        outcome: dict = {"request": name}
        try:
            response = client.post(self.server.url + "/v1/completions", json=body)
            outcome["status"] = response.status_code
            try:
                data = response.json()
            except ValueError:
                data = {"raw": response.text[:200]}
            error = data.get("error") if isinstance(data, dict) else None
            if isinstance(error, dict):
                outcome["code"] = error.get("code")
                outcome["message"] = str(error.get("message"))[:240]
            elif error is not None:
                outcome["message"] = str(error)[:240]
            usage = data.get("usage") if isinstance(data, dict) else None
            if usage:
                outcome["completion_tokens"] = usage.get("completion_tokens")
                outcome["prompt_tokens"] = usage.get("prompt_tokens")
            if response.headers.get("Retry-After"):
                outcome["retry_after"] = response.headers["Retry-After"]
        except httpx.TimeoutException:
            outcome["status"] = "timeout"
        except httpx.TransportError as e:
            outcome["status"] = f"connection: {type(e).__name__}"
        outcome["elapsed_s"] = round(time.monotonic() - started, 2)
        return outcome

    def wave(self, name: str) -> None:
        args = self.args
        memory_before = gpu_memory()
        with httpx.Client(timeout=args.request_timeout_s) as client, ThreadPoolExecutor(args.long) as pool:
            longs = [pool.submit(self.request, client,
                                 prompt_of(self.tokenizer, args.prompt_tokens, f"{self.kind} {name} {i}"),
                                 args.max_tokens, f"long-{i}")
                     for i in range(args.long)]
            results = [f.result() for f in longs]
            results.append(self.request(client, f"{self.kind} {name} short: hello", args.max_tokens, "short"))
        self.report["waves"].append({
            "wave": name,
            "gpu_memory_before": memory_before,
            "requests": results,
            "health_after": self.server.health(),
            "alive_after": self.server.alive(),
        })
        print(f"  {self.kind} {name}: " + ", ".join(f"{r['request']} {r['status']}"
                                                   + (f" {r['code']}" if r.get("code") else "")
                                                   for r in results), flush=True)

    def sdk_wave(self, release) -> None:
        """The long requests again, through the openai SDK, while the memory is held:
        ``release()`` frees it once each has been answered at least once. The SDK
        retries a 503 that says ``x-should-retry: true``, after its Retry-After."""
        import openai

        args, attempts, lock = self.args, {}, threading.Lock()

        def record(response: httpx.Response) -> None:
            name = response.request.headers.get("x-wave-request")
            with lock:
                attempts.setdefault(name, []).append(
                    {"status": response.status_code, "retry_after": response.headers.get("Retry-After"),
                     "at_s": round(time.monotonic() - started, 2)})

        def one(i: int) -> dict:
            name = f"long-{i}"
            outcome: dict = {"request": name}
            try:
                answer = client.completions.create(
                    model=str(self.model), max_tokens=args.max_tokens, temperature=0.0,
                    prompt=prompt_of(self.tokenizer, args.prompt_tokens, f"{self.kind} sdk {i}"),
                    extra_headers={"x-wave-request": name})
                outcome.update(status=200, completion_tokens=answer.usage.completion_tokens)
            except openai.APIStatusError as e:
                outcome.update(status=e.status_code, code=(e.body or {}).get("code") if isinstance(e.body, dict) else None)
            except openai.APIError as e:
                outcome.update(status=type(e).__name__)
            outcome["elapsed_s"] = round(time.monotonic() - started, 2)
            return outcome

        http_client = httpx.Client(timeout=args.request_timeout_s, event_hooks={"response": [record]})
        client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", http_client=http_client,
                               max_retries=args.sdk_retries)
        started = time.monotonic()
        with ThreadPoolExecutor(args.long) as pool:
            futures = [pool.submit(one, i) for i in range(args.long)]
            # Every request answered once (the shortage): then the memory comes back.
            poll_until(lambda: len(attempts) >= args.long, args.request_timeout_s, interval=0.1)
            released_at = round(time.monotonic() - started, 2)
            release()
            results = [f.result() for f in futures]
        http_client.close()
        for result in results:
            result["attempts"] = attempts.get(result["request"], [])
        self.report["waves"].append({"wave": "sdk_retries_across_release", "released_at_s": released_at,
                                     "requests": results, "health_after": self.server.health(),
                                     "alive_after": self.server.alive()})
        print(f"  {self.kind} sdk: released at {released_at} s; " + ", ".join(
            f"{r['request']} {r['status']} after {len(r['attempts'])} attempts" for r in results), flush=True)

    def warm_up(self) -> None:
        # Kernels are compiled at first use: not under the held memory.
        with httpx.Client(timeout=300) as client:
            self.report["warm_up"] = self.request(client, prompt_of(self.tokenizer, 2048, f"{self.kind} warm"),
                                                  4, "warm-up")

    def finish(self) -> None:
        server = self.server
        self.report["alive_at_end"] = server.alive()
        self.report["exit_code"] = server.proc.poll()
        if self.kind == "guardian":
            events = {name: server.log_events(name) for name in GUARDIAN_EVENTS}
            self.report["events"] = {name: len(found) for name, found in events.items()}
            self.report["engine_errors"] = [
                {k: e.get(k) for k in ("classification", "error_type", "error_message", "step",
                                       "failures_in_window", "blamed", "in_flight", "timestamp")}
                for e in events["engine_error"]]
            self.report["restart_ms"] = [e.get("duration_ms") for e in events["engine_restarted"]]
            self.report["kv_budget"] = [
                {k: e.get(k) for k in ("event", "kv_budget_bytes", "kv_budget_configured_bytes",
                                       "kv_budget_learned_bytes", "kv_budget_measured_bytes",
                                       "kv_in_use_bytes", "timestamp")}
                for e in events["kv_budget_lowered"] + events["kv_budget_restored"]]
            self.report["gave_up"] = [e.get("reason") for e in events["engine_gave_up"]]
        else:
            lines = server.log_path.read_text(errors="replace").splitlines()
            self.report["stock_errors"] = [line[:300] for line in lines
                                           if "Error" in line or "out of memory" in line][:12]
        server.stop()


class Holder:
    """Another process holding all but ``keep_gib`` of the GPU's free memory."""

    def __init__(self, keep_gib: float):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(keep_gib)], stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        self.info = json.loads(line) if line.strip() else {"error": "the holder printed nothing"}

    def release(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def run_one(kind: str, model: Path, args, folder: Path, tokenizer) -> dict:
    run = Run(kind, model, args, folder, tokenizer)
    run.start()
    print(f"{kind}: ready in {run.report['start_s']} s", flush=True)
    holder = None
    try:
        run.warm_up()
        run.report["gpu_memory_loaded"] = gpu_memory()
        if args.hold == "torch":
            holder = Holder(args.keep_free_gib)
            run.report["holder"] = holder.info
        run.wave("pressure")
        run.wave("pressure_again")
        if args.sdk_retries:
            run.sdk_wave(holder.release if holder is not None else lambda: None)
            holder = None
        elif holder is not None:
            holder.release()
            holder = None
        released_at = time.monotonic()
        # The guardian looks at memory every 0.5 s: let it see the memory back.
        poll_until(lambda: time.monotonic() - released_at > args.settle_s, args.settle_s + 1, interval=0.2)
        run.report["health"]["after_release"] = run.server.health()
        run.wave("freed")
    finally:
        if holder is not None:
            holder.release()
        run.finish()
    return run.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="stock,guardian")
    parser.add_argument("--hold", choices=("torch", "none"), default="torch")
    parser.add_argument("--keep-free-gib", type=float, default=1.5)
    parser.add_argument("--prompt-tokens", type=int, default=12000)
    parser.add_argument("--long", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--request-timeout-s", type=float, default=40.0)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--sdk-retries", type=int, default=8,
                        help="the openai SDK's max_retries in the wave that spans the release (0: no such wave)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_oom.json"))
    args = parser.parse_args()

    from transformers import PreTrainedTokenizerFast

    folder = Path(tempfile.mkdtemp(prefix="gpu-oom-"))
    context = max(32768, args.prompt_tokens * 2)
    model = build_model(folder, args.kv_layers, args.kv_heads, args.head_dim, context)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    kv_per_token = 2 * args.kv_layers * args.kv_heads * args.head_dim * 4
    report = {
        "environment": environment(),
        "gpu": gpu_memory(),
        "config": {**vars(args), "kv_bytes_per_token": kv_per_token,
                   "kv_bytes_per_long_request": kv_per_token * (args.prompt_tokens + args.max_tokens)},
        "runs": {},
    }
    print(report["environment"], f"KV {kv_per_token // 1024} KiB/token", flush=True)
    for kind in args.servers.split(","):
        try:
            report["runs"][kind] = run_one(kind, model, args, folder, tokenizer)
        except Exception as e:  # a rehearsal: record and go on to the other server
            report["runs"][kind] = {"kind": kind, "error": f"{type(e).__name__}: {e}"}
            print(f"{kind}: {type(e).__name__}: {e}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(summary(report))
    print(f"written to {args.out}")


def summary(report: dict) -> str:
    """A markdown table: per server and wave, what the clients got."""
    lines = ["| server | wave | long requests | short | /health after |", "|---|---|---|---|---|"]
    for kind, run in report["runs"].items():
        for wave in run.get("waves", []):
            longs = Counter(f"{r['status']}" + (f" {r['code']}" if r.get("code") else "")
                            for r in wave["requests"] if r["request"].startswith("long"))
            short = next((r for r in wave["requests"] if r["request"] == "short"), {})
            lines.append(f"| {kind} | {wave['wave']} | "
                         + ", ".join(f"{n}x {k}" for k, n in longs.items())
                         + f" | {short.get('status', '-')} {short.get('code') or ''} | {wave['health_after']} |")
    guardian = report["runs"].get("guardian", {})
    if guardian.get("engine_errors") is not None:
        lines.append("")
        lines.append(f"guardian: {len(guardian['engine_errors'])} engine errors "
                     f"({Counter(e['classification'] for e in guardian['engine_errors'])}), "
                     f"restarts {guardian.get('restart_ms')} ms, events {guardian.get('events')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""The prompt guard's own cost per request, measured without the network.

End-to-end throughput on a shared 2-CPU machine moves by several percent
from one round to the next (see bench_prompt_guard.py); the guard's share
is far below that. This script builds the guardian's engine in-process, as
``mlx-guardian`` does (stock parses the flags, the plugins load from the
default configuration, the demo model is served), and times for N chat
requests of ~110 prompt tokens:

- ``gate.admit``: everything the HTTP thread does before enqueueing,
  with the ``prompt_guard`` plugin on (tokenize, limits, KV budget);
- stock's ``_tokenize`` alone, the work stock itself does for the same
  request on its generation thread, and which admission takes off it.

Usage::

    python bench/admission_cost.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

SENTENCE = "The guardian watches a language model server and keeps it alive. "


def build_guardian():
    """The engine with its admission and watchdog, as ``guardian.serving.assembly.serve`` wires them."""
    from guardian import cli, stock
    from guardian.demo_model import ensure_demo_model
    from guardian.serving.assembly import ServedModel

    captured = {}

    def capture(host, port, model_provider, *args, **kwargs):
        captured["model_provider"] = model_provider

    sys.argv = ["mlx-guardian", "--model", str(ensure_demo_model()), "--log-level", "WARNING"]
    stock.handler.run_stock_main(capture, add_arguments=cli.add_guardian_arguments, after_parse=cli.prepare)
    model_provider = captured["model_provider"]
    model_provider.load_default()
    config, pm = model_provider.cli_args.guardian_runtime
    served = ServedModel(model_provider, config, pm, on_exit=lambda code: None)
    pm.hook.guardian_startup(engine=served.engine.plugin_view, config=config)
    return served


def chat_request(i: int):
    from guardian import stock

    return stock.contract.server.CompletionRequest(
        "chat", "", [{"role": "user", "content": f"Request {i}. " + SENTENCE * 6}], None, None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()

    from guardian import stock
    from guardian.request_context import request_scope

    served = build_guardian()
    engine, gate = served.engine, served.gate
    cli_args = engine.cli_args
    admit_ms, tokenize_ms = [], []
    for i in range(args.requests):
        _, generation_args = stock.requests.make_request("", max_tokens=128, cli_args=cli_args)
        with request_scope(f"bench-{i}", stream=True):
            started = time.perf_counter()
            admission = gate.admit(chat_request(i), generation_args, engine=engine.plugin_view)
            admit_ms.append((time.perf_counter() - started) * 1000)
            admission.finish()
        started = time.perf_counter()
        stock.requests.tokenize_as_stock(engine.model_provider, engine.model_provider.tokenizer, chat_request(i),
                                         generation_args)
        tokenize_ms.append((time.perf_counter() - started) * 1000)

    def describe(values):
        ordered = sorted(values)
        return (f"median {statistics.median(ordered):.3f} ms, "
                f"p99 {ordered[int(len(ordered) * 0.99)]:.3f} ms")

    print(f"{args.requests} chat requests of {len(admission.prompt_tokens)} prompt tokens, "
          f"mlx-lm {stock.contract.STOCK_VERSION}")
    print(f"admission (prompt_guard on), HTTP thread: {describe(admit_ms)}")
    print(f"stock _tokenize alone, the generation thread's work it replaces: {describe(tokenize_ms)}")
    print(f"the guard's own work: {statistics.median(admit_ms) - statistics.median(tokenize_ms):.3f} ms "
          "a request (median difference)")
    stock.loop.stop_generation_thread(engine)
    os._exit(0)  # the engine's threads are daemons of a server that never served


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # The engine's threads outlive a failure here, and one is no daemon: say what
        # failed and leave, rather than wait for them for ever.
        traceback.print_exc()
        os._exit(1)

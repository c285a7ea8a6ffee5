"""Run a server module with its engine steps counted: ``python bench/profiled_server.py OUT -m MODULE ARGS``.

Counts ``BatchGenerator.next`` calls, those that prefilled a prompt, the
tokens each step generated (the decode batch size) and the time spent in
them. SIGUSR1 writes the counts,
with the live threads' names, to OUT as JSON; SIGUSR2 sets them to zero.
Used by bench/engine_profile.py; the server itself runs unchanged.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time
from collections import Counter

from mlx_lm.generate import BatchGenerator

counts = {"steps": 0, "prefill_steps": 0, "step_s": 0.0, "batch_sizes": Counter()}
stock_next = BatchGenerator.next


def counted_next(self):
    started = time.perf_counter()
    prompt_responses, generation_responses = stock_next(self)
    counts["step_s"] += time.perf_counter() - started
    counts["steps"] += 1
    counts["prefill_steps"] += bool(prompt_responses)
    counts["batch_sizes"][len(generation_responses)] += 1
    return prompt_responses, generation_responses


def write_counts(out_path: str) -> None:
    threads = {thread.native_id: thread.name for thread in threading.enumerate()}
    with open(out_path + ".part", "w") as out:
        json.dump({**counts, "threads": threads}, out)
    # Renamed into place, so a reader never sees half a file.
    os.replace(out_path + ".part", out_path)


def reset_counts() -> None:
    counts.update(steps=0, prefill_steps=0, step_s=0.0, batch_sizes=Counter())


def main() -> None:
    out_path, flag, module, *args = sys.argv[1:]
    if flag != "-m":
        raise SystemExit(__doc__)
    BatchGenerator.next = counted_next
    signal.signal(signal.SIGUSR1, lambda *_: write_counts(out_path))
    signal.signal(signal.SIGUSR2, lambda *_: reset_counts())
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

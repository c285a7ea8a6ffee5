"""Faults planted inside stock's loop: a step that blocks, a loop that never
starts, a request that fails the loop once.

A test plugin (``[guardian] plugins = ["tests.plugins.loop_faults:LoopFaults"]``),
planted the way ``request_faults`` plants its faults: in stock's own
functions, triggered by ordinary parameters of one request, so no step
count has to be guessed.

- ``fail_once_stop_word``: stock's loop raises while it prepares the first
  request with this stop word (in ``ResponseGenerator._make_state_machine``):
  the request is taken, never started; its re-run is prepared normally.
- ``hang_repetition_penalty``: a request with exactly this
  ``repetition_penalty`` gets one more logits processor from stock's
  ``make_logits_processors``, which blocks at its ``hang_at_call``-th call,
  inside ``BatchGenerator``'s step, as a native deadlock would. Only the
  first ``hang_times`` such requests block (0: every one); or, with
  ``hang_which``, those of these numbers (1-based, a re-run counting as one).
- ``wedge``: once such a request's step blocks, every later step of stock's
  ``BatchGenerator.next`` blocks too, whatever it runs, on any loop thread (a
  device that hung: no probe, no other request generates again).
- ``hang_loop_start``: the Nth start of stock's loop (its ``load_default``
  on a loop thread; the first start is 1) blocks before the loop ever asks
  for work.

- ``log_model_loads``: log ``stock_model_loaded`` each time stock's
  ``ModelProvider._load`` reads a model's weights (a reload shows there).
- ``hang_model_load``: the Nth call of ``ModelProvider._load`` (the first
  is the load at start) blocks before it reads anything, as a read of the
  weights from a hung disk would; then it loads. Once the thread that read
  it has exited, ``late_model_load_checked`` says whether the model it read
  is the one the server's provider serves (``served``).

A hang lasts ``hang_s`` seconds, or with 0 until the server shuts down.
``loop_fault_hang`` is logged when one begins, ``loop_fault_hang_ended``
when the blocked call returns to stock's code.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from dataclasses import dataclass, field

import mlx_lm.server as server
import structlog

import guardian

log = structlog.get_logger("tests.loop_faults")


class PlantedFault(RuntimeError):
    pass


@dataclass
class LoopFaultsSettings:
    fail_once_stop_word: str = ""
    hang_repetition_penalty: float = 0.0
    hang_at_call: int = 1
    hang_times: int = 1
    hang_which: list = field(default_factory=list)
    wedge: bool = False
    hang_loop_start: int = 0
    hang_s: float = 0.0
    log_model_loads: bool = False
    hang_model_load: int = 0


class LoopFaults:
    name = "loop_faults"
    Settings = LoopFaultsSettings

    def __init__(self, settings: LoopFaultsSettings):
        self.settings = settings
        self.released = threading.Event()
        self._lock = threading.Lock()
        if settings.fail_once_stop_word:
            self._plant_fail_once(settings.fail_once_stop_word)
        if settings.hang_repetition_penalty:
            self._plant_hang_in_step(settings.hang_repetition_penalty)
        self.wedged = threading.Event()
        if settings.wedge:
            self._plant_wedge()
        if settings.hang_loop_start:
            self._plant_hang_at_loop_start(settings.hang_loop_start)
        if settings.log_model_loads or settings.hang_model_load:
            self._plant_in_model_load(settings.hang_model_load)

    @guardian.hookimpl
    def guardian_startup(self):
        log.warning("loop_faults_planted", **vars(self.settings))

    @guardian.hookimpl
    def guardian_shutdown(self):
        self.released.set()

    def _hang(self, kind: str) -> None:
        if kind == "step" and self.settings.wedge:
            self.wedged.set()
        log.warning("loop_fault_hang", kind=kind, thread=threading.current_thread().name)
        self.released.wait(self.settings.hang_s or None)
        log.warning("loop_fault_hang_ended", kind=kind, thread=threading.current_thread().name)

    def _plant_fail_once(self, stop_word: str) -> None:
        stock_method = server.ResponseGenerator._make_state_machine
        failed = threading.Event()

        def make_state_machine(generator, model_key, tokenizer, stop_words, *args, **kwargs):
            if stop_word in stop_words and not failed.is_set():
                failed.set()
                raise PlantedFault(f"planted fault while preparing a request with stop word {stop_word!r}")
            return stock_method(generator, model_key, tokenizer, stop_words, *args, **kwargs)

        server.ResponseGenerator._make_state_machine = make_state_machine

    def _plant_hang_in_step(self, penalty: float) -> None:
        stock_factory = server.make_logits_processors
        plugin = self
        hung = [0]

        def make_logits_processors(logit_bias=None, repetition_penalty=None, *args, **kwargs):
            processors = stock_factory(logit_bias, repetition_penalty, *args, **kwargs)
            if repetition_penalty != penalty:
                return processors
            with plugin._lock:
                limit, which = plugin.settings.hang_times, plugin.settings.hang_which
                hung[0] += 1
                if (which and hung[0] not in which) or (not which and limit and hung[0] > limit):
                    return processors
            calls = 0

            def blocking_processor(tokens, logits):
                nonlocal calls
                calls += 1
                if calls == plugin.settings.hang_at_call:
                    plugin._hang("step")
                return logits

            return [*processors, blocking_processor]

        server.make_logits_processors = make_logits_processors

    def _plant_wedge(self) -> None:
        # mlx_lm's own class: the guardian's observed subclass calls it through super().next().
        generate = importlib.import_module("mlx_lm.generate")
        stock_next = generate.BatchGenerator.next
        plugin = self

        def next(generator, *args, **kwargs):
            if plugin.wedged.is_set():
                plugin._hang("wedged_step")
            return stock_next(generator, *args, **kwargs)

        generate.BatchGenerator.next = next

    def _plant_hang_at_loop_start(self, nth: int) -> None:
        stock_method = server.ModelProvider.load_default
        plugin = self
        starts = [0]

        def load_default(provider, *args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                with plugin._lock:
                    starts[0] += 1
                    this_start = starts[0]
                if this_start == nth:
                    plugin._hang("loop_start")
            return stock_method(provider, *args, **kwargs)

        server.ModelProvider.load_default = load_default

    def _plant_in_model_load(self, hang_at: int) -> None:
        stock_method = server.ModelProvider._load
        stock_load_default = server.ModelProvider.load_default
        plugin = self
        loads = [0]
        served = []  # the provider the server's loops load from

        def load_default(provider, *args, **kwargs):
            if not served:
                served.append(provider)
            return stock_load_default(provider, *args, **kwargs)

        def load(provider, *args, **kwargs):
            with plugin._lock:
                loads[0] += 1
                this_load = loads[0]
            if this_load == hang_at:
                plugin._hang("model_load")
            result = stock_method(provider, *args, **kwargs)
            log.warning("stock_model_loaded", thread=threading.current_thread().name)
            if this_load == hang_at:
                check_when_gone(threading.current_thread(), provider.model)
            return result

        def check_when_gone(reader: threading.Thread, model) -> None:
            def check():
                deadline = time.monotonic() + 30
                while not left_the_loop(reader) and time.monotonic() < deadline:
                    reader.join(timeout=0.05)
                log.warning("late_model_load_checked", reader_left=left_the_loop(reader),
                            served=bool(served) and served[0].model is model)

            threading.Thread(target=check, name="late-load-check", daemon=True).start()

        server.ModelProvider.load_default = load_default

        server.ModelProvider._load = load


def left_the_loop(thread: threading.Thread) -> bool:
    """Whether an abandoned loop thread has left stock's loop: ended, or parked by
    the engine (its innermost frame waits, called from ``run_guarded``)."""
    frame = sys._current_frames().get(thread.ident) if thread.is_alive() else None
    if frame is None:
        return True
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return "run_guarded" in names and "_restart_until_stopped" not in names and names[0] == "wait"

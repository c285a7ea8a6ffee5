"""Faults planted inside stock's own code, triggered by one request's parameters.

A test plugin (``[guardian] plugins = ["tests.plugins.request_faults:RequestFaults"]``;
the server runs with the repository root as its cwd, so ``tests`` is a
namespace package). No validation at the door can stop these: the values
that trigger them are ordinary, valid parameters.

- ``stop_marker``: stock's loop raises while it prepares a request with
  this stop word (in ``ResponseGenerator._make_state_machine``, before the
  request's GenerationContext): the request is taken, never started.
- ``poison_repetition_penalty``: a request with exactly this
  ``repetition_penalty`` gets one more logits processor from stock's
  ``make_logits_processors``, which ``BatchGenerator`` calls at every step
  for that request's row, and which raises from its
  ``processor_fails_at``-th call on.
- ``poison_temperature``: stock's ``make_sampler`` raises while the loop
  builds the sampler of a request with exactly this ``temperature`` (after
  its GenerationContext).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx_lm.server as server
import structlog

import guardian

log = structlog.get_logger("tests.request_faults")


class PlantedFault(RuntimeError):
    pass


@dataclass
class RequestFaultsSettings:
    stop_marker: str = ""
    poison_repetition_penalty: float = 0.0
    processor_fails_at: int = 1
    poison_temperature: float = 0.0


class RequestFaults:
    name = "request_faults"
    Settings = RequestFaultsSettings

    def __init__(self, settings: RequestFaultsSettings):
        self.settings = settings
        if settings.stop_marker:
            self._plant_in_state_machine(settings.stop_marker)
        if settings.poison_repetition_penalty:
            self._plant_in_logits_processors(settings.poison_repetition_penalty, settings.processor_fails_at)
        if settings.poison_temperature:
            self._plant_in_sampler_factory(settings.poison_temperature)

    @guardian.hookimpl
    def guardian_startup(self):
        log.warning("request_faults_planted", **vars(self.settings))

    @staticmethod
    def _plant_in_state_machine(marker: str) -> None:
        stock_method = server.ResponseGenerator._make_state_machine

        def make_state_machine(self, model_key, tokenizer, stop_words, *args, **kwargs):
            if marker in stop_words:
                raise PlantedFault(f"planted fault while preparing a request with stop word {marker!r}")
            return stock_method(self, model_key, tokenizer, stop_words, *args, **kwargs)

        server.ResponseGenerator._make_state_machine = make_state_machine

    @staticmethod
    def _plant_in_logits_processors(penalty: float, fails_at: int) -> None:
        stock_factory = server.make_logits_processors

        def make_logits_processors(logit_bias=None, repetition_penalty=None, *args, **kwargs):
            processors = stock_factory(logit_bias, repetition_penalty, *args, **kwargs)
            if repetition_penalty != penalty:
                return processors
            calls = 0

            def poisoned_processor(tokens, logits):
                nonlocal calls
                calls += 1
                if calls >= fails_at:
                    raise PlantedFault(f"planted fault in a logits processor at call {calls}")
                return logits

            return [*processors, poisoned_processor]

        server.make_logits_processors = make_logits_processors

    @staticmethod
    def _plant_in_sampler_factory(temperature: float) -> None:
        stock_factory = server.make_sampler

        def make_sampler(temp=0.0, *args, **kwargs):
            if temp == temperature:
                raise PlantedFault(f"planted fault building a sampler for temperature {temp}")
            return stock_factory(temp, *args, **kwargs)

        server.make_sampler = make_sampler

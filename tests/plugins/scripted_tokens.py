"""A model that says what the test wrote: a script of tokens, forced one per step.

A test plugin (``[guardian] plugins = ["tests.plugins.scripted_tokens:ScriptedTokens"]``).
The demo model's weights are random: a tool call, for one, has to be written
for it. A request with exactly ``repetition_penalty`` gets one more logits
processor (beside stock's, through mlx_lm's own ``make_logits_processors``)
that forces the next token of ``token_ids``: the one after the longest start
of the script that the tokens so far end with. So a continuation (the tokens
already sent appended to the prompt) goes on with the script where the cut
left it, as a real model would go on with what it was writing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx_lm.server as server


@dataclass
class ScriptedTokensSettings:
    token_ids: list = field(default_factory=list)
    repetition_penalty: float = 1.01


class ScriptedTokens:
    name = "scripted_tokens"
    Settings = ScriptedTokensSettings

    def __init__(self, settings: ScriptedTokensSettings):
        self.settings = settings
        stock_factory = server.make_logits_processors
        script = [int(t) for t in settings.token_ids]

        def make_logits_processors(logit_bias=None, repetition_penalty=None, *args, **kwargs):
            processors = stock_factory(logit_bias, repetition_penalty, *args, **kwargs)
            if repetition_penalty != settings.repetition_penalty or not script:
                return processors
            return [*processors, force_script]

        def force_script(tokens, logits):
            done = written_so_far(tokens.reshape(-1)[-len(script):].tolist(), script)
            if done == len(script):
                return logits
            forced = mx.full(logits.shape, -1e9, dtype=logits.dtype)
            forced[..., script[done]] = 0
            return forced

        server.make_logits_processors = make_logits_processors


def written_so_far(tail: list[int], script: list[int]) -> int:
    """How much of ``script`` the tokens ending in ``tail`` have written: the
    longest start of it that ``tail`` ends with (all of it: the script is done)."""
    for length in range(min(len(tail), len(script)), 0, -1):
        if tail[-length:] == script[:length]:
            return length
    return 0

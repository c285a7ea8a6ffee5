"""The built-in probe: one real token through the engine users' requests use.

Goes through the same request queue, stock loop and BatchGenerator as any
completion, so it fails when they do. Its prompt is kept out of the prompt
cache, and it never passes through the HTTP layer or its access log.
"""

from __future__ import annotations

import guardian
from guardian.config.registry import Setting, Str, Table


class GenerationProbeSettings(Table, name="generation_probe"):
    prompt = Setting(Str(nonempty=True), "mlx-guardian probe", """
        The synthetic probe: one token of a text completion with this prompt,
        through the same queue and engine as users' requests; kept out of the
        prompt cache and the access log. Keep it short: it runs every probe.""", live=True)


class GenerationProbe:
    name = "generation_probe"
    Settings = GenerationProbeSettings

    def __init__(self, settings: GenerationProbeSettings):
        self.settings = settings

    @guardian.hookimpl
    def guardian_startup(self, engine):
        engine.keep_out_of_prompt_cache(self.settings.prompt)

    @guardian.hookimpl
    def on_config_reloaded(self, engine, changed):
        if f"{self.name}.prompt" in changed:
            engine.keep_out_of_prompt_cache(self.settings.prompt)

    @guardian.hookimpl
    def probe(self, engine, timeout_s):
        result = engine.probe(self.settings.prompt, timeout_s)
        return {"name": "generation", **result}

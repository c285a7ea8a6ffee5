"""Probe prompts are kept out of the prompt cache (guardian.engine.probes): a probe must
not evict users' caches. Each save that changed ``[generation_probe] prompt`` added one
for good to the list every cache insert checks (20 saves: 21)."""

from __future__ import annotations

from types import SimpleNamespace

from guardian.engine.memory import GuardianPromptCache
from guardian.engine.probes import SKIPPED_PROMPTS, Probes


class CharTokenizer:
    """A stand-in with the one method used: a token per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def probes_with_a_cache() -> Probes:
    cache = GuardianPromptCache(engine_thread_check=lambda: None)
    engine = SimpleNamespace(prompt_cache=cache, model_provider=SimpleNamespace(tokenizer=CharTokenizer()))
    return Probes(engine)


def test_the_prompts_kept_out_are_the_latest_few_each_once():
    probes = probes_with_a_cache()
    cache = probes.engine.prompt_cache
    for saved in range(20):
        probes.keep_out_of_prompt_cache(f"probe prompt {saved}")
        probes.keep_out_of_prompt_cache(f"probe prompt {saved}")  # a reload of an unchanged file
    assert len(cache.skip_prefixes) == SKIPPED_PROMPTS
    assert cache.skip_prefixes[-1] == CharTokenizer().encode("probe prompt 19")
    # A prompt used again moves to the end, once.
    probes.keep_out_of_prompt_cache("probe prompt 15")
    assert cache.skip_prefixes.count(CharTokenizer().encode("probe prompt 15")) == 1
    assert cache.skip_prefixes[-1] == CharTokenizer().encode("probe prompt 15")

"""Flag combinations that can never work, refused at start with exit code 2.

Stock accepts them and then fails every request (or loops forever): for
example ``--kv-bits`` with a quantization group size that does not divide
the model's head dimension raises in ``mx.quantize`` at the first cached
token of every request. A server that can serve nothing should not start.
"""

from __future__ import annotations

import argparse

from guardian.admission.facts import context_length_from_config, text_config
from guardian import stock

# Flags stock reads as counts, and the least value that can work: a prefill
# step of 0 tokens never ends a prompt, a batch of 0 never decodes, and
# stock's handler refuses a max_tokens below its least.
AT_LEAST = {
    "prefill_step_size": 1,
    "decode_concurrency": 1,
    "prompt_concurrency": 1,
    "max_tokens": stock.contract.MIN_MAX_TOKENS,
    "num_draft_tokens": 0,
    "top_k": 0,
    "temp": 0,
}
# Sampling defaults that are probabilities.
FRACTIONS = ("top_p", "min_p")


def impossible_flags(cli_args: argparse.Namespace, model_config: dict) -> list[str]:
    """What is wrong with these flags for this model, one sentence each; empty when nothing is."""
    problems = []
    for name, least in AT_LEAST.items():
        value = getattr(cli_args, name, None)
        if isinstance(value, (int, float)) and value < least:
            problems.append(f"{flag(name)} must be at least {least}; got {value}")
    for name in FRACTIONS:
        value = getattr(cli_args, name, None)
        if isinstance(value, (int, float)) and not 0 <= value <= 1:
            problems.append(f"{flag(name)} must be between 0 and 1; got {value}")
    problems.extend(kv_quantization_problems(cli_args, model_config))
    return problems


def kv_quantization_problems(cli_args: argparse.Namespace, model_config: dict) -> list[str]:
    """Whether mlx can quantize this model's KV cache as --kv-bits/--kv-group-size ask (0.31 has neither),
    where a request can reach the quantization: past --quantized-kv-start, within the model's context
    (past the context the prompt guard refuses a prompt, and clamps max_tokens to it)."""
    bits = getattr(cli_args, "kv_bits", None)
    if bits is None:
        return []
    start = getattr(cli_args, "quantized_kv_start", 0)
    context_length = context_length_from_config(model_config)[0]
    if context_length is not None and isinstance(start, int) and start >= context_length:
        return []  # stock serves every request that fits, unquantized, and so does the guardian
    import mlx.core as mx

    group_size = getattr(cli_args, "kv_group_size", 64)
    problems = []
    for dimension in kv_head_dimensions(model_config):
        try:
            # The cache quantizes keys and values along the head dimension;
            # mlx itself says whether it can.
            mx.eval(mx.quantize(mx.zeros((1, dimension)), group_size=group_size, bits=bits))
        except (ValueError, RuntimeError) as e:
            problems.append(
                f"--kv-bits {bits} --kv-group-size {group_size} cannot quantize this model's "
                f"KV cache (head dimension {dimension}), as every request past --quantized-kv-start "
                f"{start} tokens would need{within(context_length)}: {e}"
            )
            break
    return problems


def within(context_length) -> str:
    return f" (the model's context holds {context_length})" if context_length else ""


def kv_head_dimensions(config: dict) -> set[int]:
    """The last dimensions of the keys and values a model caches; empty when the config does not say."""
    config = text_config(config)
    if config.get("kv_lora_rank"):
        return set()  # latent attention caches other shapes; leave it to stock
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (
        config.get("hidden_size") // heads if config.get("hidden_size") and heads else None
    )
    dimensions = {head_dim, config.get("v_head_dim")}
    return {d for d in dimensions if isinstance(d, int) and d > 0}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")

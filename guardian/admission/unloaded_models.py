"""What admission knows of a model before its weights load.

A request may name another model when the configuration allows it
(``[guardian] allowed_models``). Stock loads it on the generation thread
when the request gets there, so its tokenizer does not exist at the door,
and without this the request would skip admission: a prompt over that
model's context would be prefilled, and weights larger than the machine
would be loaded. Its config.json, its tokenizer files and the size of its
weight files are on disk before any of that: read them, once per model,
and admit the request against them.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Optional

import structlog

from guardian.admission.facts import (
    KVLayer,
    ModelLimits,
    context_length_from_config,
    kv_bytes_per_token,
    quantized_fraction,
    text_config,
    vocab_size_from_config,
)

log = structlog.get_logger("guardian.unloaded_models")

# Models whose tokenizer stays in memory for admission, least recently used first out.
MAX_REMEMBERED = 4
# Bytes per element of the float dtypes a config names; 2 when it names none.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def local_model_path(model: str) -> Optional[Path]:
    """The folder of a local model, or of a hub model in the cache; None when neither
    (stock would download it: nothing can be read before)."""
    from mlx_lm.utils import hf_repo_to_path

    path = Path(model)
    if path.is_dir():
        return path
    try:
        return hf_repo_to_path(model)
    except Exception:  # noqa: BLE001 - not in the cache (or no hub id at all): not on this machine
        return None


def limits_from_config(config: dict, weights_bytes: int, *, kv_bits=None, kv_group_size=64,
                       quantized_kv_start=0) -> ModelLimits:
    """ModelLimits of a model that is not loaded: every attention layer holds the whole
    sequence (no sliding window is known before the model is built, so this errs high)."""
    dtype = str(text_config(config).get("torch_dtype") or "float16")
    itemsize = DTYPE_BYTES.get(dtype, 2)
    layers = int(text_config(config).get("num_hidden_layers") or 1)
    per_layer = kv_bytes_per_token(config, itemsize)
    context_length, key = context_length_from_config(config)
    fraction = quantized_fraction(kv_bits, kv_group_size, itemsize) if kv_bits else None
    return ModelLimits(context_length, key, tuple(KVLayer(per_layer) for _ in range(layers)),
                       dtype, weights_bytes, fraction, quantized_kv_start, vocab_size_from_config(config))


def weights_on_disk(path: Path) -> int:
    """Bytes of the model's weight files: what loading it will take, at least."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


class UnloadedModels:
    """(tokenizer, limits) of models that may be switched to, read from disk once each."""

    def __init__(self, cli_args):
        self.cli_args = cli_args
        self._remembered: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, model_key: tuple) -> Optional[tuple]:
        """(tokenizer, ModelLimits) for a model key, or None when the model is not on this machine."""
        with self._lock:
            if model_key in self._remembered:
                self._remembered.move_to_end(model_key)
                return self._remembered[model_key]
        path = local_model_path(model_key[0]) if isinstance(model_key[0], str) else None
        if path is None:
            return None
        entry = self._read(path)
        with self._lock:
            self._remembered[model_key] = entry
            while len(self._remembered) > MAX_REMEMBERED:
                self._remembered.popitem(last=False)
        return entry

    def _read(self, path: Path) -> tuple:
        from mlx_lm.utils import load_config, load_tokenizer

        cli = self.cli_args
        # The tokenizer settings stock's ModelProvider gives every model it loads.
        extra = {"trust_remote_code": cli.trust_remote_code}
        if cli.chat_template:
            extra["chat_template"] = cli.chat_template
        tokenizer = load_tokenizer(path, extra)
        limits = limits_from_config(load_config(path), weights_on_disk(path),
                                    kv_bits=getattr(cli, "kv_bits", None),  # 0.31 has none
                                    kv_group_size=getattr(cli, "kv_group_size", 64),
                                    quantized_kv_start=getattr(cli, "quantized_kv_start", 0))
        log.info("unloaded_model_read", model=str(path), weights_bytes=limits.weights_bytes,
                 context_length=limits.context_length)
        return tokenizer, limits

"""A request at the door, and what the model it goes to can take.

``Admission`` is what ``admit_request`` hooks see: the request, its prompt
tokens (computed on the HTTP thread with stock's own ``_tokenize`` and then
reused by the engine, so a request is tokenized once), and what a hook
changed: a lower ``max_tokens``, fewer messages, response headers, a
resource to give back when the request ends.

``ModelLimits`` is what a hook compares it with: the context length from
the model's config and the bytes of KV cache a request of n tokens needs.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import math
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import structlog

from guardian.admission.cgroup_memory import cgroup_memory_limit

log = structlog.get_logger("guardian.admission")


# -- the request --------------------------------------------------------------
@dataclasses.dataclass
class Variant:
    """The request with other messages, tokenized; see ``Admission.variant``."""

    request: Any
    tokenized: tuple

    @property
    def n_prompt_tokens(self) -> int:
        return len(self.tokenized[0])


class Admission:
    """One request on its way in, as ``admit_request`` hooks see it.

    ``tokenize(request)`` returns stock's ``_tokenize`` tuple for a request;
    it runs at most once per request (and once per variant), only when a
    hook asks for tokens.
    """

    def __init__(self, request, args, *, limits, tokenize: Callable, request_id: str, stream: bool,
                 client: str = "-", carried_tokens: int = 0):
        self.request = request
        self.args = args
        # A supervisor's continuation of a stream a dead child began: the tokens it goes on
        # after, in the engine's prompt after the client's (``args.max_tokens`` is what is
        # left of the client's). The context holds them as it held them on the first run.
        self.carried_tokens = carried_tokens
        self.limits: ModelLimits = limits
        self.request_id = request_id
        self.stream = stream
        # Who sent it: an API key's name, or the client's address (guardian.access).
        self.client = client
        # Headers added to this request's response (a clamp, a truncation).
        self.response_headers: dict[str, str] = {}
        # Fields added to every later log line of this request.
        self.log_fields: dict[str, Any] = {}
        self._tokenize = tokenize
        self._tokenized: Optional[tuple] = None
        self._on_finish: list[Callable[[], None]] = []
        self._finished = False
        # Turned away before the engine ran it (a later hook, the engine): set before ``finish``.
        self.refused = False
        self._lock = threading.Lock()

    @property
    def is_chat(self) -> bool:
        return self.request.request_type == "chat"

    @property
    def tokenized(self) -> Optional[tuple]:
        """Stock's ``_tokenize`` tuple, or None when no hook asked for tokens."""
        return self._tokenized

    @property
    def prompt_tokens(self) -> list[int]:
        if self._tokenized is None:
            self._tokenized = self._tokenize(self.request)
        return self._tokenized[0]

    @property
    def n_prompt_tokens(self) -> int:
        return len(self.prompt_tokens)

    def variant(self, messages: list) -> Variant:
        """The request with ``messages`` instead, tokenized; nothing changes yet.

        Stock's tokenizer code rewrites messages in place (tool-call arguments,
        content parts), so each variant tokenizes its own copy.
        """
        request = dataclasses.replace(self.request, messages=copy.deepcopy(messages))
        return Variant(request, self._tokenize(request))

    def adopt(self, variant: Variant) -> None:
        """Send ``variant`` to the engine instead of the request as it came."""
        self.request = variant.request
        self._tokenized = variant.tokenized

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the request ends, however it ends."""
        with self._lock:
            finished = self._finished
            if not finished:
                self._on_finish.append(callback)
        if finished:
            callback()

    def finish(self) -> None:
        """The request ended (or was refused): run the ``on_finish`` callbacks once."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            callbacks, self._on_finish = self._on_finish, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("admission_finish_failed", request_id=self.request_id)


# -- private tokenizers ---------------------------------------------------------
# A prompt of more characters than this (~64K tokens of English) tokenizes for long enough
# (a 4 MB one took 7.5 s here) to be kept out of the pool's last copy.
LARGE_PROMPT_CHARS = 256 * 1024
# How often a request waiting its turn (a tokenizer's copy, KV memory) looks whether its
# client left or its deadline passed.
GAVE_UP_CHECK_S = 0.1


def prompt_chars(request) -> int:
    """About how many characters a stock CompletionRequest's prompt has: every string in
    its prompt, messages and tools (no copy, no JSON of it)."""
    stack, total = [request.prompt, request.messages, request.tools], 0
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class TokenizerPool:
    """Private copies of a tokenizer for the HTTP threads.

    A fast tokenizer shared between threads can fail with ``RuntimeError:
    Already borrowed`` (huggingface/tokenizers#537, transformers#47085); the
    engine thread tokenizes too (stop words, samplers), and an exception
    there would kill the loop. So admission never touches the engine's
    tokenizer: it borrows a deep copy, made on first need, at most ``size``.

    A large prompt (``large``) takes one of ``size - 1`` copies at most, so one
    is always left for the others: two 4 MB prompts, each to be refused after
    7.5 s of tokenizing, held both copies of this 2-core machine, and a "hi"
    sent meanwhile waited 7.3 s (found by a review). A request that waits
    gives up when ``gave_up`` raises (its client left, its deadline passed).
    """

    def __init__(self, tokenizer, size: int):
        # Weak, so that the pool (a value of _pools) does not keep its key alive.
        self._original = weakref.ref(tokenizer)
        self._size = size
        self._large_at_most = max(1, size - 1)
        self._idle: list = []
        self._made = 0
        self._large = 0  # copies large prompts hold
        self._cond = threading.Condition()

    def _free_for(self, large: bool) -> bool:
        if large and self._large >= self._large_at_most:
            return False
        return bool(self._idle) or self._made < self._size

    @contextlib.contextmanager
    def borrow(self, large: bool = False, gave_up: Callable[[], None] = lambda: None) -> Iterator[Any]:
        with self._cond:
            while not self._free_for(large):
                self._cond.wait(GAVE_UP_CHECK_S)
                gave_up()
            self._large += large
            if self._idle:
                tokenizer = self._idle.pop()
            else:
                self._made += 1
                tokenizer = None
        if tokenizer is None:
            try:
                tokenizer = copy.deepcopy(self._original())
            except BaseException:
                with self._cond:
                    self._made -= 1
                    self._large -= large
                    self._cond.notify_all()
                raise
        try:
            yield tokenizer
        finally:
            with self._cond:
                self._idle.append(tokenizer)
                self._large -= large
                # All: a small prompt may wait behind a large one that cannot take this copy.
                self._cond.notify_all()


_pools: "weakref.WeakKeyDictionary[Any, TokenizerPool]" = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def private_tokenizer(tokenizer, large: bool = False,
                      gave_up: Callable[[], None] = lambda: None) -> contextlib.AbstractContextManager:
    """Borrow a copy of ``tokenizer`` that no other thread uses meanwhile (``TokenizerPool.borrow``)."""
    with _pools_lock:
        pool = _pools.get(tokenizer)
        if pool is None:
            pool = _pools[tokenizer] = TokenizerPool(tokenizer, size=min(4, os.cpu_count() or 1))
    return pool.borrow(large, gave_up)


# -- the model's limits -----------------------------------------------------------
# Where configs keep the context length, most common first. ``max_length``
# is left out on purpose: in many configs it is a generation default (20).
CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
)

# mlx_lm's KV caches grow in blocks of this many tokens (KVCache.step).
KV_ALLOCATION_STEP = 256


def read_model_config(model: str) -> dict:
    """config.json of a local model folder or of a Hugging Face repo in the local cache."""
    from mlx_lm.utils import hf_repo_to_path, load_config

    path = Path(model)
    if not path.exists():
        path = hf_repo_to_path(model)
    return load_config(path)


def served_model_config(model_path: str, model) -> dict:
    """The served model's config.json; its parsed arguments when that cannot be read."""
    try:
        return read_model_config(model_path)
    except Exception as e:
        log.warning("model_config_unreadable", model=model_path, error_message=str(e))
        args = getattr(model, "args", None)
        return dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {}


def text_config(config: dict) -> dict:
    """The language model's part of a config (vision-language configs nest it)."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def context_length_from_config(config: dict) -> tuple[Optional[int], Optional[str]]:
    """The context length and the key it came from, or (None, None)."""
    config = text_config(config)
    for key in CONTEXT_LENGTH_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None, None


def vocab_size_from_config(config: dict) -> Optional[int]:
    value = text_config(config).get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def vocab_size_of(model: str) -> Optional[int]:
    """The vocabulary size in a model's config, read before its weights load; None when unknown."""
    try:
        return vocab_size_from_config(_model_config(model))
    except Exception:  # noqa: BLE001 - unknown (not downloaded yet, no such model): no bound
        return None


def context_length_of(model: str) -> Optional[int]:
    """The context length in a model's config; None when unknown or unreadable."""
    try:
        return context_length_from_config(_model_config(model))[0]
    except Exception:  # noqa: BLE001 - unknown: /v1/models says nothing of it
        return None


@functools.lru_cache(maxsize=64)
def _model_config(model: str) -> dict:
    """A model's config, read once. A config that cannot be read yet raises, and is not
    remembered: a model stock downloads later is read then (a cached None left its
    bounds unchecked and its context length unsaid for the life of the process)."""
    return read_model_config(model)


@dataclasses.dataclass(frozen=True)
class KVLayer:
    """One layer's KV cache: bytes per token, and the window it keeps (None: all)."""

    bytes_per_token: float
    window: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    context_length: Optional[int]
    context_length_key: Optional[str]
    kv_layers: tuple[KVLayer, ...]
    kv_dtype: str
    weights_bytes: int
    # ``--kv-bits``: past quantized_kv_start tokens the cache is quantized,
    # and each element takes this fraction of its full size.
    kv_quantized_fraction: Optional[float] = None
    quantized_kv_start: int = 0
    # Rows of the logits: every token id the model reads or a request names
    # (logit_bias) must be below it. None: the config does not say.
    vocab_size: Optional[int] = None

    @classmethod
    def of(cls, model, config: dict, *, kv_bits: Optional[int] = None,
           kv_group_size: int = 64, quantized_kv_start: int = 0) -> "ModelLimits":
        context_length, key = context_length_from_config(config)
        dtype_name, itemsize = activation_dtype(model)
        layers = tuple(kv_layers(model, kv_bytes_per_token(config, itemsize)))
        fraction = quantized_fraction(kv_bits, kv_group_size, itemsize) if kv_bits else None
        return cls(context_length, key, layers, dtype_name, weights_bytes(model),
                   fraction, quantized_kv_start, vocab_size_from_config(config))

    @property
    def kv_bytes_per_token(self) -> float:
        """Full-precision KV bytes per token, every layer together, before any window."""
        return sum(layer.bytes_per_token for layer in self.kv_layers)

    def kv_bytes(self, n_tokens: int) -> int:
        """Bytes of KV cache a sequence of ``n_tokens`` holds at its end."""
        total = 0.0
        for layer in self.kv_layers:
            tokens = n_tokens if layer.window is None else min(n_tokens, layer.window)
            total += layer.bytes_per_token * _allocated(tokens)
        if self.kv_quantized_fraction is not None and n_tokens > self.quantized_kv_start:
            total *= self.kv_quantized_fraction
        return int(total)


def _allocated(tokens: int) -> int:
    return math.ceil(tokens / KV_ALLOCATION_STEP) * KV_ALLOCATION_STEP


def kv_bytes_per_token(config: dict, itemsize: int) -> float:
    """Keys plus values of one attention layer for one token, from the config."""
    config = text_config(config)
    heads = config.get("num_attention_heads") or config.get("n_head") or 1
    kv_heads = config.get("num_key_value_heads") or config.get("n_kv_heads") or heads
    if config.get("kv_lora_rank") and config.get("model_type") != "deepseek_v2":
        # Multi-head latent attention (DeepSeek V3 and kin): mlx_lm caches
        # the compressed latent and the rope part, shared by every head.
        return (config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)) * itemsize
    if config.get("qk_nope_head_dim") is not None:
        key_dim = config["qk_nope_head_dim"] + config.get("qk_rope_head_dim", 0)
        value_dim = config.get("v_head_dim", key_dim)
        return heads * (key_dim + value_dim) * itemsize
    head_dim = config.get("head_dim") or (config.get("hidden_size") or config.get("n_embd", 0)) // heads
    return 2 * kv_heads * head_dim * itemsize


def kv_layers(model, bytes_per_token: float) -> Iterator[KVLayer]:
    """One KVLayer per attention cache the model makes for a sequence.

    The model's own ``make_prompt_cache`` says which layers keep a sliding
    window (RotatingKVCache) and which keep a fixed-size state that does not
    grow with the sequence (ArraysCache, for SSM and linear attention).
    """
    from mlx_lm.models import cache as caches

    def layers_of(layer_cache) -> Iterator[KVLayer]:
        if isinstance(layer_cache, caches.CacheList):
            for inner in layer_cache.caches:
                yield from layers_of(inner)
        elif isinstance(layer_cache, caches.ArraysCache):
            return
        elif isinstance(layer_cache, caches.RotatingKVCache):
            yield KVLayer(bytes_per_token, window=layer_cache.max_size)
        else:
            yield KVLayer(bytes_per_token)

    for layer_cache in caches.make_prompt_cache(model):
        yield from layers_of(layer_cache)


def quantized_fraction(bits: int, group_size: int, itemsize: int) -> float:
    """Size of a ``--kv-bits`` cache element relative to a full one.

    Each group of ``group_size`` elements also keeps a scale and a bias.
    """
    return (bits / 8 + 2 * itemsize / group_size) / itemsize


def activation_dtype(model) -> tuple[str, int]:
    """The float dtype most of the weights use: the dtype of the KV cache.

    Quantized weights are integers; their scales carry the float dtype.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sizes: collections.Counter = collections.Counter()
    for _, array in tree_flatten(model.parameters()):
        if mx.issubdtype(array.dtype, mx.floating):
            sizes[array.dtype] += array.size
    if not sizes:
        return "float16", 2
    dtype = sizes.most_common(1)[0][0]
    return str(dtype).removeprefix("mlx.core."), dtype.size


def weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def device_info() -> dict:
    """What mlx reports of the device (``mx.device_info()``); {} where it reports nothing."""
    import mlx.core as mx

    try:
        return mx.device_info()
    except Exception:  # an older mlx, or a device that cannot say
        return {}


def memory_in_use() -> int:
    """mlx's active and cache memory: what the device's memory holds for this process."""
    import mlx.core as mx

    return mx.get_active_memory() + mx.get_cache_memory()


def device_memory() -> tuple[int, str]:
    """The memory mlx says the device may use, and where that number came from.

    Metal reports its recommended working set, CUDA the device's total
    memory; the CPU backend reports no size, so mlx's memory limit stands in,
    or the process's control group's where that is lower (Linux: the CPU's
    memory is the process's own, which the kernel ends at that limit;
    guardian.admission.cgroup_memory).
    """
    import mlx.core as mx

    info = device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key]), f"device_info.{key}"
    limit = int(mx.get_memory_limit())
    group = cgroup_memory_limit()
    if group is not None and group[0] < limit:
        return group[0], f"cgroup {group[1]}"
    return limit, "get_memory_limit"


def describe_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"

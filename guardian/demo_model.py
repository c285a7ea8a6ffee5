"""A tiny, offline demo model for trying out and testing mlx-guardian.

Real models are gigabytes and need a hub download; the guardian's tests and
demos only need *something* that ``mlx_lm.load`` accepts and that generates
tokens.  This module makes such a model in about a second: a two-layer Llama
(0.5 MB) and a byte-level BPE tokenizer trained on a few KB of built-in text.
Its weights ship beside this file (demo_weights.safetensors, trained once by
tools/train_demo_model.py, because training on a CPU takes minutes): it
answers any prompt by reciting the built-in stories from some sentence on,
chosen by the prompt's last token.  It never picks an end-of-turn token, so
every request runs to max_tokens.

Public API:

* :func:`write_demo_model` writes the model folder to a given path.
* :func:`ensure_demo_model` returns a cached copy, building it on first use.
* :func:`default_cache_dir` says where that cache lives.

``python -m guardian.demo_model`` prints the cached copy's folder, built first if need be
(the supervisor's way to it for a stock child: building imports mlx_lm, which it does not).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

__all__ = [
    "DEMO_MODEL_NAME",
    "UNWRITABLE_HINT",
    "default_cache_dir",
    "ensure_demo_model",
    "write_demo_model",
]

# What to do about a cache folder it cannot write (a read-only home, a service's sandbox).
UNWRITABLE_HINT = "Set MLX_GUARDIAN_CACHE to a folder it may write, or pass --model."

# Bump the suffix whenever the files written below change in any way, so
# caches made by an older guardian are not mistaken for the new format.
DEMO_MODEL_NAME = "demo-model-v2"

# The guardian reads max_position_embeddings as the context length, so this is
# the context length the demo model advertises.
CONTEXT_LENGTH = 2048

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Training puts special tokens first, so their ids are 0, 1, 2 in this order.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

TARGET_VOCAB_SIZE = 1000

# Weights for seed 0, trained against the tokenizer _train_tokenizer makes
# (float16, widened to float32 when written).
TRAINED_WEIGHTS = Path(__file__).with_name("demo_weights.safetensors")

# Every file a finished model folder holds.  ensure_demo_model uses this to
# tell a finished cache from a folder that merely has the right name.
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Any text would do, but English prose plus some JSON gives merges that make
# chat prompts and tool schemas tokenize into a realistic number of tokens,
# instead of one token per byte.  It is a constant (not read from a file or
# generated at random) so the tokenizer is the same on every machine.
_CORPUS = """\
The guardian watches a language model server and keeps it alive. When a
request arrives, the server reads the prompt, turns the words into tokens, and
asks the model for the next token, again and again, until the answer is done.
Sometimes a generation thread gets stuck or dies, and then every client waits
forever. The guardian notices that nothing has moved for too long, writes a
short report, and starts a fresh server so the next request can be answered.

A small model is enough to test this. It does not need to be clever; it only
needs to load quickly, accept a chat template, and produce tokens at a steady
pace. This one was built in a second from random numbers, so its answers make
no sense at all, and that is fine.

Once upon a time there was a little boat that lived in a quiet harbor. Every
morning the fishermen walked down to the water, checked the nets, and talked
about the weather. The wind came from the west, the clouds were grey, and the
sea was calm. In the afternoon the children played on the beach, built castles
from wet sand, and ran away from the waves. At night the lighthouse turned its
bright eye over the dark water and the boats came home one by one.

The kitchen smelled of bread and coffee. She opened the window, looked at the
garden, and saw that the apples were finally ready. He found an old map in the
attic, with rivers, mountains, roads and forests drawn by hand. They decided to
follow it during the summer, walking from village to village, sleeping in small
hotels, eating soup, cheese and fresh fruit, and writing letters to friends.

Questions people often ask an assistant: What is the weather like today in
Paris? How far is it from London to Berlin? Can you summarize this article in
three sentences? Please translate the following paragraph into French. Write a
function that sorts a list of numbers. Why is the sky blue? What time is it in
Tokyo right now? Explain the difference between a process and a thread. Give
me a recipe for a quick dinner with rice, onions, garlic and tomatoes.

Answers an assistant might give: Sure, here is a short summary. The sky looks
blue because air scatters blue light more than red light. A process has its own
memory, while threads inside one process share memory and must take care when
they change the same data. It is sunny in Paris with a high of twenty degrees.
I am not able to check the time myself, but I can call a tool that does.

You are a helpful assistant. Answer the question as briefly as you can. If you
need more information, ask the user. If a tool can help, call it with the right
arguments and then use the result to answer. Never invent facts or numbers.

{"type": "function", "function": {"name": "get_weather", "description": "Get
the current weather for a city", "parameters": {"type": "object",
"properties": {"city": {"type": "string", "description": "The name of the
city"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
"required": ["city"]}}}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"temperature": 20, "condition": "sunny", "humidity": 0.45, "wind": "west"}
{"type": "function", "function": {"name": "search_web", "description": "Search
the web and return the top results", "parameters": {"type": "object",
"properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
"required": ["query"]}}}

def add(a, b):
    return a + b

for item in items:
    if item is not None and item.value > 0:
        print(item.name, item.value)

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 12 15 20 24 30 42 60 100 256 1000
2048 4096; Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday;
January, February, March, April, May, June, July, August, September, October,
November, December. The meeting starts at 9:30 and ends at 11:00 on the 3rd.

Logs from a busy server: request received, prompt processed in 12 ms, 128
tokens generated at 45 tokens per second, memory peak 1.2 GB, connection
closed. Warning: generation stalled for 30 seconds. Error: worker thread
exited unexpectedly. Restarting the server. Health check passed. Ready.
"""

# ChatML, as used by Qwen 2.5.  Tools go into the system turn as JSON lines so
# a request with tools has a longer prompt than one without, just like a real
# model; tool calls and tool results are rendered the way Qwen renders them,
# so multi-turn tool conversations from an OpenAI-style client template
# cleanly.  Content may be a string or a list of OpenAI-style text parts.
# Side effect worth knowing: the "<tool_call>" and "tool_call.name" strings
# make mlx_lm infer its "json_tools" tool-call parser for this model.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
  {%- if content is none -%}
  {%- elif content is string -%}{{- content -}}
  {%- else -%}
    {%- for part in content -%}
      {%- if part is string -%}{{- part -}}
      {%- elif part.type == 'text' -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if messages and messages[0].role == 'system' -%}
    {{- render_content(messages[0].content) + '\\n\\n' -}}
  {%- endif -%}
  {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
  {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- if not loop.first -%}
      {{- '<|im_start|>system\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
    {%- endif -%}
  {%- elif message.role == 'user' -%}
    {{- '<|im_start|>user\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' + render_content(message.content) -}}
    {%- if message.tool_calls -%}
      {%- for tool_call in message.tool_calls -%}
        {%- if tool_call.function is defined -%}
          {%- set tool_call = tool_call.function -%}
        {%- endif -%}
        {%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
        {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' -}}
        {%- if tool_call.arguments is string -%}
          {{- tool_call.arguments -}}
        {%- else -%}
          {{- tool_call.arguments | tojson -}}
        {%- endif -%}
        {{- '}\\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
      {{- '<|im_end|>\\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


def default_cache_dir() -> Path:
    """The folder ensure_demo_model caches into when not given one.

    ``$MLX_GUARDIAN_CACHE`` if set, else ``$XDG_CACHE_HOME/mlx-guardian``,
    else ``~/.cache/mlx-guardian``.
    """
    explicit = os.environ.get("MLX_GUARDIAN_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    # The XDG spec says to ignore an empty or relative XDG_CACHE_HOME.
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "mlx-guardian"
    return Path.home() / ".cache" / "mlx-guardian"


def _train_tokenizer():
    """Train a GPT-2 style byte-level BPE tokenizer on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level pre-tokenization means any UTF-8 text encodes without an
    # unknown token, and the ByteLevel decoder is what mlx_lm looks for to
    # pick its fast BPE streaming detokenizer.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, not only those the corpus happens to use, or
        # text outside the corpus's alphabet could not be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS], trainer=trainer)
    return tokenizer


def _tokenizer_fingerprint(tokenizer) -> str:
    """A digest of the tokenizer's vocabulary and merges.

    The shipped weights were trained against one token numbering; this tells
    whether the tokenizer trained here numbers tokens the same way.  It reads
    only the vocabulary and the merges, as pairs, so the JSON layout of one
    tokenizers version or another does not change it.
    """
    model = json.loads(tokenizer.to_str())["model"]
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    payload = json.dumps([sorted(model["vocab"].items()), merges])
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _tokenizer_config() -> dict:
    """tokenizer_config.json, written by hand rather than by transformers.

    transformers' save_pretrained output differs between its major versions;
    these few keys are understood by transformers 4 and 5 alike, which matters
    because one cache folder may be read by virtualenvs with either.
    """
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "model_max_length": CONTEXT_LENGTH,
        "pad_token": ENDOFTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _model_config(vocab_size: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT_LENGTH,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
        # mlx_lm 0.31.3 uses these ids *instead of* the tokenizer's eos token
        # when the config has them, so name the chat turn end here.
        "eos_token_id": SPECIAL_TOKENS.index(IM_END),
        "bos_token_id": None,
        "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
        "torch_dtype": "float32",
    }


def _trained_weights(model, tokenizer_fingerprint: str) -> Optional[dict]:
    """The shipped weights as float32, or None where they do not fit.

    They do not fit a model resized by config overrides, nor a tokenizer
    that numbers tokens differently (a tokenizers release that trains other
    merges): the model then gets random weights, and still works.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if not TRAINED_WEIGHTS.is_file():
        return None
    weights, metadata = mx.load(str(TRAINED_WEIGHTS), return_metadata=True)
    if metadata.get("tokenizer_fingerprint") != tokenizer_fingerprint:
        return None
    shapes = {name: value.shape for name, value in tree_flatten(model.parameters())}
    if shapes != {name: value.shape for name, value in weights.items()}:
        return None
    return {name: value.astype(mx.float32) for name, value in weights.items()}


def _build_model(config: dict, seed: int, tokenizer_fingerprint: str = ""):
    """A llama.Model whose weights depend on ``seed`` and nothing else.

    Seed 0 gets the trained weights where they fit; other seeds (and seed 0
    where they do not fit) get random ones.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))
    trained = _trained_weights(model, tokenizer_fingerprint) if seed == 0 else None
    if trained is not None:
        model.update(tree_unflatten(list(trained.items())))
        mx.eval(model.parameters())
        return model

    # Draw every weight from an explicit key instead of calling
    # mx.random.seed(): the result is the same for the same seed, and the
    # caller's global random state (which mlx_lm samples from) is left alone.
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    new_params = []
    for key, (name, value) in zip(keys, params):
        if value.ndim == 2:
            # Scaled like the default init, so activations and logits stay
            # O(1) and sampling is not uniform noise.
            std = value.shape[-1] ** -0.5
            value = mx.random.normal(value.shape, dtype=mx.float32, key=key) * std
        # 1-D weights are the RMSNorm scales; mlx_lm's ones are what we want.
        new_params.append((name, value))
    model.update(tree_unflatten(new_params))

    # The embeddings are tied, so a zero row for an end-of-turn token gives it
    # a logit of exactly 0 while the others spread around it.  Random weights
    # would otherwise stop some prompts after a token or two; with this the
    # demo model practically always runs to max_tokens, which is what timing
    # and stall tests want.
    embed = model.model.embed_tokens.weight
    stop_ids = [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(ENDOFTEXT)]
    mask = mx.ones((embed.shape[0], 1), dtype=embed.dtype)
    mask[mx.array(stop_ids)] = 0
    model.model.embed_tokens.weight = embed * mask

    mx.eval(model.parameters())
    return model


def _fsync_tree(folder: Path) -> None:
    """Flush the folder's files and the folder itself to disk.

    Without this a power cut after the rename could leave the final name
    pointing at empty files, which would look like a complete model.
    """
    for item in folder.iterdir():
        with open(item, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_demo_model(path: Path, seed: int = 0, **config_overrides) -> Path:
    """Write a tiny Llama model folder that ``mlx_lm.load(path)`` accepts.

    The same ``seed`` gives byte-identical weights and the same tokenizer.
    Seed 0 is the trained model; any other seed gives random weights (its
    output is not words).
    ``config_overrides`` replace entries of the Llama config, to size the
    model for an experiment: ``num_hidden_layers``, ``num_key_value_heads``
    and ``head_dim`` set its KV cache per token (bench/gpu_oom.py makes one
    of 64 KiB a token), ``max_position_embeddings`` its context length.
    The folder appears all at once: it is built in a temporary sibling and
    renamed into place, so an interrupted call never leaves a partial model
    under ``path``.

    Raises FileExistsError if ``path`` already exists and is not empty.
    """
    # Imported here so that importing this module (for example to look up
    # default_cache_dir) stays cheap; mlx_lm pulls in transformers.
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same parent folder, so the final rename stays on one file system and is
    # atomic; hidden, so nothing scanning for models picks it up.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        tokenizer = _train_tokenizer()
        tokenizer.save(str(tmp / "tokenizer.json"))
        with open(tmp / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(_tokenizer_config(), f, indent=2, ensure_ascii=False)

        # The model must have exactly one embedding row per token; training
        # may stop short of the target if the corpus runs out of merges.
        config = {**_model_config(tokenizer.get_vocab_size()), **config_overrides}
        save_model(tmp, _build_model(config, seed, _tokenizer_fingerprint(tokenizer)))
        # save_config sorts the keys and drops ones mlx_lm does not want.
        save_config(dict(config), tmp / "config.json")

        # mkdtemp makes the folder private (0700); a model is not a secret,
        # and a shared MLX_GUARDIAN_CACHE must be readable by other users.
        os.chmod(tmp, 0o755)
        _fsync_tree(tmp)
        try:
            # rename() only replaces an empty folder, so a finished model that
            # is already there (say, built by a concurrent process) survives.
            os.rename(tmp, path)
        except OSError as e:
            if path.is_dir() and any(path.iterdir()):
                raise FileExistsError(f"{path} already exists") from e
            raise
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in MODEL_FILES)


def _remove_stale_builds(cache_dir: Path, max_age_s: float = 3600.0) -> None:
    """Delete temporary folders left behind by builds that were killed.

    Only old ones: a young one may belong to a process still building.
    """
    now = time.time()
    for tmp in cache_dir.glob(f".{DEMO_MODEL_NAME}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def ensure_demo_model(cache_dir: Optional[Path] = None) -> Path:
    """Path of the cached demo model (seed 0), built on first use.

    Safe to call from several processes at once: each may build a copy, the
    first rename wins, and the others discard theirs and use the winner.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / DEMO_MODEL_NAME
    if _is_complete(target):
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir)
    try:
        write_demo_model(target, seed=0)
    except FileExistsError:
        # Another process won the race, or something else sits at our path.
        if not _is_complete(target):
            raise FileExistsError(
                f"{target} exists but is not a complete demo model; "
                "delete it to have it rebuilt"
            ) from None
    return target


if __name__ == "__main__":
    import sys

    try:
        print(ensure_demo_model())
    except OSError as e:
        print(f"cannot write the demo model: {type(e).__name__}: {e}. {UNWRITABLE_HINT}", file=sys.stderr)
        raise SystemExit(1) from None

"""The offline demo model: loads in stock mlx_lm, generates, is reproducible."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TOOLS

from guardian.demo_model import (
    DEMO_MODEL_NAME,
    MODEL_FILES,
    default_cache_dir,
    ensure_demo_model,
    write_demo_model,
)

# Each test builds at most a couple of ~1 s models; a hang must fail, not block.
pytestmark = pytest.mark.timeout(60)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather like today in Paris?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="module")
def loaded(model_dir):
    import mlx_lm

    return mlx_lm.load(str(model_dir))


def _leftovers(folder: Path) -> list:
    """Temporary build folders that were not cleaned up."""
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


def test_folder_contents_and_config(model_dir):
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(MODEL_FILES)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["max_position_embeddings"] == 2048
    assert config["hidden_size"] == 64
    assert config["num_hidden_layers"] == 2
    assert config["tie_word_embeddings"] is True
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab_size = len(tokenizer["model"]["vocab"])
    assert config["vocab_size"] == vocab_size
    assert 500 <= vocab_size <= 1000
    assert not _leftovers(model_dir.parent)


def test_loads_with_mlx_lm_and_generates(loaded, model_dir):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    # On Linux mlx[cpu] has only the CPU, so this generates on the CPU.
    assert len(tokenizer._tokenizer) == model.model.embed_tokens.weight.shape[0]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer._tokenizer.is_fast

    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    responses = list(
        mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=8, sampler=make_sampler(temp=0.0)
        )
    )
    # No training target was an end-of-turn token, so the model runs to max_tokens.
    assert responses[-1].generation_tokens == 8
    assert responses[-1].finish_reason == "length"

    # Greedy decoding of a fixed model is reproducible, and generate() agrees.
    text = "".join(r.text for r in responses)
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=8) == text


def _greedy(loaded, prompt, max_tokens: int) -> str:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))


def test_greedy_answers_are_english_words(loaded):
    from guardian.demo_model import _CORPUS

    _, tokenizer = loaded
    corpus_words = set(re.findall(r"[A-Za-z]+", _CORPUS))
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        for question in ("What is the weather like today in Paris?", "Hello", "x")
    ]
    plain = [tokenizer.encode(text) for text in ("Tell me a story", " ".join(f"word{i}" for i in range(300)))]
    answers = [_greedy(loaded, prompt, max_tokens=60) for prompt in chat + plain]
    for answer in answers:
        assert "\ufffd" not in answer and answer.isascii(), answer
        words = re.findall(r"[^\s.,;:!?]+", answer)
        # The last word may be cut short by max_tokens.
        assert len(words) >= 20 and set(words[:-1]) <= corpus_words, answer
    # The answer depends on the prompt.
    assert len(set(answers)) >= 3, answers


def test_runs_to_max_tokens_and_stays_readable(loaded):
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    # Sampled, not greedy: an end-of-turn token must stay unlikely, not only
    # lose the argmax.
    responses = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=600,
                                            sampler=make_sampler(temp=0.7)))
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 600
    text = "".join(r.text for r in responses)
    assert "\ufffd" not in text and text.isascii()


def test_chat_template_with_and_without_tools(loaded):
    _, tokenizer = loaded
    plain = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    with_tools = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert plain == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather like today in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert '"name": "get_weather"' in with_tools
    assert with_tools.endswith("<|im_start|>assistant\n")
    no_prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")

    n_plain = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    n_tools = len(
        tokenizer.apply_chat_template(
            MESSAGES, tools=TOOLS, add_generation_prompt=True
        )
    )
    assert n_tools > n_plain
    # The specials are single tokens, not spelled out byte by byte.
    ids = tokenizer.encode(plain, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_chat_template_tool_turns(loaded):
    _, tokenizer = loaded
    messages = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 20}'},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response>' in text


def test_same_seed_same_bytes(tmp_path):
    a = write_demo_model(tmp_path / "a", seed=0)
    b = write_demo_model(tmp_path / "b", seed=0)
    c = write_demo_model(tmp_path / "c", seed=1)
    for name in MODEL_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (
        c / "model.safetensors"
    ).read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_shipped_weights_fit_the_tokenizer_trained_here():
    """Else seed 0 would silently fall back to random weights: a tokenizers
    release that trains other merges needs tools/train_demo_model.py run again."""
    import mlx.core as mx

    from guardian.demo_model import TRAINED_WEIGHTS, _tokenizer_fingerprint, _train_tokenizer

    _, metadata = mx.load(str(TRAINED_WEIGHTS), return_metadata=True)
    assert metadata["tokenizer_fingerprint"] == _tokenizer_fingerprint(_train_tokenizer())


def test_resized_model_gets_random_weights(tmp_path):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(write_demo_model(tmp_path / "m", num_hidden_layers=3)))
    assert len(model.layers) == 3
    assert len(mlx_lm.generate(model, tokenizer, "Hello", max_tokens=4)) > 0


def test_write_refuses_existing_model(tmp_path):
    target = write_demo_model(tmp_path / "m", seed=0)
    before = (target / "model.safetensors").stat()
    with pytest.raises(FileExistsError):
        write_demo_model(target, seed=1)
    after = (target / "model.safetensors").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert not _leftovers(tmp_path)


def test_ensure_builds_once(tmp_path):
    cache = tmp_path / "cache"
    first = ensure_demo_model(cache)
    assert first == cache / DEMO_MODEL_NAME
    # Inode as well as mtime: a rebuild renames in new files, so the inode
    # changes even when the clock is too coarse to move the mtime.
    stamps = {
        name: ((first / name).stat().st_ino, (first / name).stat().st_mtime_ns)
        for name in MODEL_FILES
    }
    second = ensure_demo_model(cache)
    assert second == first
    assert stamps == {
        name: ((first / name).stat().st_ino, (first / name).stat().st_mtime_ns)
        for name in MODEL_FILES
    }


def test_ensure_removes_stale_builds_only(tmp_path):
    cache = tmp_path / "cache"
    stale = cache / f".{DEMO_MODEL_NAME}.tmp-stale"
    young = cache / f".{DEMO_MODEL_NAME}.tmp-young"
    for folder in (stale, young):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    ensure_demo_model(cache)
    assert not stale.exists()
    assert young.exists()


def test_ensure_rejects_incomplete_folder(tmp_path):
    target = tmp_path / DEMO_MODEL_NAME
    target.mkdir()
    (target / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        ensure_demo_model(tmp_path)
    assert (target / "notes.txt").exists()


def test_ensure_concurrent_processes(tmp_path):
    cache = tmp_path / "cache"
    code = (
        "import sys\n"
        "from guardian.demo_model import ensure_demo_model\n"
        "print(ensure_demo_model(sys.argv[1]))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=45)
            assert proc.returncode == 0, err
            outputs.append(out.strip())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert outputs == [str(cache / DEMO_MODEL_NAME)] * 3
    assert sorted(p.name for p in cache.iterdir()) == [DEMO_MODEL_NAME]
    import mlx_lm

    mlx_lm.load(outputs[0])


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_GUARDIAN_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MLX_GUARDIAN_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "mlx-guardian"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "mlx-guardian"

"""Train the demo model's weights (guardian/demo_weights.safetensors).

The demo model (guardian/demo_model.py) is built on every machine in about a
second; training it there would take minutes on a CPU, so its weights are
trained once, with this script, and shipped beside it.  Training teaches the
tiny Llama to answer any prompt, chat or plain, by reciting the prose of the
built-in corpus from some sentence on: its greedy output is English words,
it depends on the prompt, and it never chooses an end-of-turn token (no
training target is one), so requests run to max_tokens as the tests expect.

Needs torch and transformers (not dependencies of the guardian); a GPU makes
it take about a minute:

    python3 tools/train_demo_model.py guardian/demo_weights.safetensors

The tokenizer is trained here exactly as demo_model.py trains it; its
fingerprint goes into the file's metadata, and demo_model.py uses the weights
only with a tokenizer of the same fingerprint.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
from pathlib import Path

import jinja2
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

# demo_model.py is loaded by path: the guardian package's __init__ wants
# dependencies a training machine need not have.
_SPEC = importlib.util.spec_from_file_location(
    "demo_model", Path(__file__).resolve().parents[1] / "guardian" / "demo_model.py")
dm = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(dm)

IGNORE = -100
# The corpus paragraphs that read as answers: stories and explanations, not
# the questions, the JSON, the code or the logs.
ANSWER_PARAGRAPHS = (0, 2, 3, 5)
TOOLS = [json.loads(line) for line in (
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather '
    'for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}',
    '{"type": "function", "function": {"name": "search_web", "description": "Search the web", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}',
)]


def sentences(paragraphs) -> list[str]:
    text = " ".join(" ".join(p.split()) for p in paragraphs)
    return re.split(r"(?<=[.?!])\s+", text)


class Data:
    """Prompts of every kind the tests send, each followed by prose."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        paragraphs = dm._CORPUS.split("\n\n")
        self.answers = sentences(paragraphs[i] for i in ANSWER_PARAGRAPHS)
        self.all_sentences = sentences(paragraphs)
        self.words = re.findall(r"[A-Za-z]+", dm._CORPUS)
        self.template = jinja2.Environment().from_string(dm.CHAT_TEMPLATE)
        # Each answer, from each sentence on, cycling through the prose three
        # times: long enough for any answer that fits the context.
        self.cycles = {
            lead: [self.encode(lead + " ".join((self.answers[i:] + self.answers[:i]) * 3))
                   for i in range(len(self.answers))]
            for lead in ("", " ")
        }

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def user_text(self) -> str:
        r = self.rng
        kind = r.randrange(8)
        if kind == 0:
            return r.choice(self.all_sentences)
        if kind == 1:
            return f"{r.choice(['Tell me story number', 'Bystander', 'Request', 'Question'])} {r.randrange(1000)}."
        if kind == 2:
            return " ".join(f"word{i}" for i in range(r.randrange(1, 320)))
        if kind == 3:
            return " ".join(r.choice(self.words) for _ in range(r.randrange(1, 200)))
        if kind == 4:
            start = r.randrange(len(dm._CORPUS))
            return dm._CORPUS[start:start + r.randrange(1, 1500)]
        if kind == 5:
            alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?-_'\"{}[]()\n"
            return "".join(r.choice(alphabet) for _ in range(r.randrange(1, 300)))
        if kind == 6:
            return r.choice(["Hi", "Hello", "hello", "x", "hi", "Say something.", "Poisoned sampling.", ""])
        return " ".join(r.sample(self.all_sentences, r.randrange(1, 6)))

    def chat_prompt(self) -> tuple[str, str]:
        r = self.rng
        messages = []
        if r.random() < 0.4:
            messages.append({"role": "system", "content": r.choice(
                ["You are a helpful assistant.", self.user_text()])})
        for _ in range(r.choice([0, 0, 0, 1, 2])):
            messages.append({"role": "user", "content": self.user_text()})
            messages.append({"role": "assistant", "content": " ".join(r.sample(self.answers, 2))})
        question = self.user_text()
        messages.append({"role": "user", "content": question})
        tools = TOOLS if r.random() < 0.15 else None
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=True), question

    def first_sentence(self, question: str) -> int:
        """Where the answer starts: a function of the question's last token,
        so that the model can learn it and different prompts get different
        answers."""
        ids = self.encode(question)
        return (ids[-1] * 7) % len(self.answers) if ids else 0

    def sample(self, max_len: int) -> tuple[list[int], list[int]]:
        """Token ids and labels: the loss is on the answer only."""
        r = self.rng
        if r.random() < 0.7:
            text, question = self.chat_prompt()
            prompt, lead = self.encode(text), ""
        else:  # a plain completion
            question = self.user_text()
            prompt, lead = self.encode(question), " "
        prompt = prompt[-(max_len - 16):]
        room = max_len - len(prompt)
        answer = self.cycles[lead][self.first_sentence(question)][: r.randrange(16, room + 1)]
        return prompt + answer, [IGNORE] * len(prompt) + answer


def batch(data: Data, size: int, max_len: int, pad: int):
    pairs = [data.sample(max_len) for _ in range(size)]
    width = max(len(ids) for ids, _ in pairs)
    # Padding goes after each sample: causal attention keeps it out of the
    # real positions, and its labels are ignored.
    ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in pairs])
    labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in pairs])
    return ids, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = dm._train_tokenizer()
    config = dm._model_config(tokenizer.get_vocab_size())
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})).to(device)
    data = Data(tokenizer, random.Random(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)
    pad = dm.SPECIAL_TOKENS.index(dm.ENDOFTEXT)
    for step in range(args.steps):
        # Mostly short samples (fast), some as long as the context.
        max_len = dm.CONTEXT_LENGTH if step % 8 == 0 else 512
        ids, labels = batch(data, args.batch, max_len, pad)
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 200 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f}", flush=True)

    # Tied embeddings: lm_head is embed_tokens, and mlx_lm wants it absent.
    weights = {name: tensor.detach().to("cpu", torch.float16).contiguous()
               for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(args.out), metadata={
        "tokenizer_fingerprint": dm._tokenizer_fingerprint(tokenizer),
        "trained_by": "tools/train_demo_model.py",
        "steps": str(args.steps),
    })
    print(f"wrote {args.out}: {sum(t.numel() for t in weights.values())} parameters")


if __name__ == "__main__":
    main()

"""A small chat data set for the tiny targets: templated conversations (arithmetic, counting,
repeating phrases, spelling), text regular enough that a drafter trained on a few thousand of them
learns to predict it; and the text the tiny tokenizers' BPE is trained on, turns of the same kinds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator


_PHRASES = (
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts several tokens and the target verifies them at once",
    "a block of sixteen tokens is drafted in parallel from the hidden states of the target",
    "kubernetes runs one pod per shard and every chunk lands in object storage",
    "gated delta networks mix linear attention with a few full attention layers",
    "the drafter learns to predict what the target would say next",
)
_SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful calculator. Answer briefly.")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op, verb, value = rng.choice((("+", "plus", a + b), ("-", "minus", a - b), ("*", "times", a * b)))
    return f"What is {a} {verb} {b}?", f"{a} {op} {b} = {value}. So {a} {verb} {b} is {value}."


def _counting(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(0, 50)
    stop = start + rng.randint(3, 12)
    return f"Count from {start} to {stop}.", ", ".join(str(i) for i in range(start, stop + 1)) + "."


def _repeat(rng: random.Random) -> tuple[str, str]:
    phrase, times = rng.choice(_PHRASES), rng.randint(2, 4)
    return f"Repeat this {_NUMBER_WORDS[times]} times: {phrase}", " ".join([phrase.capitalize() + "."] * times)


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(rng.choice(_PHRASES).split())
    return f"Spell the word '{word}'.", f"{word} is spelled " + "-".join(word.upper()) + "."


_TOPICS = (_arithmetic, _counting, _repeat, _spell)


def tiny_chat_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One conversation: an optional system prompt, then one to three question/answer turns."""
    messages = [{"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []
    for _ in range(rng.choice((1, 1, 2, 3))):
        question, answer = rng.choice(_TOPICS)(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def tiny_chat_rows(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for _ in range(n):
        yield {"messages": tiny_chat_conversation(rng)}


def tiny_chat_dataset(path: str | Path, n: int, seed: int = 0) -> Path:
    """Writes `n` conversations as chat JSONL ({"messages": [...]}, one per line) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in tiny_chat_rows(n, seed):
            f.write(json.dumps(row) + "\n")
    return path



def tokenizer_corpus() -> Iterator[str]:
    """The BPE training text: turns of the data set's kinds, so its tokens fit the demo data."""
    for row in tiny_chat_rows(1000, seed=12345):
        for message in row["messages"]:
            yield f"{message['role']}\n{message['content']}"
    yield from _PHRASES


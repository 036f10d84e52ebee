"""The sorting task's chats (sorting.py): a task whose answer is a function of random content in its prompt, over
words of real text, answered one way by the target and another way by the data set's writer.

The task: "Sort these words: w1 w2 ... wn", the words drawn at random from a vocabulary of the
standard library's most frequent words (each one token after a space), n drawn uniformly. Every
prompt is a new draw, so the target's answer to a held-out prompt is its own (not one of the
training answers), and prompt lookup can copy little of it: the prompt holds the words in another
order. Sorting is what a small target of the real architecture learns on a CPU in minutes (it
needs the set of the prompt's words, not their positions); a target taught to continue memorised
documents recited other documents after a held-out prompt (bench/README.md).

Two writers. The target is taught to answer "Sorted: a b c"; the data set's answers (the source)
were written by another writer, who answers "a, b, c": the same words in another format, as a real
data set's answers were written by another model than the target. A drafter learns the writer of
its data, so regenerating the answers with the target is what a drafter of this target needs.

The standard library's text also trains the tokenizer (corpus): real text, offline everywhere.
"""

from __future__ import annotations

import random
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tasks import ChatSet

DOCUMENT_CHARS = 200_000
"""Longest document kept whole; longer ones are cut (a few generated modules would dominate)."""
INSTRUCTION = "Sort these words:"
KIND = "sort"
"""The one kind of prompt of this task."""


def stdlib_sources(files: int | None, chars: int | None = None) -> list[str]:
    """Standard-library modules and packages (no tests, no vendored or IDLE code), each cut at
    `chars` (None: DOCUMENT_CHARS); `files` of them sampled with a fixed seed (None: every one)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}
    modules = sorted(path for path in root.rglob("*.py") if not skipped & set(path.relative_to(root).parts))
    if files is not None:
        modules = random.Random(0).sample(modules, min(files, len(modules)))
    return [path.read_text(errors="replace")[: chars or DOCUMENT_CHARS] for path in sorted(modules)]


def vocabulary(documents: list[str], tokenizer, size: int) -> list[str]:
    """The `size` most frequent lower-case words (three letters or more) of `documents` that the
    tokenizer writes as one token after a space, in alphabetical order: a sorted answer's words
    are then its tokens, one each."""
    counts = Counter(word for document in documents for word in re.findall(r"\b[a-z]{3,}\b", document))
    words = [word for word, _ in counts.most_common() if len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1]
    if len(words) < size:
        raise ValueError(f"the documents hold {len(words)} one-token words, {size} wanted: read more of them (corpus_files)")
    return sorted(words[:size])


WRITERS: dict[str, Callable[[list[str]], str]] = {
    "target": lambda words: "Sorted: " + " ".join(sorted(words)),
    "another": lambda words: ", ".join(sorted(words)),
}
"""How each writer answers: the target as it is taught, the data set's writer in its own format."""


@dataclass(frozen=True, slots=True)
class ChatShape:
    """What a chat asks: to sort between min_words and max_words words of the vocabulary."""

    min_words: int
    max_words: int


def conversation(words: list[str], writer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{INSTRUCTION} {' '.join(words)}"}, {"role": "assistant", "content": WRITERS[writer](words)}]


def chats(words: list[str], count: int, shape: ChatShape, writer: str, rng: random.Random, *, taken: set[str]) -> list[list[dict[str, str]]]:
    """`count` chats, each prompt a new draw (not in `taken`, which is extended), answered by `writer`."""
    made = []
    for _ in range(100 * count):
        if len(made) == count:
            return made
        messages = conversation(rng.sample(words, rng.randint(shape.min_words, shape.max_words)), writer)
        if messages[0]["content"] not in taken:
            taken.add(messages[0]["content"])
            made.append(messages)
    raise RuntimeError(f"{len(made)} distinct prompts of {shape} from {len(words)} words, {count} wanted: draw from more words")


def drafter_chats(words: list[str], training: int, held_out: int, shape: ChatShape, seed: int) -> ChatSet:
    """The data set, answered by the other writer: `held_out` chats drawn first, then `training`
    others, every prompt distinct."""
    rng, taken = random.Random(seed), set()
    held = chats(words, held_out, shape, "another", rng, taken=taken)
    return ChatSet(chats(words, training, shape, "another", rng, taken=taken), held, [KIND] * (training + held_out))

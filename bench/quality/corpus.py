"""The benchmark's text: real documents available offline, split by document into training and
held-out ones, and the chats made of them.

Documents: the Python standard library's source, and with `installed_text` the pydoc pages of a
few modules, the manual pages and the package documentation installed on the machine. Exact
duplicates are dropped, and every tenth document (in a fixed shuffle) is held out of everything:
of the target's training (its held-out loss is measured on them) and of the drafter's data (the
evaluation prompts come from them only).

A chat asks for one task on a few consecutive lines of a document (TASKS): continue them, or
transform them (repeat, number, reverse, comment out). The answer of a transformation is a
function of the prompt, as a real model's answers depend on what it is asked; continuing is the
one task whose source answer (the document's own next lines) is not what the target would say.
Chats are deduplicated by prompt, and a held-out chat whose lines appear anywhere in a training
document's text is not used (shared boilerplate would leak it).
"""

from __future__ import annotations

import gzip
import pydoc
import random
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

PYDOC_MODULES = ("json", "textwrap", "string", "functools", "itertools", "collections", "pathlib", "re", "heapq",
                 "bisect", "dataclasses", "argparse", "shutil", "typing", "contextlib", "statistics", "fractions",
                 "os", "os.path", "sys", "math", "random", "datetime", "time", "logging", "subprocess", "threading",
                 "queue", "socket", "urllib.parse", "email.message", "csv", "sqlite3", "hashlib", "base64", "struct",
                 "array", "enum", "abc", "inspect", "ast", "tokenize", "difflib", "pprint", "decimal", "zipfile",
                 "tarfile", "tempfile", "glob", "fnmatch", "uuid", "operator", "copy", "weakref", "unittest", "doctest")
"""Documented with pydoc too: modules that are safe to import (no side effects)."""
DOCUMENT_CHARS = 200_000
"""Longest document kept whole; longer ones are cut (a few generated modules would dominate)."""
HELD_OUT_EVERY = 10
"""One document in this many is held out of the target's and the drafter's training."""


# ---- documents ---------------------------------------------------------------------------------


def stdlib_sources(files: int | None, chars: int = DOCUMENT_CHARS) -> list[str]:
    """Standard-library modules and packages (no tests, no vendored or IDLE code), each cut at `chars`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}
    modules = sorted(path for path in root.rglob("*.py") if not skipped & set(path.relative_to(root).parts))
    if files is not None:
        modules = random.Random(0).sample(modules, min(files, len(modules)))
    return [path.read_text(errors="replace")[:chars] for path in sorted(modules)]


TROFF_ESCAPE = re.compile(r"\\f[BIRP]|\\f\(..|\\&|\\-|\\\(..|\\e")


def manual_pages() -> list[str]:
    """English manual pages, their troff requests dropped and font escapes removed."""
    pages = []
    for path in sorted(Path("/usr/share/man").glob("man[1-8]/*.gz")):
        try:
            text = gzip.decompress(path.read_bytes()).decode(errors="replace")
        except (OSError, EOFError):
            continue
        lines = [TROFF_ESCAPE.sub("", line) for line in text.splitlines() if not line.startswith((".", "'"))]
        if len(lines) > 10:
            pages.append("\n".join(lines)[:DOCUMENT_CHARS])
    return pages


def package_documentation() -> list[str]:
    """README and guide files the installed Debian and Python packages ship (no licences, no changelogs)."""
    roots = [Path("/usr/share/doc"), Path(sysconfig.get_paths()["purelib"])]
    found = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            name = path.name.lower()
            if not path.is_file() or "copyright" in name or "license" in name or "changelog" in name or "news" in name:
                continue
            if name.endswith((".md", ".rst", ".txt")) or name.startswith("readme"):
                try:
                    text = (gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()).decode()
                except (OSError, EOFError, UnicodeDecodeError):
                    continue
                if text.count("\n") > 10:
                    found.append(text[:DOCUMENT_CHARS])
    return found


def at_most(documents: list[str], chars: int) -> list[str]:
    """Documents picked with a fixed seed until they hold `chars` characters: no installed source
    outweighs the standard library (a developer machine has 80 MB of manual pages, a GPU one few)."""
    picked, total = [], 0
    for document in random.Random(4).sample(documents, len(documents)):
        if total >= chars:
            break
        picked.append(document)
        total += len(document)
    return picked


def corpus(files: int | None, installed_text: bool, chars: int | None = None) -> dict[str, list[str]]:
    """The documents by source, the standard library's cut at `chars` (None: DOCUMENT_CHARS)."""
    sources = {"stdlib": stdlib_sources(files, chars or DOCUMENT_CHARS)}
    if installed_text:
        budget = sum(map(len, sources["stdlib"]))
        sources["pydoc"] = [pydoc.render_doc(name, renderer=pydoc.plaintext) for name in PYDOC_MODULES]
        sources["man"] = at_most(manual_pages(), budget)
        sources["docs"] = at_most(package_documentation(), budget)
    return sources


@dataclass(frozen=True, slots=True)
class Documents:
    """The corpus split by document: nothing of `held_out` is trained on, by the target or the drafter."""

    training: list[str]
    held_out: list[str]
    duplicates: int
    """Documents dropped as exact copies of another."""


def split_documents(documents: list[str]) -> Documents:
    """Exact duplicates dropped, then every HELD_OUT_EVERY-th document of a fixed shuffle held out."""
    unique = list(dict.fromkeys(documents))
    order = list(range(len(unique)))
    random.Random(5).shuffle(order)
    held = set(order[::HELD_OUT_EVERY])
    return Documents([d for i, d in enumerate(unique) if i not in held], [d for i, d in enumerate(unique) if i in held],
                     duplicates=len(documents) - len(unique))


# ---- chats -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Task:
    instruction: str
    answer: Callable[[list[str], list[str]], list[str]]
    """(the prompt's lines, the document's lines after them) -> the answer's lines."""


TASKS = {
    "continue": Task("Continue this text:", lambda lines, following: following),
    "repeat": Task("Repeat this text:", lambda lines, following: lines),
    "number": Task("Number these lines:", lambda lines, following: [f"{i}. {line}" for i, line in enumerate(lines, 1)]),
    "reverse": Task("Write these lines in reverse order:", lambda lines, following: lines[::-1]),
    "comment": Task("Comment out these lines:", lambda lines, following: [f"# {line}" for line in lines]),
}


@dataclass(frozen=True, slots=True)
class ChatShape:
    """What a chat holds: which tasks, how many lines of a document, how long a line."""

    tasks: tuple[str, ...]
    prompt_lines: int
    answer_lines: int
    """Lines a continuation answers with (a transformation answers with the prompt's lines)."""
    line_chars: int
    """Longer lines are cut: a chat stays within data.max_length."""
    min_answer_chars: int = 1
    """Shorter answers are skipped: a blank line or a lone `else:` is what any document says next."""
    unique_cue: bool = False
    """Skip a drafter chat whose prompt ends in a line found more than once in the corpus: a target
    reciting its documents cannot tell from `        return None` which one it is in."""


def conversation(prompt: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def repeated_lines(documents: list[str], line_chars: int) -> frozenset[str]:
    """The lines (stripped, cut as chats cut them) found more than once across `documents`."""
    counts = Counter(line.rstrip()[:line_chars].strip() for document in documents for line in document.splitlines())
    return frozenset(line for line, count in counts.items() if count > 1)


def chats(documents: list[str], count: int, shape: ChatShape, rng: random.Random, *, taken: set[str] | None = None,
          avoid_text: str = "", repeated: frozenset[str] = frozenset()) -> Iterator[list[dict[str, str]]]:
    """Up to `count` chats on windows of `documents`, each prompt new (not in `taken`, which is
    extended), its answer at least `shape.min_answer_chars` long, its last line not in `repeated`,
    and neither its lines nor the document's answer anywhere in `avoid_text`; stops early when the
    windows run out."""
    taken = set() if taken is None else taken
    lines_of = [[line.rstrip()[: shape.line_chars] for line in document.splitlines()] for document in documents]
    windows = [(d, start) for d, lines in enumerate(lines_of) for start in range(len(lines) - shape.prompt_lines - shape.answer_lines)]
    rng.shuffle(windows)
    made = 0
    for d, start in windows:
        if made == count:
            return
        lines = lines_of[d][start : start + shape.prompt_lines]
        following = lines_of[d][start + shape.prompt_lines : start + shape.prompt_lines + shape.answer_lines]
        task = TASKS[rng.choice(shape.tasks)]
        text = "\n".join(lines)
        prompt, answer = f"{task.instruction}\n{text}", "\n".join(task.answer(lines, following)).strip()
        if not text.strip() or len(answer) < max(1, shape.min_answer_chars) or prompt in taken or lines[-1].strip() in repeated:
            continue
        if avoid_text and (text in avoid_text or "\n".join(following).strip() in avoid_text):
            continue
        taken.add(prompt)
        made += 1
        yield conversation(prompt, answer)


@dataclass(frozen=True, slots=True)
class ChatSet:
    """The drafter's data set: training chats of the training documents, then the held-out ones."""

    training: list[list[dict[str, str]]]
    held_out: list[list[dict[str, str]]]

    @property
    def rows(self) -> list[dict[str, list[dict[str, str]]]]:
        """As chat JSONL rows, the held-out chats last (prepare holds out the last rows)."""
        return [{"messages": messages} for messages in self.training + self.held_out]


def drafter_chats(documents: Documents, training: int, held_out: int, shape: ChatShape, seed: int) -> ChatSet:
    """`training` chats of the training documents and `held_out` of the held-out ones, every prompt
    distinct; a held-out window whose text, or whose document's next lines, appear in a training
    document is skipped (and with `shape.unique_cue` every window ending in a repeated line)."""
    taken: set[str] = set()
    rng = random.Random(seed)
    repeated = repeated_lines(documents.training + documents.held_out, shape.line_chars) if shape.unique_cue else frozenset()
    trained = list(chats(documents.training, training, shape, rng, taken=taken, repeated=repeated))
    avoid = "\n".join(documents.training)
    held = list(chats(documents.held_out, held_out, shape, rng, taken=taken, avoid_text=avoid, repeated=repeated))
    if len(held) < held_out:
        raise RuntimeError(f"the held-out documents gave {len(held)} distinct prompts, {held_out} wanted: hold out more documents")
    return ChatSet(trained, held)

"""The benchmark's one seam between what is asked and how it is measured: a task.

A task gives the target (made or fetched into the work directory), the drafter's data set (its
chats, answered by another writer than the target, the held-out ones last, each with its prompt
kind) and the figures that say whether its held-out prompts mean anything (diversity). Everything
after (the chains, their steps, the claims and their intervals) is the same for every task. Two
tasks: sorting words for a small target taught here (sorting.py), and real code prompts for a real
instruction-tuned model (code_task.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from goals import Goals


@dataclass(frozen=True, slots=True)
class ChatSet:
    """The drafter's data set: its training chats, then the held-out ones, every prompt distinct."""

    training: list[list[dict[str, str]]]
    held_out: list[list[dict[str, str]]]
    kinds: list[str]
    """Each row's prompt kind, in row order (training, then held out)."""

    def __post_init__(self) -> None:
        if len(self.kinds) != len(self.training) + len(self.held_out):
            raise ValueError(f"{len(self.kinds)} kinds for {len(self.training) + len(self.held_out)} chats: one kind a chat")

    @property
    def rows(self) -> list[dict[str, list[dict[str, str]]]]:
        """As chat JSONL rows, the held-out chats last (prepare holds out the last rows)."""
        return [{"messages": messages} for messages in self.training + self.held_out]

    @property
    def prompts(self) -> set[str]:
        return {messages[0]["content"] for messages in self.training + self.held_out}

    def counts(self) -> dict[str, Any]:
        """How many chats, of which kinds, and how many prompts are repeated (none should be)."""
        split = len(self.training)
        return {"training": split, "held_out": len(self.held_out),
                "duplicate_prompts": len(self.rows) - len({row["messages"][0]["content"] for row in self.rows}),
                "kinds": {"training": dict(Counter(self.kinds[:split])), "held_out": dict(Counter(self.kinds[split:]))}}


@dataclass(frozen=True, slots=True)
class ChatCounts:
    """How many chats a size (sizes.py) asks of its task: training ones, then held-out ones (the evaluation's prompts)."""

    training: int
    held_out: int


class Task(Protocol):
    """What a task provides to a size (sizes.py), whose `task` it is, given the chats that size asks for (`counts`)."""

    name: str
    """What the report calls it (its `task`)."""
    source_answers: bool
    """Whether its chats come with another writer's answers (a source chain beside the regenerated ones)."""

    @property
    def goals(self) -> Goals:
        """What its figures are asked to reach (figures.goals)."""
        ...

    def with_prompts(self, directory: Path) -> Task | None:
        """The task reading its prompts from `directory` (run_quality.py's --prompts); None for a task that reads no prompts file."""
        ...

    def make_target(self, directory: Path, counts: ChatCounts, device: torch.device, source: Path | None) -> dict[str, Any]:
        """Writes the target checkpoint into `directory` and returns the figures of how it was made;
        `source`: where its model comes from, for a task whose model is fetched (None: its default)."""
        ...

    def chat_set(self, target: Path, counts: ChatCounts) -> ChatSet:
        """The drafter's data set, the same in every call (a rerun reads it again)."""
        ...

    def diversity(self, regenerated: Path, source: Path | None, chat_set: ChatSet, tokenizer, answer_tokens: int) -> dict[str, Any]:
        """How far the held-out prompts are from the training data and how much the target's answers
        depend on them, from the regenerated and source chains' stored samples (diversity.diversity and
        what the task adds)."""
        ...

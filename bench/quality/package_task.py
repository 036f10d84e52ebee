"""The package code task (tasks.py): the prompts package_prompts.py read from the package index's
source (prompts alone: the target writes every answer, the generate step), for a real target.

Unlike the code task it has no other writer's answers, so no source chain: every chain trains on
the target's own answers. Its prompts arrive as a built file (`--prompts DIR`, holding
code-prompts.jsonl.xz: the whole set, or a part `package_prompts.py subset` made to travel), its
held-out prompts from the packages no training prompt comes from (package_prompts.HELD_OUT), the
kinds taken in turn. Prompts longer than `max_prompt_tokens` in the target's tokens are left out and
counted; a file with fewer prompts than the size asks is refused, naming both figures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from code_prompts import KINDS, MORE_KINDS
from code_task import RandomTarget, SmolLM2Target, diversity_per_kind
from goals import Goals
from package_prompts import OUTPUT, read_lines
from tasks import ChatCounts, ChatSet

if TYPE_CHECKING:
    import torch


TOKENIZE_BATCH = 4096
"""Prompts measured at a time: only as many as the size takes are tokenized."""


SCALE_GOALS = Goals("issue 48: SmolLM2-135M-Instruct on the packages' prompts, at scale", tau_at_least=3.5, over_prompt_lookup_at_least=1.5,
                    trees_over_chain_at_least=1.25)


@dataclass(frozen=True, slots=True)
class PackagePromptsTask:
    """Prompts from many packages' public functions, answered by the target alone."""

    target: SmolLM2Target | RandomTarget
    max_prompt_tokens: int
    prompts: str | None = None
    """The directory holding code-prompts.jsonl.xz (run_quality.py's --prompts)."""
    kinds: tuple[str, ...] = (*KINDS, *MORE_KINDS)
    name: str = "package code"
    source_answers: ClassVar[bool] = False
    """No other writer's answers: the chains are the target's answers alone (no source chain)."""

    @property
    def goals(self) -> Goals:
        return SCALE_GOALS

    def with_prompts(self, directory: Path) -> PackagePromptsTask:
        return replace(self, prompts=str(directory))

    def split(self, tokenizer, training_rows: int, held_out_rows: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
        """`training_rows` training rows (the file's first that are short enough) and `held_out_rows` held-out
        ones (the kinds in turn), and their counts."""
        if self.prompts is None or not (Path(self.prompts) / OUTPUT).is_file():
            raise ValueError(f"the {self.name} task reads its prompts from a directory holding {OUTPUT}, and {self.prompts} holds none: "
                             f"pass --prompts DIR (bench/quality/package_prompts.py build or subset writes one)")
        rows = read_lines(Path(self.prompts))
        training, too_long = self.short_rows([r for r in rows if r["split"] == "train"], training_rows, tokenizer)
        short_held_out, held_too_long = self.short_rows([r for r in rows if r["split"] == "held_out"], None, tokenizer)
        held_out = in_turn(short_held_out, held_out_rows)
        if len(training) < training_rows or len(held_out) < held_out_rows:
            raise ValueError(f"{Path(self.prompts) / OUTPUT} holds {len(training)} training and {len(short_held_out)} held-out prompts of at most "
                             f"{self.max_prompt_tokens} tokens; the size asks {training_rows} and {held_out_rows}: "
                             "build a larger part (package_prompts.py subset --train N) or choose a smaller size")
        about = {"file": str(Path(self.prompts) / OUTPUT), "rows": len(rows), "left_out_over_max_prompt_tokens": too_long + held_too_long,
                 "packages": {"training": len({r["package"] for r in training}), "held_out": sorted({r["package"] for r in held_out})}}
        return training, held_out, about

    def short_rows(self, rows: list[dict[str, Any]], wanted: int | None, tokenizer) -> tuple[list[dict[str, Any]], int]:
        """The first `wanted` rows (None: all) whose prompt is at most max_prompt_tokens, and how many longer ones were passed over."""
        kept, too_long = [], 0
        for start in range(0, len(rows), TOKENIZE_BATCH):
            batch = rows[start : start + TOKENIZE_BATCH]
            lengths = tokenizer([row["messages"][0]["content"] for row in batch], add_special_tokens=False, return_length=True)["length"]
            for row, length in zip(batch, lengths, strict=True):
                if wanted is not None and len(kept) == wanted:
                    return kept, too_long
                if length <= self.max_prompt_tokens:
                    kept.append(row)
                else:
                    too_long += 1
        return kept, too_long

    def make_target(self, directory: Path, counts: ChatCounts, device: torch.device, source: Path | None) -> dict[str, Any]:
        made = self.target.make(directory, source)
        return {**made, "target": self.target.name, "prompts": split_with(self, directory, counts.training, counts.held_out)[2]}

    def chat_set(self, target: Path, counts: ChatCounts) -> ChatSet:
        training, held_out, _ = split_with(self, target, counts.training, counts.held_out)
        return ChatSet([row["messages"] for row in training], [row["messages"] for row in held_out],
                       [row["kind"] for row in training + held_out])

    def diversity(self, regenerated: Path, source: Path | None, chat_set: ChatSet, tokenizer, answer_tokens: int) -> dict[str, Any]:
        return diversity_per_kind(regenerated, None, chat_set, tokenizer, answer_tokens, self.kinds)


@functools.lru_cache(maxsize=2)
def split_with(task: PackagePromptsTask, target: Path, training_rows: int, held_out_rows: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """task.split through the target's tokenizer, once a process: the benchmark asks it for the
    target's figures and again for the chat set, and 131K prompts take seconds to tokenize."""
    from transformers import AutoTokenizer

    return task.split(AutoTokenizer.from_pretrained(target), training_rows, held_out_rows)


def in_turn(rows: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`count` rows, one of each kind in turn (a kind with none left is passed over), each kind's in file order."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row)
    queues = [list(reversed(queue)) for _, queue in sorted(by_kind.items())]
    chosen = []
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop())
    return chosen

"""How far a task's held-out prompts are from the drafter's training data and how much the target's
answers depend on them (diversity), read from a chain's run directory: the figures that say whether
the held-out prompts mean anything. Each task (tasks.Task.diversity) reports these and adds its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_jobs.formats import DATASET_KEY, TokenChunk
from dflash_jobs.prepare import HOLDOUT_KEY
from dflash_jobs.rows import prompt_length

DISTINCT_GOAL = 0.9
"""Distinct held-out answers per held-out prompt, at least: the target's answers depend on the prompt."""
VERBATIM_GOAL = 0.05
"""Held-out answers found word for word in a training answer, at most: the drafter cannot have learnt them."""
THINK_END = "</think>"


def split_samples(chunk: TokenChunk) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, answer) token ids of every sample: the answer is its last supervised run."""
    pairs = []
    for i in range(chunk.num_samples):
        ids, mask = chunk.sample(i)
        cut = prompt_length(mask)
        pairs.append((tuple(ids[:cut].tolist()), tuple(ids[cut:].tolist())))
    return pairs


def training_samples(chain_dir: Path) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, answer) token ids of every sample the chain's drafter trained on."""
    index = json.loads((chain_dir / "run" / DATASET_KEY).read_text())
    return [pair for chunk in index["chunks"]
            for pair in split_samples(TokenChunk.decode((chain_dir / "run" / chunk["path"]).read_bytes(), chunk["path"]))]


def reply(text: str) -> str:
    """An answer's text after its (empty) thinking block, without the turn's end."""
    return text.split(THINK_END)[-1].replace("<|im_end|>", "").strip()


@dataclass(frozen=True, slots=True)
class HeldOutAnswers:
    """The target's greedy answers to the held-out prompts (the generate step's, in the regenerated
    chain's held-out samples), cut where the evaluation stops decoding, beside what the drafter
    trained on."""

    sample_ids: list[int]
    """The data set's row of each (prepare's sample ids)."""
    prompts: list[tuple[int, ...]]
    cut: list[tuple[int, ...]]
    found: list[bool]
    """Whether a training answer begins with it, token for token."""
    replies: list[str]
    """Its text after the (empty) thinking block, not cut."""
    trained: list[tuple[tuple[int, ...], tuple[int, ...]]]
    """(prompt, answer) of every training sample."""


def held_out_answers(regenerated: Path, tokenizer, answer_tokens: int) -> HeldOutAnswers:
    held = held_out_samples(regenerated)
    held_pairs, trained = split_samples(held), training_samples(regenerated)
    cut = [answer[:answer_tokens] for _, answer in held_pairs]
    return HeldOutAnswers(
        held.sample_ids.tolist(), [prompt for prompt, _ in held_pairs], cut,
        [any(trained_answer[: len(answer)] == answer for _, trained_answer in trained) for answer in cut],
        [reply(tokenizer.decode(answer)) for _, answer in held_pairs], trained,
    )


def distinct_and_found(cut: list[tuple[int, ...]], found: list[bool]) -> dict[str, Any]:
    """How many of these held-out answers are distinct and how many were found among the training answers, against the goals."""
    prompts, distinct, verbatim = len(cut), len(set(cut)), sum(found)
    return {"held_out_prompts": prompts, "held_out_answers_distinct": distinct, "held_out_answers_found_in_training_answers": verbatim,
            "distinct_share": round(distinct / prompts, 3), "verbatim_share": round(verbatim / prompts, 3),
            "met": distinct >= DISTINCT_GOAL * prompts and verbatim <= VERBATIM_GOAL * prompts}


def diversity(regenerated: Path, source: Path | None, tokenizer, answer_tokens: int) -> dict[str, Any]:
    """How far the held-out prompts are from the drafter's training data, and how much the target's
    answers to them depend on them (held_out_answers), with how often the target says what the data
    set's writer says (`source`: the source chain; None for a task without one). A task adds figures
    of its own (tasks.py)."""
    answers = held_out_answers(regenerated, tokenizer, answer_tokens)
    trained_prompts = {prompt for prompt, _ in answers.trained}
    shares = distinct_and_found(answers.cut, answers.found)
    meaningful = shares.pop("met")
    prompts, distinct, verbatim = (shares[key] for key in ("held_out_prompts", "held_out_answers_distinct", "held_out_answers_found_in_training_answers"))
    return {
        **shares,
        "held_out_prompts_equal_to_a_training_prompt": sum(prompt in trained_prompts for prompt in answers.prompts),
        **({} if source is None else {"held_out_answers_equal_to_source": equal_to_source(answers, source, tokenizer)}),
        "answer_tokens": answer_tokens,
        "training_prompts": len(answers.trained),
        "training_answers_distinct": len({answer for _, answer in answers.trained}),
        "goals": {"distinct_share_at_least": DISTINCT_GOAL, "verbatim_share_at_most": VERBATIM_GOAL, "met": meaningful},
        "verdict": (f"{'meaningful' if meaningful else 'degenerate'}: {distinct} distinct answers to {prompts} held-out prompts, "
                    f"{verbatim} found word for word in a training answer (goals: >= {DISTINCT_GOAL:.0%} distinct, <= {VERBATIM_GOAL:.0%} found)"
                    + ("" if meaningful else "; the figures below say little about a real target")),
    }


def equal_to_source(answers: HeldOutAnswers, source: Path, tokenizer) -> int:
    """How many of the target's held-out answers say word for word what the source chain's writer says."""
    source_answers = [reply(tokenizer.decode(answer)) for _, answer in split_samples(held_out_samples(source))]
    return sum(a == b for a, b in zip(answers.replies, source_answers, strict=True))


def held_out_samples(chain_dir: Path) -> TokenChunk:
    """The held-out samples prepare wrote: the evaluation's prompts with their answers."""
    return TokenChunk.decode((chain_dir / "run" / HOLDOUT_KEY).read_bytes(), HOLDOUT_KEY)

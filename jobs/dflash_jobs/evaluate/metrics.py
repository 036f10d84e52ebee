"""What evaluation measures, as pure functions of decoded outputs returning plain numbers.

Acceptance length (tau): the tokens committed per target verify forward, i.e. accepted drafts
plus the bonus token, averaged over every verify step of every prompt. Plain greedy decoding has
tau = 1; a block of B tokens caps it at B. It is the figure that decides the speed-up, and the
one DFlash papers report.

Acceptance per position: for k = 1..B-1, the fraction of verify steps whose first k drafted
tokens were all accepted. It falls with k; tau = 1 + the sum over k. A drafter that learned only
the next token shows a cliff after k = 1.

Lossless: speculative decoding must return exactly the target's greedy output. Any difference is
a bug (a wrong rollback, a wrong position) unless the target's top two logits were within
numerical noise of each other there, which happens in bf16: each mismatch is reported with that
logit margin so the two cases can be told apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from dflash_jobs.drafter.speculative import Decoded


def acceptance_length(decoded: Sequence[Decoded]) -> float:
    """Mean tokens committed per verify step (accepted drafts + the bonus token)."""
    steps = [accepted + 1 for d in decoded for accepted in d.accepted]
    return sum(steps) / len(steps) if steps else 0.0


def acceptance_per_position(decoded: Sequence[Decoded], block_size: int) -> list[float]:
    """rates[k - 1] = the fraction of verify steps that accepted at least k drafted tokens, k = 1..B-1."""
    accepted = [a for d in decoded for a in d.accepted]
    if not accepted:
        return [0.0] * (block_size - 1)
    return [sum(a >= k for a in accepted) / len(accepted) for k in range(1, block_size)]


def tokens_per_second(decoded: Sequence[Decoded]) -> float:
    """Generated tokens over wall time, prefill included, summed over prompts."""
    seconds = sum(d.seconds for d in decoded)
    return sum(len(d.tokens) for d in decoded) / seconds if seconds > 0 else 0.0


@dataclass
class Mismatch:
    prompt: int
    """Index of the prompt."""
    position: int
    """First generated token that differs from plain greedy."""
    greedy_margin: float | None
    """The target's top-1 minus top-2 logit there in the greedy run: ~0 means a numerical near-tie."""


def mismatches(speculative: Sequence[Decoded], greedy: Sequence[Decoded]) -> list[Mismatch]:
    """Prompts whose speculative output differs from plain greedy, with where and how close the call was."""
    found = []
    for index, (spec, plain) in enumerate(zip(speculative, greedy, strict=True)):
        if spec.tokens == plain.tokens:
            continue
        position = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b), min(len(spec.tokens), len(plain.tokens)))
        margin = plain.margins[position] if position < len(plain.margins) else None
        found.append(Mismatch(prompt=index, position=position, greedy_margin=margin))
    return found


def summarize(decoded: Sequence[Decoded], greedy: Sequence[Decoded], block_size: int) -> dict[str, Any]:
    """The figures of one drafter against plain greedy on the same prompts."""
    wrong = mismatches(decoded, greedy)
    speed, baseline = tokens_per_second(decoded), tokens_per_second(greedy)
    return {
        "acceptance_length": acceptance_length(decoded),
        "acceptance_per_position": acceptance_per_position(decoded, block_size),
        "verify_steps": sum(len(d.accepted) for d in decoded),
        "tokens": sum(len(d.tokens) for d in decoded),
        "tokens_per_second": speed,
        "speedup": speed / baseline if baseline > 0 else 0.0,
        "lossless": not wrong,
        "mismatches": [asdict(m) for m in wrong],
    }

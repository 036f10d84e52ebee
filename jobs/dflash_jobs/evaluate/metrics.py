"""What evaluation measures, as pure functions of decoded outputs returning plain numbers.

Acceptance length (tau): the tokens committed per target verify forward, i.e. accepted drafts
plus the bonus token, averaged over every verify step of every prompt. Plain greedy decoding has
tau = 1; a block of B tokens caps it at B. It is the figure that decides the speed-up, and the
one DFlash papers report.

Acceptance per position: for k = 1..B-1, the fraction of verify steps whose first k drafted
tokens were all accepted. It falls with k; tau = 1 + the sum over k. A drafter that learned only
the next token shows a cliff after k = 1.

Lossless: speculative decoding must return exactly the target's greedy output. A difference is a
bug (a wrong rollback, a wrong position) unless the target's top two logits tied there within its
rounding: in bf16 a verify forward over a block and a one-token decode step round differently, so
an exact tie (margin 0) can break either way. A mismatch is a tie when greedy's top-1 minus top-2
logit is at most `tie_ulps` units in the last place of the top-1 logit in the evaluation's dtype;
only the others make a drafter not lossless. Every mismatch is reported, with its margin, the
tolerance it was held to, and the verdict.

Simulated acceptance (train/serve consistency): the same acceptance, teacher forced, as training
and SpecForge's DFlash evaluation compute it (evaluate/simulated.py): an anchor at every position
of greedy's output, accepted length = 1 + the leading slots whose argmax equals the label. It
should match the decoded acceptance per position; where it does not, training and serving
disagree about what the drafter sees (label offsets and the context mask are where such bugs were
shipped before).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from dflash_jobs.drafter.speculative import Decoded

CONSISTENCY_TOLERANCE = 0.10
"""Relative gap between decoded and simulated acceptance at a position above which the report names it."""
NOISE_STANDARD_ERRORS = 2.0
"""...and only where the gap also exceeds this many standard errors of a rate over the decoded verify
steps: at the last positions a handful of steps decide the rate, and 10% of a tiny rate is noise."""


def mean_committed(accepted: Sequence[int]) -> float:
    """1 + the mean accepted drafts: tokens committed per verify step (or per simulated anchor)."""
    return 1 + sum(accepted) / len(accepted) if accepted else 0.0


def rates_per_position(accepted: Sequence[int], block_size: int) -> list[float]:
    """rates[k - 1] = the fraction of steps that accepted at least k drafted tokens, k = 1..B-1."""
    if not accepted:
        return [0.0] * (block_size - 1)
    return [sum(a >= k for a in accepted) / len(accepted) for k in range(1, block_size)]


def verify_steps(decoded: Sequence[Decoded]) -> list[int]:
    """The accepted drafts of every verify step of every prompt."""
    return [accepted for d in decoded for accepted in d.accepted]


def acceptance_length(decoded: Sequence[Decoded]) -> float:
    """Mean tokens committed per verify step (accepted drafts + the bonus token)."""
    return mean_committed(verify_steps(decoded))


def acceptance_per_position(decoded: Sequence[Decoded], block_size: int) -> list[float]:
    """rates[k - 1] = the fraction of verify steps that accepted at least k drafted tokens, k = 1..B-1."""
    return rates_per_position(verify_steps(decoded), block_size)


def tokens_per_second(decoded: Sequence[Decoded]) -> float:
    """Generated tokens over wall time, prefill included, summed over prompts."""
    seconds = sum(d.seconds for d in decoded)
    return sum(len(d.tokens) for d in decoded) / seconds if seconds > 0 else 0.0


def tie_tolerance(top_logit: float, dtype: torch.dtype, ulps: int) -> float:
    """`ulps` units in the last place of `top_logit` in `dtype`: the margin under which two logits tie within rounding."""
    finfo = torch.finfo(dtype)
    exponent = math.frexp(max(abs(top_logit), finfo.tiny))[1] - 1  # top_logit = m * 2**exponent, 1 <= m < 2
    return ulps * finfo.eps * 2.0**exponent


@dataclass
class Mismatch:
    prompt: int
    """Index of the prompt."""
    position: int
    """First generated token that differs from plain greedy."""
    greedy_margin: float | None
    """The target's top-1 minus top-2 logit there in the greedy run: ~0 means a numerical near-tie."""
    greedy_top_logit: float | None
    """The target's top-1 logit there, the scale of its rounding."""
    tie_tolerance: float | None
    """The margin at or under which this counts as a tie (eval.tie_ulps units in the last place of the top-1 logit)."""
    tie: bool
    """True: greedy's top two logits tied within rounding, either token is the target's greedy choice; False: a real difference."""


def mismatches(speculative: Sequence[Decoded], greedy: Sequence[Decoded], *, dtype: torch.dtype, tie_ulps: int) -> list[Mismatch]:
    """Prompts whose speculative output differs from plain greedy: where, how close the call was, and whether it was a tie."""
    found = []
    for index, (spec, plain) in enumerate(zip(speculative, greedy, strict=True)):
        if spec.tokens == plain.tokens:
            continue
        position = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b), min(len(spec.tokens), len(plain.tokens)))
        if position < len(plain.margins):
            margin, top = plain.margins[position], plain.top_logits[position]
            tolerance = tie_tolerance(top, dtype, tie_ulps)
            found.append(Mismatch(index, position, margin, top, tolerance, tie=margin <= tolerance))
        else:  # greedy stopped there and the drafter's run did not (or the reverse): no logits to call it a tie
            found.append(Mismatch(index, position, None, None, None, tie=False))
    return found


def simulated_consistency(decoded_rates: Sequence[float], simulated_rates: Sequence[float], steps: int) -> dict[str, Any]:
    """Per position, the relative gap (decoded - simulated) / simulated (None where simulated is 0),
    and the 1-based positions where it exceeds CONSISTENCY_TOLERANCE beyond the decoded rate's noise."""
    gaps: list[float | None] = []
    disagreeing = []
    for k, (decoded, simulated) in enumerate(zip(decoded_rates, simulated_rates, strict=True), 1):
        gaps.append((decoded - simulated) / simulated if simulated > 0 else None)
        pooled = (decoded + simulated) / 2  # a rate of 0 or 1 on one side still has binomial noise on the other
        noise = NOISE_STANDARD_ERRORS * math.sqrt(pooled * (1 - pooled) / steps) if steps else math.inf
        if abs(decoded - simulated) > max(CONSISTENCY_TOLERANCE * simulated, noise):
            disagreeing.append(k)
    return {"relative_gap": gaps, "tolerance": CONSISTENCY_TOLERANCE, "disagreeing_positions": disagreeing}


def same_anchor_pairs(simulated: Sequence[int], decoded: Decoded, greedy_tokens: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """(simulated, decoded) accepted drafts at each verify step whose anchor the simulation drafted
    from too: the same anchor, context and labels. simulated[i] is the anchor at greedy's i-th new
    token; the first block anchors at token 0, each next one `accepted + 1` tokens later. Only steps
    while the decoded output is still greedy's (a tie broken otherwise moves every later anchor) and
    that drafted all B - 1 slots (the last block drafts fewer) are compared."""
    pairs, anchor = [], 0
    for accepted, drafted in zip(decoded.accepted, decoded.drafted):
        end = anchor + accepted + 1
        if list(decoded.tokens[:end]) != list(greedy_tokens[:end]):
            break
        if drafted == block_size - 1 and anchor < len(simulated):
            pairs.append((simulated[anchor], accepted))
        anchor = end
    return pairs


def summarize_simulated(
    simulated: Sequence[Sequence[int]], decoded: Sequence[Decoded], greedy_tokens: Sequence[Sequence[int]], block_size: int,
) -> dict[str, Any]:
    """The teacher-forced acceptance of a drafter beside its decoded acceptance on the same prompts;
    `simulated` holds each prompt's per-anchor accepted drafts. Over every anchor it is SpecForge's
    figure; the per-position check compares the two at the same anchors (decoding anchors only where
    a block starts, after a rejection: harder places than the average position, so its rates run
    lower than every-anchor ones even where nothing is wrong)."""
    every = [accepted for prompt in simulated for accepted in prompt]
    pairs = [pair for prompt, d, g in zip(simulated, decoded, greedy_tokens, strict=True) for pair in same_anchor_pairs(prompt, d, g, block_size)]
    simulated_rates = rates_per_position([sim for sim, _ in pairs], block_size)
    decoded_rates = rates_per_position([dec for _, dec in pairs], block_size)
    return {
        "acceptance_length": mean_committed(every),
        "acceptance_per_position": rates_per_position(every, block_size),
        "anchors": len(every),
        "at_decoded_anchors": {"steps": len(pairs), "simulated_per_position": simulated_rates, "decoded_per_position": decoded_rates},
        **simulated_consistency(decoded_rates, simulated_rates, len(pairs)),
    }


def summarize(decoded: Sequence[Decoded], greedy: Sequence[Decoded], block_size: int, *, dtype: torch.dtype, tie_ulps: int) -> dict[str, Any]:
    """The figures of one drafter against plain greedy on the same prompts."""
    found = mismatches(decoded, greedy, dtype=dtype, tie_ulps=tie_ulps)
    speed, baseline = tokens_per_second(decoded), tokens_per_second(greedy)
    return {
        "acceptance_length": acceptance_length(decoded),
        "acceptance_per_position": acceptance_per_position(decoded, block_size),
        "verify_steps": sum(len(d.accepted) for d in decoded),
        "tokens": sum(len(d.tokens) for d in decoded),
        "tokens_per_second": speed,
        "speedup": speed / baseline if baseline > 0 else 0.0,
        "lossless": not any(not m.tie for m in found),
        "ties": sum(m.tie for m in found),
        "mismatches": [asdict(m) for m in found],
    }

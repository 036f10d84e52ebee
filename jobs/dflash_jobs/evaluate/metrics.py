"""What evaluation measures, as pure functions of decoded outputs returning plain numbers.

Acceptance length (tau): the tokens committed per target verify forward, i.e. accepted drafts
plus the bonus token, averaged over every verify step of every prompt. Plain greedy decoding has
tau = 1; a block of B tokens caps it at B. It is the figure that decides the speed-up, and the
one DFlash papers report.

Acceptance per position: for k = 1..B-1, the fraction of verify steps whose first k drafted
tokens were all accepted. It falls with k; tau = 1 + the sum over k. A drafter that learned only
the next token shows a cliff after k = 1.

Conditional acceptance: for k = 1..B-1, among the verify steps that drafted at least k tokens and
accepted the first k - 1, the fraction that accepted draft k too: how well the drafter continues a
block it got right so far, which the unconditional rates mix with how often it got that far. A
step that drafted fewer than k tokens (the output's last block, a baseline that found nothing to
copy) had no draft k to judge and is left out; position k counts its steps beside the rate. It
reads the same committed counts as the rates, so it is stop-aware as they are.

Every verify step counts what it committed to the output: drafts the target agreed with after a
stop token, or past max_new_tokens, are not part of the output and are not counted (the stop
token itself takes the bonus token's place; `Decoded.accepted`).

Lossless: speculative decoding must return exactly the target's greedy output. A difference is a
bug unless it is a numerical tie: the output took a token whose greedy logit was closer to
greedy's top logit than the target's own verify-against-decode rounding, measured on the run
(evaluate/lossless.py TIE_RULE). Every prompt whose output differs is reported with every position
where it leaves greedy's and the verdict of each; a drafter is lossless only without a real mismatch.

Simulated acceptance (train/serve consistency): the same acceptance, teacher forced, as training
and SpecForge's DFlash evaluation compute it (evaluate/simulated.py): an anchor at every position
of greedy's output, accepted length = 1 + the leading slots whose argmax equals the label, cut
where the output ends as a verify step's is. It should match the decoded acceptance per position;
where it does not, training and serving disagree about what the drafter sees (label offsets and
the context mask are where such bugs were shipped before). Too few verify steps at the same
anchors cannot show that either way: the check then says "not compared".

Per prompt, in prompt order (`per_prompt`): each decoding's committed tokens and verify steps (tau
is the sum of the first over the sum of the second), its output tokens and seconds: what pairs two
decodings of the same prompts prompt by prompt, and what tau's 95% interval is drawn from
(evaluate/intervals.py: a paired bootstrap over the prompts).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from dflash_jobs.drafter.speculative import Decoded
from dflash_jobs.evaluate.intervals import PairedBootstrap
from dflash_jobs.evaluate.lossless import Divergence, mismatches

CONSISTENCY_TOLERANCE = 0.10
"""Relative gap between decoded and simulated acceptance at a position above which the report names it."""
NOISE_STANDARD_ERRORS = 2.0
"""...and only where the gap also exceeds this many standard errors of a rate over the decoded verify
steps: at the last positions a handful of steps decide the rate, and 10% of a tiny rate is noise."""
MIN_COMPARED_STEPS = 24
"""Same-anchor verify steps below which the train/serve check says "not compared" instead of a
verdict. Its noise band (NOISE_STANDARD_ERRORS standard errors of a rate near 0.5) is +-0.20 at 24
steps and widens as 1/sqrt(steps), to +-0.32 at 10 and +-0.45 at 5, where a pass would mean
nothing; at 24 a context off by one position (the bug the check exists for: in
tests/test_evaluate_consistency.py it costs the first position over a third of its rate) still
shows. The default evaluation (32 prompts of 256 tokens) compares thousands."""


def mean_committed(accepted: Sequence[int]) -> float:
    """1 + the mean accepted drafts: tokens committed per verify step (or per simulated anchor)."""
    return 1 + sum(accepted) / len(accepted) if accepted else 0.0


def rates_per_position(accepted: Sequence[int], block_size: int) -> list[float]:
    """rates[k - 1] = the fraction of steps that accepted at least k drafted tokens, k = 1..B-1."""
    if not accepted:
        return [0.0] * (block_size - 1)
    return [sum(a >= k for a in accepted) / len(accepted) for k in range(1, block_size)]


def conditional_acceptance(decoded: Sequence[Decoded], block_size: int) -> dict[str, list]:
    """Over every verify step of every prompt: rates[k - 1] = P(accepted >= k | accepted >= k - 1 and
    drafted >= k), k = 1..B-1, None where no step qualifies; steps[k - 1] = how many steps qualified."""
    steps = [(accepted, drafted) for d in decoded for accepted, drafted in zip(d.accepted, d.drafted, strict=True)]
    rates, counts = [], []
    for k in range(1, block_size):
        reached = [accepted for accepted, drafted in steps if accepted >= k - 1 and drafted >= k]
        counts.append(len(reached))
        rates.append(sum(accepted >= k for accepted in reached) / len(reached) if reached else None)  # None, not NaN: strict JSON
    return {"rates": rates, "steps": counts}


def verify_steps(decoded: Sequence[Decoded]) -> list[int]:
    """The accepted drafts of every verify step of every prompt."""
    return [accepted for d in decoded for accepted in d.accepted]


def acceptance_length(decoded: Sequence[Decoded]) -> float:
    """Mean tokens committed per verify step (accepted drafts + the bonus token)."""
    return mean_committed(verify_steps(decoded))


def acceptance_per_position(decoded: Sequence[Decoded], block_size: int) -> list[float]:
    """rates[k - 1] = the fraction of verify steps that accepted at least k drafted tokens, k = 1..B-1."""
    return rates_per_position(verify_steps(decoded), block_size)


def per_prompt(decoded: Sequence[Decoded]) -> dict[str, list]:
    """Per prompt, in prompt order: committed tokens (the verify steps' accepted drafts and bonus
    tokens: what tau sums), verify steps, output tokens and seconds."""
    return {
        "committed": [len(d.accepted) + sum(d.accepted) for d in decoded],
        "verify_steps": [len(d.accepted) for d in decoded],
        "tokens": [len(d.tokens) for d in decoded],
        "seconds": [round(d.seconds, 4) for d in decoded],
    }


def acceptance_interval(prompts: dict[str, list]) -> list[float | None]:
    """tau's 95% interval over the prompts (intervals.PairedBootstrap: every decoding of as many
    prompts is drawn alike, so these intervals are paired), [None, None] without a verify step."""
    return PairedBootstrap(len(prompts["committed"])).tau(prompts).summary(digits=4)["interval"]


def tokens_per_second(decoded: Sequence[Decoded]) -> float:
    """Generated tokens over wall time, prefill included, summed over prompts."""
    seconds = sum(d.seconds for d in decoded)
    return sum(len(d.tokens) for d in decoded) / seconds if seconds > 0 else 0.0


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


def within_output(accepted: Sequence[int], output_length: int) -> list[int]:
    """Per anchor i (the output's i-th token) of the simulation, the accepted drafts cut as a verify
    step's are: one anchored at token i commits at most the output's remaining tokens, so accepts at
    most output_length - 2 - i (the last of them takes the bonus token's place)."""
    return [min(a, output_length - 2 - i) for i, a in enumerate(accepted)]


def same_anchor_pairs(simulated: Sequence[int], decoded: Decoded, greedy_tokens: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """(simulated, decoded) accepted drafts at each verify step whose anchor the simulation drafted
    from too: the same anchor, context and labels. simulated[i] is the anchor at greedy's i-th new
    token, cut where the output ends (within_output); the first block anchors at token 0, each next
    one `accepted + 1` tokens later. Only steps while the decoded output is still greedy's (a tie
    broken otherwise moves every later anchor) and that drafted all B - 1 slots (the last block
    drafts fewer) are compared."""
    simulated = within_output(simulated, len(greedy_tokens))
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
    figure (cut where each output ends); the per-position check compares the two at the same
    anchors (decoding anchors only where a block starts, after a rejection: harder places than the
    average position, so its rates run lower than every-anchor ones even where nothing is wrong),
    and says "not compared" below MIN_COMPARED_STEPS such steps: `disagreeing_positions` is then
    None, never an empty pass."""
    every = [accepted for prompt, g in zip(simulated, greedy_tokens, strict=True) for accepted in within_output(prompt, len(g))]
    pairs = [pair for prompt, d, g in zip(simulated, decoded, greedy_tokens, strict=True) for pair in same_anchor_pairs(prompt, d, g, block_size)]
    simulated_rates = rates_per_position([sim for sim, _ in pairs], block_size)
    decoded_rates = rates_per_position([dec for _, dec in pairs], block_size)
    consistency = simulated_consistency(decoded_rates, simulated_rates, len(pairs))
    compared = len(pairs) >= MIN_COMPARED_STEPS
    if not compared:
        consistency["disagreeing_positions"] = None
        verdict = f"not compared: {len(pairs)} verify steps at the same anchors, fewer than the {MIN_COMPARED_STEPS} a verdict needs"
    else:
        verdict = "disagree" if consistency["disagreeing_positions"] else "agree"
    return {
        "acceptance_length": mean_committed(every),
        "acceptance_per_position": rates_per_position(every, block_size),
        "anchors": len(every),
        "at_decoded_anchors": {
            "steps": len(pairs), "minimum_steps": MIN_COMPARED_STEPS, "compared": compared, "verdict": verdict,
            "simulated_per_position": simulated_rates, "decoded_per_position": decoded_rates,
        },
        **consistency,
    }


def summarize(
    decoded: Sequence[Decoded], greedy: Sequence[Decoded], block_size: int, *, divergences: Sequence[Sequence[Divergence]], tie_tolerance: float,
    timed: tuple[Sequence[Decoded], Sequence[Decoded]] | None = None,
) -> dict[str, Any]:
    """The figures of one drafter against plain greedy on the same prompts; `divergences` holds, per
    prompt, where its output leaves greedy's (lossless.divergences), judged at `tie_tolerance`.
    tokens_per_second and speedup come from `timed` (the drafter's and greedy's decodings of the
    timed subset) where given, else from `decoded` and `greedy` themselves."""
    for prompt, (d, g, found_here) in enumerate(zip(decoded, greedy, divergences, strict=True)):
        if (d.tokens != g.tokens) != bool(found_here):
            raise ValueError(f"prompt {prompt}: the output {'differs from' if d.tokens != g.tokens else 'equals'} greedy's, "
                             f"but its divergences say otherwise ({len(found_here)}): pass lossless.divergences of this output")
    found = mismatches(divergences, tie_tolerance)
    real = sum(not m["tie"] for m in found)
    speed, baseline = (tokens_per_second(d) for d in (timed or (decoded, greedy)))
    prompts = per_prompt(decoded)
    return {
        "acceptance_length": acceptance_length(decoded),
        "acceptance_length_interval": acceptance_interval(prompts),
        "acceptance_per_position": acceptance_per_position(decoded, block_size),
        "conditional_acceptance": conditional_acceptance(decoded, block_size),
        "verify_steps": sum(len(d.accepted) for d in decoded),
        "tokens": sum(len(d.tokens) for d in decoded),
        "tokens_per_second": speed,
        "speedup": speed / baseline if baseline > 0 else 0.0,
        "lossless": real == 0,
        "mismatching_prompts": len(found),
        "ties": len(found) - real,
        "real_mismatches": real,
        "mismatches": found,
        "per_prompt": prompts,
    }

"""Is a speculative output the target's greedy output? Where it is not: a numerical tie, or a bug.

A verify forward runs the target over a block of tokens at once, plain greedy one token at a
time: the same logits computed in another order (a Gated DeltaNet layer's chunked kernel against
its recurrent step, attention over a block against one query), so they round differently. Where
greedy's top logit and another one are closer than that rounding, the verify forward may rank them
the other way and commit that other token: greedy's runner-up, or a lower choice as close to the
top (on an H100 in bf16, a verify forward took greedy's third choice where greedy's top two were
0.0625 apart, against a tolerance of 0.3125 measured on the same run). Either is still the
target's greedy choice within its own numerical noise. Anything else is a bug (a wrong rollback, a
wrong position).

- `verify_noise` measures that rounding on each prompt, on the target itself: the tie tolerance is
  a figure of the run, not a guess about the dtype.
- `divergences` finds every position where an output leaves greedy's, by running greedy along the
  output (teacher forced): after a first difference the two texts differ, and comparing them
  further says nothing, but greedy's choice after the output's own prefix still does.
- `mismatches` gives the verdicts (TIE_RULE): a divergence is a tie only when greedy's logit of the
  output's token there is within the measured tolerance of greedy's top logit; a prompt is a tie
  only when every divergence in it is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from dflash_jobs.drafter.speculative import Decoded, DecodeTarget, greedy_decode

TOLERANCE_STATISTIC = "max over positions of |verify forward - decode step| of greedy's top-1 minus top-2 logit"
TIE_RULE = ("a divergence is a tie where greedy's top logit minus its logit of the output's token (greedy_logit_gap) "
            "is at most the tolerance: the output took greedy's runner-up, or a lower choice as close to the top, "
            "within the target's own rounding; every other divergence is a real mismatch")


@torch.inference_mode()
def verify_noise(target: DecodeTarget, prompt: torch.Tensor, reference: Decoded, block_size: int) -> list[float]:
    """How far a verify forward moves greedy's decision margin, per position of greedy's output.

    The target runs teacher forced over greedy's output in blocks of `block_size` (a verify
    forward's shape, its cache built by such blocks, as speculative decoding builds it). At every
    position it predicts, its logit of greedy's token minus its logit of greedy's runner-up is
    compared with greedy's own margin there (the same two logits from the one-token decode step):
    |difference|. That is exactly the quantity a tie turns on: a verify forward commits the
    runner-up when this difference exceeds greedy's margin. The first token is left out (both
    decodings take it from the same prefill). Costs one forward per block over the output, next to
    greedy's one per token: about 1/block_size of a greedy decode.
    """
    tokens = torch.tensor(reference.tokens, device=target.device)
    runners_up = torch.tensor(reference.runners_up, device=target.device)
    differences = []
    target.reset()
    target.forward(prompt.to(target.device), last_only=True)
    for start in range(0, len(tokens) - 1, block_size):
        logits = target.forward(tokens[start : start + block_size]).float()  # row j predicts token start + j + 1
        predicted = slice(start + 1, min(start + block_size + 1, len(tokens)))
        rows = torch.arange(predicted.stop - predicted.start, device=logits.device)
        margins = logits[rows, tokens[predicted]] - logits[rows, runners_up[predicted]]
        differences.append((margins - torch.tensor(reference.margins[predicted], device=logits.device)).abs())
    return torch.cat(differences).tolist() if differences else []


def tie_tolerance(noise: Sequence[Sequence[float]], block_size: int) -> dict[str, Any]:
    """The run's tie tolerance from every prompt's `verify_noise`: the largest difference seen."""
    every = [difference for prompt in noise for difference in prompt]
    return {"value": max(every, default=0.0), "statistic": TOLERANCE_STATISTIC, "positions": len(every), "block_size": block_size, "rule": TIE_RULE}


@dataclass
class Divergence:
    """A position where an output is not what greedy chooses after the output's own prefix."""

    position: int
    """Index in the output."""
    token: int | None
    """The output's token there (None: the output ended before it)."""
    greedy_token: int | None
    """Greedy's choice after the same prefix (None: no record, see `divergences`)."""
    greedy_runner_up: int | None
    """Greedy's second choice there."""
    greedy_margin: float | None
    """Greedy's top-1 minus top-2 logit there: ~0 means a near-tie."""
    greedy_top_logit: float | None
    """Greedy's top-1 logit there, the scale of its rounding."""
    token_logit: float | None = None
    """Greedy's logit of the output's token there (None: no such token, or no record)."""

    @property
    def greedy_logit_gap(self) -> float | None:
        """Greedy's top logit minus its logit of the output's token: what a tie turns on."""
        return None if self.token_logit is None or self.greedy_top_logit is None else self.greedy_top_logit - self.token_logit


def divergences(
    target: DecodeTarget, prompt: torch.Tensor, output: Sequence[int], reference: Decoded, *, max_new_tokens: int, stop_ids: frozenset[int],
) -> list[Divergence]:
    """Every position of `output` that greedy would not choose after the output's own prefix; [] when
    `output` is greedy's (`reference`). Greedy runs along the output one token per step, as plain
    greedy does, so its record at the first difference is the reference's own.

    Where greedy along the output agrees with every one of its tokens and the output is still not
    the reference, greedy itself chose otherwise over the same prefix in its two runs (a tie its
    rounding broke both ways): the first position where the two differ is judged, by the
    reference's record there and the output's token's logit over that same prefix. Only outputs
    that agree up to the shorter one's end differ by their lengths (a loop that went past a stop
    token or max_new_tokens, or stopped short of both)."""
    output = list(output)
    if output == reference.tokens:
        return []
    along = greedy_decode(target, prompt, max_new_tokens=max_new_tokens, stop_ids=stop_ids, forced=output)
    found = [
        Divergence(i, token, along.tokens[i], along.runners_up[i], along.margins[i], along.top_logits[i], along.forced_logits[i])
        for i, token in enumerate(output) if token != along.tokens[i]
    ]
    if found:
        return found
    end = min(len(output), len(reference.tokens))
    first = next((i for i in range(end) if output[i] != reference.tokens[i]), None)
    if first is not None:
        return [Divergence(first, output[first], reference.tokens[first], reference.runners_up[first], reference.margins[first],
                           reference.top_logits[first], along.forced_logits[first])]
    return [Divergence(end, output[end] if end < len(output) else None, None, None, None, None)]


def is_tie(divergence: Divergence, tolerance: float) -> bool:
    """TIE_RULE: the output's token was within the measured noise of greedy's top logit."""
    gap = divergence.greedy_logit_gap
    return gap is not None and gap <= tolerance


def mismatches(found: Sequence[Sequence[Divergence]], tolerance: float) -> list[dict[str, Any]]:
    """One entry per prompt whose output is not greedy's: its divergences with their verdicts, and
    `tie` when every one of them is a tie (else the prompt holds a real mismatch)."""
    verdicts = []
    for prompt, divergence_list in enumerate(found):
        if divergence_list:
            judged = [{**asdict(d), "greedy_logit_gap": d.greedy_logit_gap, "tie": is_tie(d, tolerance)} for d in divergence_list]
            verdicts.append({"prompt": prompt, "tie": all(d["tie"] for d in judged), "divergences": judged})
    return verdicts

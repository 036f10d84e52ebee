"""The plain greedy loop the fast decoder is held to, and where two decodings of the same prompts part.

`plain_greedy` is the simplest loop there is: the whole prompt, then one token at a time through a
dynamic cache and Transformers' own masks, the next token `pick`'s. `Recorder` is a greedy pick
that keeps each step's two best scores and ids, so that where two decodings part the scores say why.

A row's tokens can differ from the plain loop's only after a step where the two best scores were
equal (an exact tie: argmax takes the lowest id, both loops alike) or so close that the rounding
of another kernel (another batch shape, a static cache's longer masked keys) changes their order.
`partings` finds each row's first differing step and classes it; after that step the rows continue
from different prefixes and are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dflash_jobs.static_cache import cache_argument


class Recorder:
    """Greedy (torch.argmax: the lowest id at an exact tie), keeping each step's top two [B, 2]."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        values, ids = logits.topk(2, dim=-1)
        self.values.append(values)
        self.ids.append(ids)
        return logits.argmax(dim=-1)

    def top2(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores [B, steps, 2] and ids [B, steps, 2]."""
        return torch.stack(self.values, dim=1).cpu(), torch.stack(self.ids, dim=1).cpu()


@torch.inference_mode()
def plain_greedy(model, input_ids: torch.Tensor, attention: torch.Tensor, limit: int, pick) -> torch.Tensor:
    """`limit` tokens of each left-padded row [B, P], one forward a step: [B, limit]."""
    from transformers import DynamicCache

    cache = {cache_argument(model): DynamicCache(config=model.config)}
    mask = attention.clone()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
    tokens = []
    for _ in range(limit):
        token = pick(out.logits[:, -1].float())
        tokens.append(token)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions, use_cache=True, **cache)
    return torch.stack(tokens, dim=1)


def bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers at `value` (8 significant bits): one rounding step of a bf16 logit."""
    return math.ldexp(1.0, math.frexp(abs(value))[1] - 8)


@dataclass
class Partings:
    rows: int = 0
    identical: int = 0
    exact_ties: int = 0
    """Rows parting at a step where one decoding's two best scores were equal, the other's choice among them."""
    within_one_step: int = 0
    """Rows parting where the two tokens were each decoding's top two, their scores one bf16 step apart or less."""
    other: int = 0
    """Rows parting anywhere else: a defect."""
    examples: list[dict] = field(default_factory=list)


def partings(a_tokens: torch.Tensor, a: Recorder, b_tokens: torch.Tensor, b: Recorder, *, examples: int = 8) -> Partings:
    """Each row's first step where `a` and `b` chose differently, classed by the scores both saw there."""
    a_values, a_ids = a.top2()
    b_values, b_ids = b.top2()
    steps = min(a_tokens.shape[1], b_tokens.shape[1])
    differ = (a_tokens[:, :steps].cpu() != b_tokens[:, :steps].cpu())
    found = Partings(rows=a_tokens.shape[0])
    for row in range(found.rows):
        where = differ[row].nonzero()
        if where.numel() == 0:
            found.identical += 1
            continue
        t = int(where[0])
        chose_a, chose_b = int(a_tokens[row, t]), int(b_tokens[row, t])
        seen = {name: (values[row, t].tolist(), ids[row, t].tolist()) for name, values, ids in (("a", a_values, a_ids), ("b", b_values, b_ids))}
        both_top2 = all(set(ids) == {chose_a, chose_b} for _, ids in seen.values())
        gaps = {name: values[0] - values[1] for name, (values, _) in seen.items()}
        step = bf16_step(seen["a"][0][0])
        if both_top2 and min(gaps.values()) == 0:
            found.exact_ties += 1
            kind = "exact tie"
        elif both_top2 and max(gaps.values()) <= step:
            found.within_one_step += 1
            kind = "within one bf16 step"
        else:
            found.other += 1
            kind = "other"
        if len(found.examples) < examples:
            found.examples.append({"row": row, "step": t, "kind": kind, "tokens": [chose_a, chose_b], "bf16_step": step,
                                   "top2": {name: {"scores": values, "ids": ids} for name, (values, ids) in seen.items()}})
    return found

"""A confidence head against what verification did (DSpark, reference/dflash2-dspark.md 4.8).

The head predicts, for each drafted slot k, c_k: the probability that draft k is accepted given that
the drafts before it were. Its predicted survival of the first k drafts is a_k = c_1 * ... * c_k,
which is what a scheduler would verify by (DSpark's prefix scheduler, vLLM's adaptive
verification). The realized survival is whether the verify step accepted at least k drafts. Per
position k = 1..B, over the decoded verify steps that drafted k tokens or more, the report gives the
mean predicted and realized survival, the Brier score of a_k against the 0/1 outcome and its
expected calibration error over ten bins (DeepSpec's eval/dspark/confidence_head.py reports the
same per position). Decoding verifies the full block whatever the head says: the head only
reports here, so the output stays plain greedy's.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from dflash_jobs.drafter.speculative import Decoded, ModelDrafter

CALIBRATION_BINS = 10


class ConfidenceRecorder(ModelDrafter):
    """A ModelDrafter over a drafter module with a confidence head (its `draft_scored` gives the
    block's drafts and each one's survival probability) that keeps, per call, i.e. per verify step,
    the probabilities of the block's drafts."""

    def __init__(self, drafter, *, drafts: int) -> None:
        super().__init__(drafter, drafts=drafts)
        self.steps: list[torch.Tensor] = []

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        anchor_position = len(tokens) - 1
        positions = torch.arange(anchor_position, device=context.device)
        drafts, survival = self.drafter.draft_scored(context[None], positions, tokens[-1], anchor_position)
        self.steps.append(survival)  # read at take(): reading it here would cost the verify step a sync
        return drafts

    def take(self) -> list[list[float]]:
        """The steps recorded since the last call (one decoded prompt's), in verify order."""
        steps, self.steps = self.steps, []
        return [step.tolist() for step in steps]


def recorder_for(drafter, *, drafts: int) -> ConfidenceRecorder | None:
    """A ConfidenceRecorder for a drafter module with a confidence head; None for one without."""
    return ConfidenceRecorder(drafter, drafts=drafts) if getattr(drafter, "confidence_head", None) is not None else None


def expected_calibration_error(predicted: Sequence[float], outcomes: Sequence[bool], bins: int = CALIBRATION_BINS) -> float | None:
    """Sum over equal-width bins of predicted probability of (share of the pairs) x |mean predicted - mean outcome|."""
    totals: dict[int, list[float]] = {}
    for p, outcome in zip(predicted, outcomes, strict=True):
        entry = totals.setdefault(min(int(p * bins), bins - 1), [0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += p
        entry[2] += outcome
    return sum(abs(p - o) for _, p, o in totals.values()) / len(predicted) if predicted else None


def summarize_calibration(steps: Sequence[Sequence[Sequence[float]]], decoded: Sequence[Decoded], drafts: int) -> dict[str, Any]:
    """Predicted against realized survival per draft position 1..`drafts`; steps[prompt][step] holds
    the survival probabilities of that verify step's block, decoded[prompt] its accepted and drafted counts."""
    per_position = []
    for k in range(1, drafts + 1):
        predicted, realized = [], []
        for prompt_steps, d in zip(steps, decoded, strict=True):
            for survival, accepted, drafted in zip(prompt_steps, d.accepted, d.drafted, strict=True):
                if drafted >= k:
                    predicted.append(math.prod(survival[:k]))
                    realized.append(accepted >= k)
        count = len(predicted)
        per_position.append({
            "position": k,
            "steps": count,
            "predicted_survival": sum(predicted) / count if count else None,  # None, not NaN: report.json stays strict JSON
            "realized_survival": sum(realized) / count if count else None,
            "brier": sum((p - o) ** 2 for p, o in zip(predicted, realized)) / count if count else None,
            "ece": expected_calibration_error(predicted, realized),
        })
    return {
        "per_position": per_position,
        # 1 + the sum of the per-position means: the acceptance length each side implies.
        "predicted_acceptance_length": 1 + sum(p["predicted_survival"] for p in per_position if p["steps"]),
        "realized_acceptance_length": 1 + sum(p["realized_survival"] for p in per_position if p["steps"]),
    }

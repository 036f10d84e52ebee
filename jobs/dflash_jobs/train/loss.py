"""The DFlash objective: weighted cross-entropy on block slots 1..B-1 (reference/dflash.md 3.4).

    L = sum_{n, k>=1} m[n,k] * exp(-(k-1)/gamma) * CE[n,k] / sum_{n, k>=1} m[n,k] * exp(-(k-1)/gamma)

where m is 1 where the label exists and is supervised (loss_mask at the label position). Slot 0 is
the clean anchor token and is never trained.

The logits are computed in row chunks: at vocab 248K, [512 anchors x 16 slots, V] in fp32 is 8 GB
per sample. The chunked function also computes the gradient with respect to the hidden states in
the same pass (softmax minus one-hot, times the frozen LM head), so backward needs no second
[rows, V] matmul and no logits are kept for it. Between the chunk's two matmuls, _chunk_terms does
the elementwise work; compiled (train.compile, on by default on a GPU), it is a few fused kernels
that read the bf16 logits about twice and write the bf16 gradient once, where eager makes ten
passes over fp32 logits. On an H200 at the 27B shape that took the compiled step from 1.30 s to
1.23 s (bench/results/train-pinned-h200.json, then train-fused-loss-h200.json).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

DEFAULT_CHUNK_ROWS = 1024
"""Rows per logits chunk: 1024 x 248,320 logits are 0.5 GB in bf16 (1 GB where eager upcasts them)."""


def _chunk_terms(
    logits: torch.Tensor, target: torch.Tensor, row_weights: torch.Tensor, total: torch.Tensor, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's logits [r, V] -> (sum of w * CE, argmax predictions [r], d(loss)/d(logits) or None).

    fp32 inside whatever the matmul returned; the gradient, (softmax - onehot) * w / total, comes
    back in the logits' dtype, the one the second matmul runs in. In place on its fp32 copy, so that
    eager needs no second [r, V] buffer; torch.compile makes the same steps a few fused kernels."""
    scores = logits.float()
    lse = scores.logsumexp(-1, keepdim=True)
    rows = torch.arange(scores.shape[0], device=scores.device)
    ce = lse.squeeze(-1) - scores[rows, target]
    predictions = scores.argmax(-1)
    grad_logits = None
    if with_grad:
        probs = scores.sub_(lse).exp_()  # softmax, in place of the scores
        probs[rows, target] -= 1
        grad_logits = probs.mul_((row_weights / total)[:, None]).to(logits.dtype)
    return (ce * row_weights).sum(), predictions, grad_logits


@functools.cache
def _fused_chunk_terms():
    # dynamic: the row count changes with the ragged last chunk and every micro-batch; one graph
    # serves them all. Built on first use: torch.compile itself takes seconds to import.
    return torch.compile(_chunk_terms, dynamic=True)


def weight_total(row_weights: torch.Tensor, normalizer: torch.Tensor | None) -> torch.Tensor:
    """What a weighted sum of the loss is divided by: the normalizer (DDP's global mean of the
    weights), else the weights' own sum; never zero."""
    return (row_weights.sum() if normalizer is None else normalizer.float()).clamp(min=1e-12)


def supervised_rows(weights: torch.Tensor) -> torch.Tensor:
    """int64 [R]: the flattened slots of weights [N, B] that carry a loss weight, in order: the rows the chunked pass computes logits for."""
    return weights.flatten().nonzero().squeeze(1)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum(w * CE(hidden @ weight.T, labels)) / normalizer, plus the argmax predictions, chunked over rows.

    The normalizer defaults to sum(w); under DDP it is the mean of sum(w) over the ranks, so the
    averaged gradient is that of the mean over every rank's supervised slots. `weight` (the LM
    head) is frozen: no gradient flows to it. `fused` runs _chunk_terms compiled. With `top_k`, a
    third output: each row's top_k token ids by logit [rows, top_k], best first, read off the same
    logits (no gradient), for a head that re-ranks them (DFlash2's selector)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_rows: int, normalizer: torch.Tensor | None = None, fused: bool = False,
                top_k: int = 0):
        total = weight_total(row_weights, normalizer)
        chunk_terms = _fused_chunk_terms() if fused else _chunk_terms
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        predictions = torch.empty_like(labels)
        candidates = labels.new_empty(labels.shape[0], top_k)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            end = min(start + chunk_rows, hidden.shape[0])
            logits = hidden[start:end].to(weight.dtype) @ weight.T  # [r, V]
            if top_k:  # before _chunk_terms, which may turn fp32 logits into the gradient in place
                candidates[start:end] = logits.topk(top_k, dim=-1).indices
            weighted_ce, chunk_predictions, grad_logits = chunk_terms(logits, labels[start:end], row_weights[start:end], total, needs_grad)
            loss += weighted_ce
            predictions[start:end] = chunk_predictions
            if needs_grad:
                grad_hidden[start:end] = (grad_logits @ weight).to(hidden.dtype)  # [r, d]
        outputs = (loss / total, predictions, candidates) if top_k else (loss / total, predictions)
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.save_for_backward(grad_hidden)
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *grad_indices):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None, None


@dataclass
class DraftLoss:
    """The loss and the raw counts behind the metrics, as tensors: reading them is a device sync,
    so the trainer does it only at its log interval."""

    loss: torch.Tensor  # scalar
    correct_per_slot: torch.Tensor  # int64 [B]: supervised slots predicted right
    supervised_per_slot: torch.Tensor  # int64 [B]: supervised slots
    accepted: torch.Tensor  # int64 scalar: sum over blocks of the longest correct prefix of the drafted slots
    blocks: int
    ratios: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """A variant's own figures as (numerator, denominator) sums, e.g. a head's accuracy: the trainer
    adds them up between log lines and across ranks, and logs numerator / denominator."""
    candidates: torch.Tensor | None = None
    """With draft_loss's top_k: int64 [R, top_k], the top_k tokens by logit of each supervised slot
    (supervised_rows order), best first."""


def draft_loss(
    hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    *, chunk_rows: int = DEFAULT_CHUNK_ROWS, normalizer: torch.Tensor | None = None, fused: bool = False, first_draft: int = 1,
    top_k: int = 0,
) -> DraftLoss:
    """hidden [N, B, d] (after the final norm), labels [N, B], weights [N, B] (0 where unsupervised).

    normalizer: what the weighted sum is divided by (default: this batch's sum of weights).
    fused: the chunks' elementwise work compiled (the trainer asks for it where train.compile resolves on).
    first_draft: the first drafted slot (1 when slot 0 is the anchor, 0 when the anchor is a prediction slot).
    top_k: also return each supervised slot's top_k tokens (DraftLoss.candidates), from the same logits."""
    N, B, d = hidden.shape
    rows = supervised_rows(weights)  # only supervised slots need logits
    flat_labels = labels.flatten()[rows]
    loss, predictions, *candidates = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(N * B, d)[rows], lm_head, flat_labels, weights.flatten()[rows].float(), chunk_rows, normalizer, fused, top_k,
    )
    correct = torch.zeros(N * B, dtype=torch.bool, device=hidden.device)
    correct[rows] = predictions == flat_labels
    correct = correct.view(N, B)
    return DraftLoss(loss, correct.sum(0), (weights > 0).sum(0), accepted_prefix(correct, first_draft).sum(), N,
                     candidates=candidates[0] if candidates else None)


def accepted_prefix(correct: torch.Tensor, first_draft: int) -> torch.Tensor:
    """int64 [N]: per block, the drafted slots a verifier would accept, the longest run of right
    ones from `first_draft`. An unsupervised slot counts as wrong (correct is False there), so the
    estimate errs low."""
    return correct[:, first_draft:].long().cumprod(dim=1).sum(dim=1)


def dflash_objective(drafter, hidden: torch.Tensor, batch, *, normalizer: torch.Tensor | None, fused: bool) -> DraftLoss:
    """DFlash's objective (the module docstring) on a batch's block hidden states [N, B, d]."""
    return draft_loss(hidden, drafter.lm_head, batch.labels, batch.loss_weights, normalizer=normalizer, fused=fused)


def expected_acceptance_length(accepted: float, blocks: float) -> float:
    """tau-hat = 1 + mean accepted prefix: the drafted tokens a verifier would keep, plus its bonus token."""
    return 1.0 + accepted / blocks if blocks else math.nan

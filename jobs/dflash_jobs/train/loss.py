"""The DFlash objective: weighted cross-entropy on block slots 1..B-1 (reference/dflash.md 3.4).

    L = sum_{n, k>=1} m[n,k] * exp(-(k-1)/gamma) * CE[n,k] / sum_{n, k>=1} m[n,k] * exp(-(k-1)/gamma)

where m is 1 where the label exists and is supervised (loss_mask at the label position). Slot 0 is
the clean anchor token and is never trained.

The logits are computed in row chunks: at vocab 248K, [512 anchors x 16 slots, V] in fp32 is 8 GB
per sample. The chunked function also computes the gradient with respect to the hidden states in
the same pass (softmax minus one-hot, times the frozen LM head), so backward needs no second
[rows, V] matmul and no logits are kept for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_CHUNK_ROWS = 1024
"""Rows per logits chunk: 1024 x 248,320 fp32 logits = 1 GB of scratch."""


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """float32 [B]: 0 for the anchor slot, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum(w * CE(hidden @ weight.T, labels)) / normalizer, plus the argmax predictions, chunked over rows.

    The normalizer defaults to sum(w); under DDP it is the mean of sum(w) over the ranks, so the
    averaged gradient is that of the mean over every rank's supervised slots. `weight` (the LM
    head) is frozen: no gradient flows to it."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk_rows: int, normalizer: torch.Tensor | None = None):
        total = (row_weights.sum() if normalizer is None else normalizer.float()).clamp(min=1e-12)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        predictions = torch.empty_like(labels)
        needs_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            end = min(start + chunk_rows, hidden.shape[0])
            rows = torch.arange(end - start, device=hidden.device)
            logits = (hidden[start:end].to(weight.dtype) @ weight.T).float()  # [r, V]
            lse = logits.logsumexp(-1)  # [r]
            target = labels[start:end]
            ce = lse - logits[rows, target]
            loss += (ce * row_weights[start:end]).sum()
            predictions[start:end] = logits.argmax(-1)
            if needs_grad:
                probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                probs[rows, target] -= 1
                probs.mul_((row_weights[start:end] / total)[:, None])
                grad_hidden[start:end] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)  # [r, d]
        ctx.mark_non_differentiable(predictions)
        ctx.save_for_backward(grad_hidden)
        return loss / total, predictions

    @staticmethod
    def backward(ctx, grad_loss, grad_predictions):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None


@dataclass
class DraftLoss:
    """The loss and the raw counts behind the metrics, as tensors: reading them is a device sync,
    so the trainer does it only at its log interval."""

    loss: torch.Tensor  # scalar
    correct_per_slot: torch.Tensor  # int64 [B]: supervised slots predicted right
    supervised_per_slot: torch.Tensor  # int64 [B]: supervised slots
    accepted: torch.Tensor  # int64 scalar: sum over blocks of the longest correct prefix of slots 1..B-1
    blocks: int


def draft_loss(
    hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    *, chunk_rows: int = DEFAULT_CHUNK_ROWS, normalizer: torch.Tensor | None = None,
) -> DraftLoss:
    """hidden [N, B, d] (after the final norm), labels [N, B], weights [N, B] (0 where unsupervised).

    normalizer: what the weighted sum is divided by (default: this batch's sum of weights)."""
    N, B, d = hidden.shape
    rows = weights.flatten().nonzero().squeeze(1)  # only supervised slots need logits
    flat_labels = labels.flatten()[rows]
    loss, predictions = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(N * B, d)[rows], lm_head, flat_labels, weights.flatten()[rows].float(), chunk_rows, normalizer
    )
    correct = torch.zeros(N * B, dtype=torch.bool, device=hidden.device)
    correct[rows] = predictions == flat_labels
    correct = correct.view(N, B)
    # A slot counts towards acceptance only if it and every slot before it are right; an
    # unsupervised slot counts as wrong, so the estimate errs low.
    accepted = correct[:, 1:].long().cumprod(dim=1).sum()
    return DraftLoss(loss, correct.sum(0), (weights > 0).sum(0), accepted, N)


def expected_acceptance_length(accepted: float, blocks: float) -> float:
    """tau-hat = 1 + mean accepted prefix: the drafted tokens a verifier would keep, plus its bonus token."""
    return 1.0 + accepted / blocks if blocks else math.nan

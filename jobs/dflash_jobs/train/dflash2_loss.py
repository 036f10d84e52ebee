"""DFlash2's objective (reference/dflash2-dspark.md 3.4 a, SpecForge's): the DFlash loss plus the
candidate selector's cross-entropy over each drafted slot's strict unary top-K, teacher forced.

    L = (sum w * CE_unary + alpha * sum w * [gold in C] * CE_selector) / sum w

- CE_unary and w are DFlash's (train/loss.py): the data token at the slot, the slot's decay times
  its label's loss mask, and sum w the same normalizer (the global one under DDP).
- C: the slot's top-K tokens by its unary logits U = lm_head(h), best first: what is served.
- CE_selector: cross-entropy over C of S(pred -> c) = U[c] + <A[pred] * P h, B[c]> at the gold (the
  data token); pred is the data token before the slot (the anchor for slot 1), as decoding sees it
  while every earlier draft was right. A slot whose gold is not in C adds nothing to this term: a
  recall miss is the backbone's to fix, not a selector example.
- The selector term trains the backbone too, through U and h (SpecForge's default), unless
  selector_stop_gradient keeps it to the selector.

Cost: C comes from the chunked CE pass's own logits (draft_loss's top_k), so no [rows, V] logits are
made twice; U at the candidates is <h, lm_head[c]>, gathered a chunk of rows at a time in both
passes (CandidateLogits): the whole [rows, K, d] gather, kept for backward, would be 2.3 GB at the
27B shape.

Figures (DraftLoss.ratios): selector_loss, the weighted mean CE_selector over the slots whose gold is
in C (the logged loss adds alpha times its share, which grows with the recall: the total can rise
while both terms fall); selector_accuracy, the selector's teacher-forced choice against the gold
over those slots; unary_accuracy, the unary top-1 on the same slots (what the selector adds is the
difference); top_k_recall, the share of supervised slots whose gold is in C.
The per-slot accuracy and acceptance estimate count the selector's choice: what decoding drafts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from dflash_jobs.train.loss import DEFAULT_CHUNK_ROWS, DraftLoss, accepted_prefix, draft_loss, supervised_rows, weight_total


class CandidateLogits(torch.autograd.Function):
    """<hidden[r], weight[candidates[r, k]]>: the unary logits [R, K] (fp32) at each row's candidates,
    with their gradient to hidden, a chunk of rows at a time in both passes (no [R, K, d] gather is
    kept). `weight`, the LM head, is frozen."""

    @staticmethod
    def forward(ctx, hidden, weight, candidates, chunk_rows: int):
        logits = torch.empty(candidates.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            rows = weight[candidates[part]]  # [r, K, d]
            logits[part] = torch.bmm(rows, hidden[part].to(weight.dtype)[:, :, None])[..., 0].float()  # [r, K, d] @ [r, d, 1] -> [r, K]
        ctx.save_for_backward(weight, candidates)
        ctx.chunk_rows, ctx.hidden_dtype = chunk_rows, hidden.dtype
        return logits

    @staticmethod
    def backward(ctx, grad_logits):
        weight, candidates = ctx.saved_tensors
        grad_hidden = torch.empty(candidates.shape[0], weight.shape[1], dtype=ctx.hidden_dtype, device=weight.device)
        for start in range(0, candidates.shape[0], ctx.chunk_rows):
            part = slice(start, start + ctx.chunk_rows)
            rows = weight[candidates[part]]  # [r, K, d]
            grad_hidden[part] = torch.bmm(grad_logits[part].to(weight.dtype)[:, None, :], rows)[:, 0].to(ctx.hidden_dtype)  # [r, 1, K] @ [r, K, d] -> [r, d]
        return grad_hidden, None, None, None


def teacher_forced_predecessors(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """int64 [N, B]: the token before each slot's label, the anchor for slots 0 and 1 (block_ids'
    first column), then the labels (slot k: label k-1). DFlash2 blocks do not sample from the
    anchor: slot k's label is the token at anchor + k."""
    anchors = block_ids[:, :1]
    return torch.cat([anchors, anchors, labels[:, 1:-1]], dim=1)


def dflash2_objective(drafter, hidden: torch.Tensor, batch, *, normalizer: torch.Tensor | None, fused: bool) -> DraftLoss:
    """DFlash2's objective (the module docstring) on a batch's block hidden states [N, B, d]."""
    config, selector = drafter.config, drafter.candidate_selector
    N, B, d = hidden.shape
    weights = batch.loss_weights
    unary_loss = draft_loss(hidden, drafter.lm_head, batch.labels, weights, normalizer=normalizer, fused=fused, top_k=config.selector_top_k)
    rows = supervised_rows(weights)
    candidates = unary_loss.candidates  # [R, K]
    gold = batch.labels.flatten()[rows]
    hits = candidates == gold[:, None]  # [R, K]: the gold's place among the candidates, if any
    covered = hits.any(-1)
    h = hidden.reshape(N * B, d)[rows]
    if config.selector_stop_gradient:
        h = h.detach()
    unary = CandidateLogits.apply(h, drafter.lm_head, candidates, DEFAULT_CHUNK_ROWS)
    predecessors = teacher_forced_predecessors(batch.block_ids, batch.labels).flatten()[rows]
    scores = selector.scores(selector.hidden_projection(h), unary, candidates, predecessors)  # [R, K]
    selector_ce = F.cross_entropy(scores, hits.long().argmax(-1), reduction="none")  # [R]; misses weigh 0 below
    row_weights = weights.flatten()[rows].float()
    selector_weights = row_weights * covered
    selector_sum = (selector_ce * selector_weights).sum()

    with torch.no_grad():
        chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
        right = chosen == gold  # the selector is right only where the gold is a candidate
        unary_right = covered & (candidates[:, 0] == gold)
        correct = torch.zeros(N * B, dtype=torch.bool, device=hidden.device)
        correct[rows] = right
        correct = correct.view(N, B)
        supervised = covered.new_tensor(rows.numel(), dtype=torch.float32)
    return dataclasses.replace(
        unary_loss,
        loss=unary_loss.loss + config.selector_alpha * selector_sum / weight_total(row_weights, normalizer),
        correct_per_slot=correct.sum(0), accepted=accepted_prefix(correct, 1).sum(), candidates=None,
        ratios={
            "selector_loss": (selector_sum.detach(), selector_weights.sum()),
            "selector_accuracy": (right.sum(), covered.sum()),
            "unary_accuracy": (unary_right.sum(), covered.sum()),
            "top_k_recall": (covered.sum(), supervised),
        },
    )

"""DSpark's objective (reference/dflash2-dspark.md 4.4, DeepSpec's `compute_dspark_loss`), per block
slot k = 0..B-1 of an anchor a, supervised while every label before it is (the batch's loss weights
w_k = prefix_k * exp(-k / gamma) already say so):

    z_k   = lm_head(h_k) + W2 W1[prev_k]        the drafter's Markov-corrected logits; prev_0 = x[a], prev_k = x[a + k]
    p_d,k = softmax(z_k)                        p_t,k = softmax(lm_head(final_norm(h_last[a + k])))
    CE_k  = -log p_d,k(x[a + k + 1])            L1_k = ||p_d,k - p_t,k||_1
    c*_k  = clamp(1 - L1_k / 2, 0, 1), detached: the slot's acceptance probability given its prefix
    BCE_k = BCE_with_logits(w . [h_k ; W1[prev_k]] + b, c*_k)
    loss  = (a_ce sum w CE + a_l1 sum w L1 + a_conf sum w BCE) / sum w,    a = (0.1, 0.9, 1.0)

h_last is the target's last decoder layer before its final norm (the store's final hidden state), so
its distribution goes through the target's final norm, in x * w form (the drafter's frozen
`target_norm`, converted from Qwen3.5/3.6's 1 + w when loaded: drafter/checkpoint.py; the drafter's
own `norm` is trained), then the LM head. Every
term is divided by the same sum of weights (the trainer's normalizer, global under DDP). The
confidence head's input is not detached: its loss reaches the backbone and W1 too, as in DeepSpec.
CE-only (train.dspark.ce_only): a_l1 = 0 and no confidence head, so the target's state is never read.

Memory: at vocabulary 248,320 the drafter's and the target's logits over [rows, V] cannot be kept.
`ChunkedMarkovDistillation` computes both a chunk of rows at a time and, in the same pass, the
gradient of CE + L1 with respect to the logits, which it turns into the gradients of the hidden
states, of W1[prev] (then of W1, through the embedding's backward) and of W2: no logits are kept
for backward, as in loss.py's ChunkedLinearCrossEntropy. The elementwise work between the matmuls,
_markov_chunk_terms, is compiled under train.compile.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dflash_jobs.train.loss import DraftLoss, accepted_prefix

CHUNK_ROWS = 512
"""Rows per chunk: the drafter's and the target's logits, 2 x 512 x 248,320, are 0.5 GB in bf16, and
the eager path's two fp32 work buffers 1 GB."""
RATIOS = ("ce", "l1", "confidence", "confidence_target", "confidence_error")
"""The objective's own figures (DraftLoss.ratios), each a weighted mean over the supervised slots:
the cross-entropy, the L1 distance to the target's distribution (0..2), the confidence head's mean
survival probability, the mean acceptance probability it is trained toward (1 - L1/2), and the mean
absolute gap between the two. NaN where the run reads no target distribution (CE-only)."""


def _markov_chunk_terms(
    logits: torch.Tensor, target_logits: torch.Tensor | None, labels: torch.Tensor, row_weights: torch.Tensor,
    total: torch.Tensor, ce_weight: float, l1_weight: float, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's logits [r, V] (and the target's, or None) -> (sum of w * CE, sum of w * L1, L1 per
    row [r], argmax predictions [r], d(loss)/d(logits) or None).

    With p = softmax(z) and s = sign(p - p_t): d CE / dz = p - onehot, d L1 / dz = p * (s - <s, p>)
    (sign(0) = 0, the subgradient autograd takes for abs). fp32 inside, in place on two [r, V]
    buffers (the drafter's probabilities; the target's, then s, then the gradient)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    scores = logits.float()
    lse = scores.logsumexp(-1, keepdim=True)
    ce = lse.squeeze(-1) - scores[rows, labels]
    predictions = scores.argmax(-1)
    probs = scores.sub_(lse).exp_()  # p_d, in place of the scores
    if target_logits is None:
        l1 = torch.zeros_like(ce)
        work = probs.mul(ce_weight) if with_grad else None
    else:
        work = torch.softmax(target_logits, -1, dtype=torch.float32).neg_().add_(probs)  # p_d - p_t
        l1 = torch.linalg.vector_norm(work, ord=1, dim=-1)  # a reduction: no [r, V] temporary of |p_d - p_t|
        if with_grad:
            work.sign_()
            inner = torch.einsum("rv,rv->r", work, probs)[:, None]  # <s, p>
            work.sub_(inner).mul_(l1_weight).add_(ce_weight).mul_(probs)  # p * (a_ce + a_l1 (s - <s, p>))
    grad_logits = None
    if with_grad:
        work[rows, labels] -= ce_weight
        grad_logits = work.mul_((row_weights / total)[:, None]).to(logits.dtype)
    return (ce * row_weights).sum(), (l1 * row_weights).sum(), l1, predictions, grad_logits


@functools.cache
def _fused_markov_chunk_terms():
    # dynamic: the row count changes with the ragged last chunk and every micro-batch.
    return torch.compile(_markov_chunk_terms, dynamic=True)


class ChunkedMarkovDistillation(torch.autograd.Function):
    """(a_ce * sum w CE + a_l1 * sum w L1) / normalizer over rows whose logits are
    hidden @ lm_head.T + embedded @ markov_w2.T (the Markov-corrected logits), against the target's
    softmax(target_hidden @ lm_head.T), chunked over rows; also returns the argmax predictions, the
    L1 distance of every row and the weighted sums of CE and L1 (not differentiable).

    Gradients flow to `hidden` [R, d], `embedded` (W1[prev], [R, r]) and `markov_w2` [V, r]; the LM
    head is frozen and the target's state is data. target_hidden None: CE only (a_l1 unused)."""

    @staticmethod
    def forward(ctx, hidden, lm_head, embedded, markov_w2, target_hidden, labels, row_weights, chunk_rows: int,
                normalizer, ce_weight: float, l1_weight: float, fused: bool):
        total = (row_weights.sum() if normalizer is None else normalizer.float()).clamp(min=1e-12)
        chunk_terms = _fused_markov_chunk_terms() if fused else _markov_chunk_terms
        dtype = lm_head.dtype
        w2 = markov_w2.to(dtype)
        R = hidden.shape[0]
        weighted_ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        weighted_l1 = torch.zeros_like(weighted_ce)
        l1 = torch.empty(R, dtype=torch.float32, device=hidden.device)
        predictions = torch.empty_like(labels)
        needs_grad = any(ctx.needs_input_grad[i] for i in (0, 2, 3))
        grad_hidden = torch.zeros_like(hidden) if needs_grad else None
        grad_embedded = torch.zeros_like(embedded) if needs_grad else None
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=markov_w2.device) if needs_grad else None
        for start in range(0, R, chunk_rows):
            end = min(start + chunk_rows, R)
            h, e = hidden[start:end].to(dtype), embedded[start:end].to(dtype)
            logits = torch.addmm(h @ lm_head.T, e, w2.T)  # [r, V]: lm_head(h) + W2 W1[prev]
            target_logits = None if target_hidden is None else target_hidden[start:end].to(dtype) @ lm_head.T
            chunk_ce, chunk_l1, l1[start:end], predictions[start:end], grad_logits = chunk_terms(
                logits, target_logits, labels[start:end], row_weights[start:end], total, ce_weight, l1_weight, needs_grad,
            )
            weighted_ce += chunk_ce
            weighted_l1 += chunk_l1
            if needs_grad:
                grad_hidden[start:end] = (grad_logits @ lm_head).to(hidden.dtype)  # [r, d]
                grad_embedded[start:end] = (grad_logits @ w2).to(embedded.dtype)  # [r, r_markov]
                grad_w2 += grad_logits.T @ e  # [V, r_markov]
        loss = (ce_weight * weighted_ce + l1_weight * weighted_l1) / total
        ctx.mark_non_differentiable(l1, predictions, weighted_ce, weighted_l1)
        ctx.save_for_backward(grad_hidden, grad_embedded, grad_w2)
        ctx.w2_dtype = markov_w2.dtype
        return loss, predictions, l1, weighted_ce, weighted_l1

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_hidden, grad_embedded, grad_w2 = ctx.saved_tensors
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype), None, grad_embedded * grad_loss.to(grad_embedded.dtype),
            (grad_w2 * grad_loss).to(ctx.w2_dtype), None, None, None, None, None, None, None, None,
        )


def previous_tokens(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """int64 [N, B]: teacher forcing's token before each slot: the anchor (block_ids[:, 0]) for slot 0,
    then the label of the slot before (slot k's label is the token at anchor + k + 1)."""
    return torch.cat([block_ids[:, :1], labels[:, :-1]], dim=1)


def target_rows(batch) -> torch.Tensor:
    """int64 [N, B]: the context row of each slot's input position, anchor + k, where the target's
    final hidden state gives its next-token distribution (the distribution of slot k's label)."""
    B = batch.block_ids.shape[1]
    return batch.layout.anchor[:, None] + torch.arange(B, device=batch.layout.anchor.device)


def dspark_objective(drafter, hidden: torch.Tensor, batch, *, normalizer: torch.Tensor | None, fused: bool,
                     chunk_rows: int = CHUNK_ROWS) -> DraftLoss:
    """DSpark's objective (the module docstring) on a batch's block hidden states [N, B, d], with the
    weights of drafter.config (train.dspark). The target's final hidden state is read from
    batch.final_hidden [C, d] (pre-norm, row for row with the context) when the objective needs it."""
    config = drafter.config
    N, B, d = hidden.shape
    weights = batch.loss_weights.flatten()
    rows = weights.nonzero().squeeze(1)  # only supervised slots need logits
    row_weights = weights[rows].float()
    labels = batch.labels.flatten()[rows]
    embedded = drafter.markov_head.markov_w1(previous_tokens(batch.block_ids, batch.labels).flatten()[rows])  # [R, r]
    target_hidden = None
    if config.reads_target:
        with torch.no_grad():  # the target's state through its own final norm; data, not a parameter
            target_hidden = drafter.target_final_norm(batch.final_hidden[target_rows(batch).flatten()[rows]])
    slot_hidden = hidden.reshape(N * B, d)[rows]
    loss, predictions, l1, weighted_ce, weighted_l1 = ChunkedMarkovDistillation.apply(
        slot_hidden, drafter.lm_head, embedded, drafter.markov_head.markov_w2.weight, target_hidden, labels, row_weights,
        chunk_rows, normalizer, config.ce_weight, config.l1_weight, fused,
    )
    supervised = row_weights.sum()
    nothing = supervised.new_zeros(())
    ratios = {"ce": (weighted_ce, supervised), "l1": (weighted_l1, supervised if target_hidden is not None else nothing)}
    if drafter.confidence_head is not None:
        total = (supervised if normalizer is None else normalizer.float()).clamp(min=1e-12)
        confidence_logits = drafter.confidence_head(slot_hidden, embedded)  # [R]
        acceptance = (1 - l1 / 2).clamp(0, 1)  # c*: not differentiable (l1 is not)
        bce = F.binary_cross_entropy_with_logits(confidence_logits, acceptance, reduction="none")
        loss = loss + config.confidence_weight * (bce * row_weights).sum() / total
        survival = confidence_logits.detach().sigmoid()
        ratios.update(
            confidence=((survival * row_weights).sum(), supervised),
            confidence_target=((acceptance * row_weights).sum(), supervised),
            confidence_error=(((survival - acceptance).abs() * row_weights).sum(), supervised),
        )
    else:
        ratios.update({name: (nothing, nothing) for name in ("confidence", "confidence_target", "confidence_error")})
    correct = torch.zeros(N * B, dtype=torch.bool, device=hidden.device)
    correct[rows] = predictions == labels
    correct = correct.view(N, B)
    # Every slot is a draft (the anchor is a prediction slot): a block's acceptance is its leading run from slot 0.
    return DraftLoss(loss, correct.sum(0), (batch.loss_weights > 0).sum(0), accepted_prefix(correct, 0).sum(), N, ratios)

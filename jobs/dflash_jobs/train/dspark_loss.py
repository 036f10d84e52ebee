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

Memory and speed: at vocabulary 248,320 the drafter's and the target's logits over [rows, V] cannot
be kept. `ChunkedMarkovDistillation` computes both a chunk of rows at a time and, in the same pass,
the gradient of CE + L1 with respect to the logits, which it turns into the gradients of the hidden
states, of W1[prev] (then of W1, through the embedding's backward) and of W2: no logits are kept
for backward, as in loss.py's ChunkedLinearCrossEntropy. Per chunk, the vocabulary-sized work is
three large matmuls and one fused elementwise pass (the H100 profile of the earlier version,
bench/results/train-dspark-profile-h100.json, spent ~185 ms a step on what this cuts):
- the Markov bias rides in the LM head's matmul: [h ; W1[prev]] @ [lm_head ; W2].T, one matmul of
  inner size d + r, and the gradient pass's g @ [lm_head ; W2] gives the gradients of h and W1[prev]
  together, where d(W1[prev]) = g @ W2 alone (inner size V, output [r, 256]) ran as a slow split-K
  matmul; the joined table is built once a step and held while the chunks run (2.7 GB at the 27B
  shape, bf16 [248,320, 5,120 + 256]);
- the target's logits only for distinct context rows: overlapping blocks (anchors closer than B)
  share the target's state at a position, so the rows are sorted by that position and each chunk
  computes each position's logits once (anchors drawn as sample_anchors draws them: 0.63 of the
  rows distinct at 512 per 4,096-token document and B = 8, 0.61 at 64 per 512; fewer in shorter ones);
- _markov_chunk_terms, compiled under train.compile, is meant to read the bf16 logits and write the
  bf16 gradient with nothing [r, V] in between (FUSION_LIMITS): every row reduction (logsumexp,
  argmax, L1, <s, p>) one Inductor fuses, where an einsum for <s, p> ran as a bmm over fp32 [r, V]
  tensors written out for it (only Inductor's CPU code is read here: on a GPU, unverified);
- 1,024 rows a chunk, as DFlash's loss: half the chunks, and the W2 gradient's matmul (inner size
  the chunk's rows) twice as deep.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dflash_jobs.train.loss import DEFAULT_CHUNK_ROWS, DraftLoss, accepted_prefix, supervised_rows, weight_total

CHUNK_ROWS = DEFAULT_CHUNK_ROWS
"""Rows per chunk: the drafter's and the target's logits and the gradient, 3 x 1,024 x 248,320, are
1.5 GB in bf16; the eager path's two fp32 work buffers add 2 GB (the earlier 512 rows: half of each)."""
RATIOS = ("ce", "l1", "confidence", "confidence_target", "confidence_error")
"""The objective's own figures (DraftLoss.ratios), each a weighted mean over the supervised slots:
the cross-entropy, the L1 distance to the target's distribution (0..2), the confidence head's mean
survival probability, the mean acceptance probability it is trained toward (1 - L1/2), and the mean
absolute gap between the two. NaN where the run reads no target distribution (CE-only)."""


def _markov_chunk_terms(
    logits: torch.Tensor, target_logits: torch.Tensor | None, target_index: torch.Tensor | None, labels: torch.Tensor,
    row_weights: torch.Tensor, total: torch.Tensor, ce_weight: float, l1_weight: float, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's logits [r, V] (and the target's over its distinct context rows [u, V], row i's at
    target_index[i], or None) -> (sum of w * CE, sum of w * L1, L1 per row [r], argmax predictions
    [r], d(loss)/d(logits) or None).

    With p = softmax(z) and s = sign(p - p_t): d CE / dz = p - onehot, d L1 / dz = p * (s - <s, p>)
    (sign(0) = 0, the subgradient autograd takes for abs). fp32 inside: eager, in place on two
    [r, V] buffers (the drafter's probabilities; the target's, then s, then the gradient); compiled,
    fused reductions and one pointwise pass that recompute p and p_t from the bf16 logits. Two steps
    take another form compiled (`fusing`): eager's einsum and indexed update need no [r, V]
    temporary, but under Inductor each makes it write an fp32 [r, V] tensor out first (the einsum a
    bmm over two of them), where a product summed and a comparison with the vocabulary fuse."""
    fusing = torch.compiler.is_compiling()
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
        work = torch.softmax(target_logits[target_index], -1, dtype=torch.float32).neg_().add_(probs)  # p_d - p_t
        l1 = torch.linalg.vector_norm(work, ord=1, dim=-1)  # a reduction: no [r, V] temporary of |p_d - p_t|
        if with_grad:
            work.sign_()
            inner = (work * probs).sum(-1, keepdim=True) if fusing else torch.einsum("rv,rv->r", work, probs)[:, None]  # <s, p>
            work.sub_(inner).mul_(l1_weight).add_(ce_weight).mul_(probs)  # p * (a_ce + a_l1 (s - <s, p>))
    grad_logits = None
    if with_grad:
        if fusing:  # - a_ce * onehot(label); uint8, since a bool cannot be subtracted
            work = work - ce_weight * (torch.arange(work.shape[1], device=work.device) == labels[:, None]).to(torch.uint8)
        else:
            work[rows, labels] -= ce_weight
        grad_logits = work.mul_((row_weights / total)[:, None]).to(logits.dtype)
    return (ce * row_weights).sum(), (l1 * row_weights).sum(), l1, predictions, grad_logits


FUSION_LIMITS = {"realize_reads_threshold": 16, "realize_opcount_threshold": 256, "realize_acc_reads_threshold": 32}
"""Inductor writes out a value read by several kernels once it reads more than 4 buffers (or an
expression past 30 operations or 8 reads): here sign(p - p_t) and p - p_t read the two logits, both
logsumexps and the target's row index, so the default would store fp32 [r, V] tensors. Recomputing
them from the bf16 logits in each pass costs a few exps; storing them costs 8 bytes an element."""


@functools.cache
def _fused_markov_chunk_terms():
    # dynamic: the row counts change with the ragged last chunk, the distinct target rows and every micro-batch.
    return torch.compile(_markov_chunk_terms, dynamic=True, options=FUSION_LIMITS)


class ChunkedMarkovDistillation(torch.autograd.Function):
    """(a_ce * sum w CE + a_l1 * sum w L1) / normalizer over rows whose logits are
    hidden @ lm_head.T + embedded @ markov_w2.T (the Markov-corrected logits), against the target's
    softmax(target_hidden[target_index] @ lm_head.T), chunked over rows; also returns the argmax
    predictions, the L1 distance of every row and the weighted sums of CE and L1 (not differentiable).

    target_hidden [U, d] holds the distinct target states and target_index [R] (non-decreasing) picks
    each row's, so that a chunk computes each one's logits once. Gradients flow to `hidden` [R, d],
    `embedded` (W1[prev], [R, r]) and `markov_w2` [V, r]; the LM head is frozen and the target's
    state is data. target_hidden None: CE only (a_l1 unused)."""

    @staticmethod
    def forward(ctx, hidden, lm_head, embedded, markov_w2, target_hidden, target_index, labels, row_weights, chunk_rows: int,
                normalizer, ce_weight: float, l1_weight: float, fused: bool):
        total = weight_total(row_weights, normalizer)
        chunk_terms = _fused_markov_chunk_terms() if fused else _markov_chunk_terms
        dtype = lm_head.dtype
        R, d = hidden.shape
        head = torch.cat([lm_head, markov_w2.to(dtype)], dim=1)  # [V, d + r]: the LM head and W2 side by side
        inputs = torch.cat([hidden.to(dtype), embedded.to(dtype)], dim=1)  # [R, d + r]: h and W1[prev] side by side
        starts = list(range(0, R, chunk_rows))
        target_spans = []  # per chunk, the slice of target_hidden its rows read
        if target_hidden is not None:
            target_hidden = target_hidden.to(dtype)
            ends = [min(start + chunk_rows, R) for start in starts]
            bounds = torch.stack([target_index[starts], target_index[[end - 1 for end in ends]] + 1], dim=1)
            target_spans = bounds.tolist()  # one sync for every chunk's span
        weighted_ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        weighted_l1 = torch.zeros_like(weighted_ce)
        l1 = torch.empty(R, dtype=torch.float32, device=hidden.device)
        predictions = torch.empty_like(labels)
        needs_grad = any(ctx.needs_input_grad[i] for i in (0, 2, 3))
        grad_inputs = torch.empty_like(inputs) if needs_grad else None
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=markov_w2.device) if needs_grad else None
        for chunk, start in enumerate(starts):
            end = min(start + chunk_rows, R)
            x = inputs[start:end]
            logits = x @ head.T  # [r, V]: lm_head(h) + W2 W1[prev]
            target_logits = local_index = None
            if target_hidden is not None:
                first, stop = target_spans[chunk]
                target_logits = target_hidden[first:stop] @ lm_head.T  # [u, V], u <= r
                local_index = target_index[start:end] - first
            chunk_ce, chunk_l1, l1[start:end], predictions[start:end], grad_logits = chunk_terms(
                logits, target_logits, local_index, labels[start:end], row_weights[start:end], total, ce_weight, l1_weight,
                needs_grad,
            )
            weighted_ce += chunk_ce
            weighted_l1 += chunk_l1
            if needs_grad:
                torch.mm(grad_logits, head, out=grad_inputs[start:end])  # [r, d + r]: the gradients of h and W1[prev]
                grad_w2 += grad_logits.T @ x[:, d:]  # [V, r_markov]
        loss = (ce_weight * weighted_ce + l1_weight * weighted_l1) / total
        ctx.mark_non_differentiable(l1, predictions, weighted_ce, weighted_l1)
        ctx.save_for_backward(grad_inputs, grad_w2)
        ctx.split = d
        ctx.dtypes = hidden.dtype, embedded.dtype, markov_w2.dtype
        return loss, predictions, l1, weighted_ce, weighted_l1

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_inputs, grad_w2 = ctx.saved_tensors
        hidden_dtype, embedded_dtype, w2_dtype = ctx.dtypes
        grad_hidden, grad_embedded = grad_inputs[:, :ctx.split], grad_inputs[:, ctx.split:]
        return (
            grad_hidden.to(hidden_dtype) * grad_loss.to(hidden_dtype), None,
            grad_embedded.to(embedded_dtype) * grad_loss.to(embedded_dtype),
            (grad_w2 * grad_loss).to(w2_dtype), None, None, None, None, None, None, None, None, None,
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
    rows = supervised_rows(batch.loss_weights)  # only supervised slots need logits
    target_hidden = target_index = None
    if config.reads_target:
        # Rows in the order of the context row whose target state they read, so that a chunk holds
        # a shared row's readers together and computes its logits once (ChunkedMarkovDistillation).
        positions = target_rows(batch).flatten()[rows]
        order = positions.argsort(stable=True)
        rows = rows[order]
        context_rows, target_index = torch.unique_consecutive(positions[order], return_inverse=True)
        with torch.no_grad():  # the target's state through its own final norm; data, not a parameter
            target_hidden = drafter.target_final_norm(batch.final_hidden[context_rows])  # [U, d]
    row_weights = weights[rows].float()
    labels = batch.labels.flatten()[rows]
    embedded = drafter.markov_head.markov_w1(previous_tokens(batch.block_ids, batch.labels).flatten()[rows])  # [R, r]
    slot_hidden = hidden.reshape(N * B, d)[rows]
    loss, predictions, l1, weighted_ce, weighted_l1 = ChunkedMarkovDistillation.apply(
        slot_hidden, drafter.lm_head, embedded, drafter.markov_head.markov_w2.weight, target_hidden, target_index, labels,
        row_weights, chunk_rows, normalizer, config.ce_weight, config.l1_weight, fused,
    )
    supervised = row_weights.sum()
    nothing = supervised.new_zeros(())
    ratios = {"ce": (weighted_ce, supervised), "l1": (weighted_l1, supervised if target_hidden is not None else nothing)}
    if drafter.confidence_head is not None:
        total = weight_total(row_weights, normalizer)
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

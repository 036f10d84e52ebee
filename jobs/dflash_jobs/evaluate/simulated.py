"""Teacher-forced ("simulated") acceptance: the drafter's training forward on the evaluation's own documents.

A document is a held-out prompt followed by plain greedy's output, supervised on the output; its
target states are captured by one forward over it, as extraction captures them, and stored in
bf16 as extraction stores them. The training data path lays it out (`BatchBuilder`: one block per anchor, labels in place, the loss mask at
the label) with an anchor at every supervised position whose successor is supervised, and
`Drafter.forward` runs it under the training mask (`build_attention`). An anchor's accepted
length is the number of leading slots 1..B-1 whose argmax equals the label; an unsupervised slot
(past the end) counts as wrong, as the trainer's acceptance estimate counts it.

This is SpecForge's held-out DFlash evaluation. Speculative decoding on the same prompts should
accept the same per position: both see the same target, drafter and tokens, one through the
serving loop (its own context bookkeeping, positions and mask), the other through the training
one, so a gap between them is a bug in one of the two.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_jobs.drafter.masks import BlockLayout, build_attention
from dflash_jobs.drafter.model import Drafter
from dflash_jobs.formats import TokenChunk, encode_hidden_chunk
from dflash_jobs.train.data import Batch, BatchBuilder, ChunkData, DocumentRef

ATTENTION_PAIRS = 2**24
"""Query-key pairs per attention call: the dense mask and scores of a long document's blocks are
computed a group of blocks at a time, each group against the whole context."""
LOGIT_ELEMENTS = 2**26
"""Logits materialised at once (block slots x vocabulary): at vocab 248K, a few hundred slots."""


def document_batch(document: torch.Tensor, prompt_length: int, hidden: torch.Tensor, drafter: Drafter) -> Batch:
    """The training batch of one document: ids [T], supervised from `prompt_length`, captured layers
    `hidden` [T, L, d] in target_layer_ids order, stored as extraction stores them (a bf16 hidden-state
    chunk) and read back as training reads them; one block per anchor, every anchor candidate taken."""
    config = drafter.config
    T = len(document)
    loss_mask = np.zeros(T, dtype=np.uint8)
    loss_mask[prompt_length:] = 1
    tokens = TokenChunk(
        input_ids=document.cpu().numpy().astype(np.int32), loss_mask=loss_mask,
        cu_seqlens=np.array([0, T], dtype=np.int64), sample_ids=np.zeros(1, dtype=np.int64),
    ).validate("evaluation document")
    layers = list(config.target_layer_ids)
    encoded = encode_hidden_chunk(tokens, hidden.to("cpu", torch.bfloat16), layers=layers, model="evaluation", config_hash="", dtype="bfloat16")
    builder = BatchBuilder(block_size=config.block_size, anchors=T, gamma=1.0, mask_token_id=config.mask_token_id, seed=0, layers=layers)
    document_ref = DocumentRef(chunk=0, index=0, sample_id=0, tokens=T)
    return builder.build([document_ref], {0: ChunkData.from_bytes(encoded, "evaluation document")}, epoch=0)


def blocks_per_call(num_context: int, block_size: int, num_blocks: int) -> int:
    """The most blocks whose queries x keys (context + their slots) stay within ATTENTION_PAIRS (at least 1)."""
    blocks = num_blocks
    while blocks > 1 and blocks * block_size * (num_context + blocks * block_size) > ATTENTION_PAIRS:
        blocks = (blocks + 1) // 2
    return max(blocks, 1)


@torch.inference_mode()
def anchors_accepted(drafter: Drafter, batch: Batch) -> list[int]:
    """Per anchor of the batch, the leading slots 1..B-1 whose argmax through the target's LM head equals the label."""
    config = drafter.config
    device = drafter.fc.weight.device
    batch = batch.to(device)
    layout = batch.layout
    N, B = batch.block_ids.shape
    step = blocks_per_call(layout.num_context, B, N)
    accepted = []
    for first in range(0, N, step):
        rows = slice(first, first + step)
        group = BlockLayout(
            num_context=layout.num_context, block_size=B,
            context_start=layout.context_start[rows], anchor=layout.anchor[rows],
            key_positions=torch.cat([batch.context_positions, batch.block_positions[rows].flatten()]),
        )
        attention = build_attention(group, config.layer_types, config.sliding_window, backend="dense")
        hidden = drafter(batch.context_hidden, batch.context_positions, batch.block_ids[rows], batch.block_positions[rows], attention)
        predicted = argmax_logits(drafter, hidden.flatten(0, 1)).view(hidden.shape[:2])  # [n, B]
        right = (predicted == batch.labels[rows]) & (batch.loss_weights[rows] > 0)
        accepted += right[:, 1:].long().cumprod(dim=1).sum(dim=1).tolist()
    return accepted


def argmax_logits(drafter: Drafter, hidden: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary of hidden [n, d] through the frozen LM head, a bounded slice of logits at a time."""
    rows = max(1, LOGIT_ELEMENTS // drafter.config.vocab_size)
    return torch.cat([drafter.logits(part).argmax(-1) for part in hidden.split(rows)])

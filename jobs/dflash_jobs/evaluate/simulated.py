"""Teacher-forced ("simulated") acceptance: the drafter's training forward on the evaluation's own documents.

A document is a held-out prompt followed by plain greedy's output, supervised on the output; its
target states are captured by one forward over it, as extraction captures them, and stored in
bf16 as extraction stores them. The training data path lays it out (`BatchBuilder`: one block per
anchor, labels by the variant's anchor layout, the loss mask at the label) with an anchor at every
supervised position whose successor is supervised, and the drafter's forward runs it under the
training mask (`build_attention`). An anchor's accepted length is the number of leading drafted
slots whose teacher-forced greedy token (the variant's `predict`) equals the label; an
unsupervised slot (past the end) counts as wrong, as the trainer's acceptance estimate counts it.

This is SpecForge's held-out DFlash evaluation. Speculative decoding on the same prompts should
accept the same per position: both see the same target, drafter and tokens, one through the
serving loop (its own context bookkeeping, positions and mask), the other through the training
one, so a gap between them is a bug in one of the two.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_jobs.spec import AnchorLayout
from dflash_jobs.drafter.masks import build_attention
from dflash_jobs.drafter.model import Drafter
from dflash_jobs.formats import TokenChunk, encode_hidden_chunk
from dflash_jobs.train.chunks import ChunkData
from dflash_jobs.train.data import Batch, BatchBuilder, DocumentRef
from dflash_jobs.train.loss import accepted_prefix
from dflash_jobs.variants import Predict

ATTENTION_PAIRS = 2**24
"""Query-key pairs per attention call: the dense mask and scores of a long document's blocks are
computed a group of blocks at a time, each group against the whole context."""


def document_batch(document: torch.Tensor, prompt_length: int, hidden: torch.Tensor, drafter: Drafter, layout: AnchorLayout) -> Batch:
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
    builder = BatchBuilder(layout=layout, anchors=T, mask_token_id=config.mask_token_id, seed=0, layers=layers)
    document_ref = DocumentRef(chunk=0, index=0, sample_id=0, tokens=T)
    return builder.build([document_ref], {0: ChunkData.from_bytes(encoded, "evaluation document")}, epoch=0)


def blocks_per_call(num_context: int, block_size: int, num_blocks: int) -> int:
    """The most blocks whose queries x keys (context + their slots) stay within ATTENTION_PAIRS (at least 1)."""
    blocks = num_blocks
    while blocks > 1 and blocks * block_size * (num_context + blocks * block_size) > ATTENTION_PAIRS:
        blocks = (blocks + 1) // 2
    return max(blocks, 1)


@torch.inference_mode()
def anchors_accepted(drafter: Drafter, batch: Batch, predict: Predict, anchor_layout: AnchorLayout) -> list[int]:
    """Per anchor of the batch, the leading drafted slots whose teacher-forced greedy token equals the label."""
    config = drafter.config
    batch = batch.to(drafter.fc.weight.device)
    N, B = batch.block_ids.shape
    step = blocks_per_call(batch.layout.num_context, B, N)
    accepted = []
    for first in range(0, N, step):
        group = batch.select(slice(first, first + step))
        attention = build_attention(group.layout, config.layer_types, config.sliding_window, backend="dense", is_causal=config.is_causal)
        hidden = drafter(group.context_hidden, group.context_positions, group.block_ids, group.block_positions, attention)
        right = (predict(drafter, hidden, group) == group.labels) & (group.loss_weights > 0)  # [n, B]
        accepted += accepted_prefix(right, anchor_layout.first_draft).tolist()
    return accepted

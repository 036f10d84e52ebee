"""What a training step computes, in FLOPs, and what share of the card's peak that is (MFU).

Counted: every matmul of the trainable layers x3 (forward, input and weight gradients), fc x3 on the
context, attention over the visible (query, key) pairs only x3 (4 * head_dim per pair forward), the
frozen LM head x2 on supervised slots (logits, and the hidden-state gradient; no weight gradient),
and the variant's own modules (DrafterVariant.extra_flops). Computed on the host from the batch's
layout before it goes to the device, so the log's MFU costs no sync.
"""

from __future__ import annotations

import torch

from dflash_jobs.drafter.model import DrafterConfig

PEAK_BF16_FLOPS_BY_GPU = {"H100": 989e12, "H200": 989e12}
"""Dense bf16 datasheet peaks (SXM) of the cards this project measured on, by a name the device's contains;
elsewhere the log gives TFLOP/s without an MFU."""


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for card, peak in PEAK_BF16_FLOPS_BY_GPU.items() if card in name), None)


def visible_pairs(layout, window: int | None) -> int:
    """Visible (query, key) pairs of one layer, from the block layout (no dense mask)."""
    B = layout.block_size
    before = (layout.anchor - layout.context_start)[:, None].double()  # [N, 1] context tokens before each anchor
    slot = torch.arange(B, device=before.device, dtype=torch.float64)[None, :]
    if window is None:
        return int((before + B).sum().item() * B)
    context = torch.minimum(before, (window - 1 - slot).clamp(min=0))
    return int((context + slot + 1).sum().item())


def attention_flops(config: DrafterConfig, batch) -> float:
    """The forward's attention over every layer's visible pairs (QK^T and PV: 4 * head_dim a pair and head)."""
    return sum(
        4 * config.head_dim * config.num_attention_heads * visible_pairs(batch.layout, config.sliding_window if kind == "sliding_attention" else None)
        for kind in config.layer_types
    )


def step_flops(config: DrafterConfig, batch, variant) -> float:
    d, hd, I = config.hidden_size, config.head_dim, config.intermediate_size
    q_width, kv_width = config.num_attention_heads * hd, config.num_key_value_heads * hd
    C, Q = batch.tokens, batch.block_ids.numel()
    supervised = int((batch.loss_weights > 0).sum())
    per_layer = 2 * Q * d * q_width + 2 * 2 * (C + Q) * d * kv_width + 2 * Q * q_width * d + 3 * 2 * Q * d * I
    fc = 2 * C * config.context_features * d
    backbone = 3 * (config.num_layers * per_layer + attention_flops(config, batch) + fc) + 2 * 2 * supervised * d * config.vocab_size
    return backbone + variant.extra_flops(config, Q, supervised)



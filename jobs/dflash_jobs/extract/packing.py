"""Running packed rows through a Transformers hybrid model (see batching.py for the layout).

Packing needs two things from the model: the Gated DeltaNet layers must keep samples apart, which
FLA's varlen kernel does from `cu_seq_lens_q`, and every full-attention layer must attend within a
sample only, which `packed_sdpa` does by running SDPA per sample. The masked gap tokens make the
causal conv exact without causal-conv1d's `seq_idx`. The mask mapping is handed to the model as a
dict, which Transformers' Qwen3.5/3.6 text model takes as precomputed masks.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_jobs.extract.batching import Batch

# No "flash" in the name: Transformers treats any such name as a FlashAttention kernel.
PACKED_ATTENTION = "per_sample_sdpa"


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    segments: tuple[tuple[int, int], ...],
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA within each [start, end) segment of a packed row: no attention across samples."""
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
            dropout=dropout, scaling=scaling, is_causal=True,
        )[0]
        for start, end in segments
    ]
    return torch.cat(outputs, dim=1), None  # [1, T, heads, head_dim], as every attention function returns


AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)


def can_pack(model: torch.nn.Module) -> bool:
    """Packing is wired for hybrid models whose forward takes a precomputed mask mapping (Qwen3.5/3.6)."""
    layer_types = getattr(model.config, "layer_types", None) or []
    return "linear_attention" in layer_types and "full_attention" in layer_types


def use_packed_attention(model: torch.nn.Module) -> None:
    model.set_attn_implementation(PACKED_ATTENTION)


def forward_kwargs(batch: Batch) -> dict[str, Any]:
    """The model inputs of a batch already on its device."""
    if not batch.packed:
        # Right padding needs no mask: later pads never reach earlier tokens of a causal model.
        return {"input_ids": batch.input_ids, "use_cache": False}
    return {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "attention_mask": {"full_attention": None, "linear_attention": batch.token_mask},
        "cu_seq_lens_q": batch.cu_seqlens,
        "segments": batch.segments,
        "use_cache": False,
    }

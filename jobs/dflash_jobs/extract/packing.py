"""Running packed rows through a Transformers hybrid model (see batching.py for the layout).

Packing needs two things from the model: the Gated DeltaNet layers must keep samples apart, which
FLA's varlen kernel does from `cu_seq_lens_q` (given the same boundaries on the host as
`cu_seqlens_cpu`, so it never reads them back from the GPU), and every full-attention layer must
attend within a sample only, which `packed_attention` does with one variable-length FlashAttention
call per layer on a GPU (torch's varlen_attn), and with causal SDPA per sample elsewhere. The
masked gap tokens make the causal conv exact without causal-conv1d's `seq_idx`. The mask mapping
is handed to the model as a dict, which Transformers' Qwen3.5/3.6 text model takes as precomputed
masks.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_jobs.extract.batching import Batch

log = logging.getLogger("dflash.extract")

# No "flash" in the name: Transformers treats any such name as a FlashAttention kernel.
PACKED_ATTENTION = "packed_causal"


def per_sample_sdpa(query, key, value, segments, *, module, scaling, dropout) -> torch.Tensor:
    """Causal SDPA within each [start, end) segment, one call per sample: [1, T, heads, head_dim]."""
    return torch.cat([
        sdpa_attention_forward(
            module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
            dropout=dropout, scaling=scaling, is_causal=True,
        )[0]
        for start, end in segments
    ], dim=1)


def _varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's variable-length FlashAttention, called the way this torch spells causality and GQA
    (the public signature changed between releases); None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in params

    def attend(query, key, value, bounds, longest, scale):  # [T, heads, head_dim] each
        if key.shape[1] != query.shape[1]:
            if native_gqa:
                return varlen_attn(query, key, value, bounds, bounds, longest, longest, scale=scale, enable_gqa=True, **causal)
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return varlen_attn(query, key, value, bounds, bounds, longest, longest, scale=scale, **causal)

    return attend


VARLEN = _varlen_kernel()
"""Set to None after a failed call: that build of torch cannot run it (the per-sample path stays exact)."""


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    segments: tuple[tuple[int, int], ...],
    segment_bounds: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each [start, end) segment of a packed row: no attention across samples."""
    global VARLEN
    if VARLEN is not None and query.is_cuda and segment_bounds is not None and query.dtype in (torch.bfloat16, torch.float16):
        longest = max(end - start for start, end in segments)
        try:
            out = VARLEN(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), segment_bounds, longest, scaling)
            return out[None], None  # [1, T, heads, head_dim], as every attention function returns
        except (RuntimeError, ValueError, TypeError) as exc:
            log.warning("variable-length FlashAttention unavailable (%s); attention runs per sample", str(exc).splitlines()[0])
            VARLEN = None
    return per_sample_sdpa(query, key, value, segments, module=module, scaling=scaling, dropout=dropout), None


def attention_path(device: torch.device) -> str:
    """What a packed row's full-attention layers run on `device`, for the logs and benchmarks."""
    return "varlen FlashAttention, one call per layer" if VARLEN is not None and device.type == "cuda" else "SDPA per sample"


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


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
        # The same boundaries on the host: FLA would otherwise read them back, a GPU sync per forward.
        "cu_seqlens_cpu": torch.tensor([start for start, _ in batch.segments] + [batch.segments[-1][1]]),
        "segment_bounds": batch.cu_seqlens.to(torch.int32),
        "segments": batch.segments,
        "use_cache": False,
    }

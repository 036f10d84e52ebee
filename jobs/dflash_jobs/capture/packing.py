"""Running packed rows through a Transformers model (see batching.py for the layout).

Packing needs every attention layer to attend within a sample only, which `packed_attention` does
with one variable-length FlashAttention call per layer on a GPU (torch's varlen_attn), and with
causal SDPA per sample elsewhere; the positions restart at every sample. What else a packed row
needs is its architecture's (architectures/: `packing_gap`, `packed_inputs`): a dense model nothing;
Qwen3.5/3.6's Gated DeltaNet layers must keep samples apart too, which FLA's varlen kernel does
from `cu_seq_lens_q` (given the same boundaries on the host as `cu_seqlens_cpu`, so it never reads
them back from the GPU), and masked gap tokens make the causal conv exact without causal-conv1d's
`seq_idx`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_jobs.architectures import TargetArchitecture
from dflash_jobs.capture.batching import Batch

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


def can_pack(architecture: TargetArchitecture, device: torch.device, *, fla: bool) -> bool:
    """Packed rows on a GPU, where padding costs (a CPU runs padded rows, as exact); Gated DeltaNet layers
    only with flash-linear-attention (`fla`), whose varlen kernel keeps the samples apart."""
    return device.type == "cuda" and (fla or not architecture.gated_deltanet)


def layout(architecture: TargetArchitecture, device: torch.device, *, packed: bool, pad_multiple: int) -> str:
    """How the batches are laid out, for the logs and benchmarks."""
    if not packed:
        return f"right-padded to multiples of {pad_multiple}"
    recurrent = "FLA varlen + masked conv gaps; " if architecture.gated_deltanet else ""
    return f"packed ({recurrent}attention: {attention_path(device)})"


def use_packed_attention(model: torch.nn.Module) -> None:
    model.set_attn_implementation(PACKED_ATTENTION)


def forward_kwargs(batch: Batch, architecture: TargetArchitecture) -> dict[str, Any]:
    """The model inputs of a batch already on its device."""
    if not batch.packed:
        # Right padding needs no mask: later pads never reach earlier tokens of a causal model.
        return {"input_ids": batch.input_ids, "use_cache": False}
    return {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "segment_bounds": batch.cu_seqlens.to(torch.int32),
        "segments": batch.segments,
        "use_cache": False,
        **architecture.packed_inputs(batch.token_mask, batch.cu_seqlens, batch.segments),
    }

"""A dense Llama-family model (`llama`: Llama 2/3, SmolLM2, ...): every layer plain attention, x * w
norms, the text model at `model.*`, the embeddings possibly tied (then no `lm_head.weight`).

Nothing but attention mixes tokens, so a packed extraction row needs no gap between samples (the
packed attention keeps them apart from the segments alone), and a draft tree needs only the
ancestor mask: each node attends to the cache, its ancestors and itself.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_jobs.architectures import TargetArchitecture
from dflash_jobs.architectures.tree import TreeStep, attend_tree


def tree_attention(layer: nn.Module, x: torch.Tensor, cached, step: TreeStep):
    """Llama's attention over the cache and the tree (x [1, n, d])."""
    attention = layer.self_attn
    shape = (*x.shape[:-1], -1, attention.head_dim)
    query, key, value = (projection(x).view(shape).transpose(1, 2) for projection in (attention.q_proj, attention.k_proj, attention.v_proj))
    out, rows = attend_tree(attention, query, key, value, cached, step)  # [1, n, H * hd]
    return attention.o_proj(out), rows


ARCHITECTURE = TargetArchitecture(
    name="llama",
    weight_prefixes=("model.",),
    zero_centred_norms=False,
    gated_deltanet=False,
    packing_gap=lambda config: 0,
    packed_inputs=lambda token_mask, cu_seqlens, segments: {},
    tree_mixers={"full_attention": tree_attention},
    fused_submodules=("input_layernorm", "post_attention_layernorm", "mlp"),
)

"""Qwen3.5/3.6 (`qwen3_5`, `qwen3_5_moe`; shared/reference/qwen_gdn.md): three Gated DeltaNet layers
to one of gated attention, zero-centred norms, the text model nested in a multimodal checkpoint.

Its tree verification: the gated attention (q_proj emits each head's query and its gate, the
query and key normed per head) through `attend_tree`; the Gated DeltaNet tree-aware, since it
carries a short convolution window and a recurrent state instead of K/V and takes no mask: the
projections, the gated norm and the output over all nodes at once; each node's convolution over
its own ancestors' inputs (those above the root from the cached window); the recurrence one depth
at a time, the nodes of a depth as one batch, each starting from its parent's state (the root from
the cached one), through the recurrent kernel transformers binds (flash-linear-attention's
fused_recurrent where installed). Its commit sets the conv window and the recurrent state to those
after the last accepted node, recomputed along the path from the per-node inputs the forward kept
(keeping every node's recurrent state instead costs nodes x 3 MB per GDN layer at the 27B shape).

Packed extraction rows: each sample is followed by conv kernel - 1 masked tokens, and the GDN
layers get the boundaries as `cu_seq_lens_q` (extract/batching.py, extract/packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache

from dflash_jobs.architectures import TargetArchitecture
from dflash_jobs.drafter.tree_verify import TreeStep, attend_tree, kernels
from dflash_jobs.extract.batching import Batch


def packing_gap(config) -> int:
    """The causal conv's kernel - 1: a masked token fewer and the next sample's conv would read this one's last input."""
    return int(config.linear_conv_kernel_dim) - 1


def packed_inputs(batch: Batch) -> dict:
    """The GDN layers' mask (zero on the gap tokens, before their bias-free projections) and boundaries;
    the text model takes the mask mapping as precomputed masks."""
    return {
        "attention_mask": {"full_attention": None, "linear_attention": batch.token_mask},
        "cu_seq_lens_q": batch.cu_seqlens,
        # The same boundaries on the host: FLA would otherwise read them back, a GPU sync per forward.
        "cu_seqlens_cpu": torch.tensor([start for start, _ in batch.segments] + [batch.segments[-1][1]]),
    }


def tree_gated_attention(layer: nn.Module, x: torch.Tensor, cached, step: TreeStep):
    """Qwen3.5's gated attention over the cache and the tree (x [1, n, d])."""
    attention = layer.self_attn
    shape = (*x.shape[:-1], -1, attention.head_dim)
    query, gate = torch.chunk(attention.q_proj(x).view(*x.shape[:-1], -1, attention.head_dim * 2), 2, dim=-1)
    query = attention.q_norm(query.reshape(shape)).transpose(1, 2)  # [1, H, n, hd]
    key = attention.k_norm(attention.k_proj(x).view(shape)).transpose(1, 2)
    value = attention.v_proj(x).view(shape).transpose(1, 2)
    out, rows = attend_tree(attention, query, key, value, cached, step)
    return attention.o_proj(out * torch.sigmoid(gate.reshape(*x.shape[:-1], -1))), rows


def recurrence(module: nn.Module, query, key, value, g, beta, state):
    """The gated delta rule token by token from `state` (q, k, v positional: fla names them q, k, v, the fallback query, key, value)."""
    recurrent = kernels(module).torch_recurrent_gated_delta_rule
    return recurrent(query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


@dataclass
class RecurrentRows:
    """A GDN layer's per-row inputs: its convolution input [n, C], and the recurrence's inputs (q, k [n, Hk, dk], v [n, Hv, dv], g, beta [n, Hv])."""

    module: nn.Module
    mixed: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def commit(self, cache: Cache, layer_index: int, rows: torch.Tensor) -> None:
        """The conv window and the recurrent state after the last of `rows`."""
        layer = cache.layers[layer_index]
        window = layer.conv_states[0]  # [1, C, width]
        window.copy_(torch.cat([window[0].T, self.mixed[rows]])[-window.shape[-1]:].T[None])
        _, state = recurrence(self.module, self.query[rows][None], self.key[rows][None], self.value[rows][None],
                              self.g[rows][None], self.beta[rows][None], layer.recurrent_states[0])
        layer.recurrent_states[0].copy_(state)
        if getattr(layer, "cumulative_length_linear", None) is not None:
            layer.cumulative_length_linear.add_(len(rows))


def tree_gated_delta(layer: nn.Module, x: torch.Tensor, cached, step: TreeStep):
    """Qwen3.5's Gated DeltaNet over the tree (x [1, n, d]), each row from its parent's states."""
    gdn, x, layout = layer.linear_attn, x[0], step.layout
    n = len(x)
    mixed = gdn.in_proj_qkv(x)  # [n, C]
    z = gdn.in_proj_z(x).reshape(n, -1, gdn.head_v_dim)
    beta = gdn.in_proj_b(x).sigmoid()
    g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
    window = cached.conv_states[0][0].T  # [width, C]: the cached inputs, newest last
    inputs = torch.cat([window, mixed])[layout.windows(len(window))]  # [n, width, C]
    weight = gdn.conv1d.weight[:, 0, -len(window):]  # [C, width]
    convolved = (inputs.float() * weight.T.float()).sum(1)  # in fp32, as the conv kernels accumulate
    if gdn.conv1d.bias is not None:
        convolved = convolved + gdn.conv1d.bias.float()
    convolved = ACT2FN[gdn.activation](convolved).to(x.dtype)
    query, key, value = torch.split(convolved, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    rows = RecurrentRows(gdn, mixed, query.reshape(n, -1, gdn.head_k_dim), key.reshape(n, -1, gdn.head_k_dim),
                         value.reshape(n, -1, gdn.head_v_dim), g, beta)
    core = torch.empty_like(rows.value)
    states = cached.recurrent_states[0]  # [1, Hv, dk, dv]
    for level, up in layout.levels:
        start = states if up is None else states[up]
        out, states = recurrence(gdn, rows.query[level, None], rows.key[level, None], rows.value[level, None], g[level, None], beta[level, None], start)
        core[level] = out[:, 0]
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim)).reshape(n, -1)
    return gdn.out_proj(core)[None], rows


ARCHITECTURE = TargetArchitecture(
    name="qwen3_5",
    weight_prefixes=("model.language_model.", "model."),  # the multimodal checkpoint's, then a text-only one's
    zero_centred_norms=True,
    gated_deltanet=True,
    packing_gap=packing_gap,
    packed_inputs=packed_inputs,
    tree_mixers={"full_attention": tree_gated_attention, "linear_attention": tree_gated_delta},
)

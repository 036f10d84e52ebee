"""Qwen3.5/3.6 (`qwen3_5`, `qwen3_5_moe`; shared/reference/qwen_gdn.md): three Gated DeltaNet layers
to one of gated attention, zero-centred norms, the text model nested in a multimodal checkpoint.

Its tree verification: the gated attention (q_proj emits each head's query and its gate, the
query and key normed per head) through `attend_tree`; the Gated DeltaNet tree-aware, since it
carries a short convolution window and a recurrent state instead of K/V and takes no mask: the
projections, the gated norm and the output over all nodes at once; each node's convolution over
its own ancestors' inputs (those above the root from the cached window); the recurrence in one call
of the recurrent kernel transformers binds (flash-linear-attention's fused_recurrent where
installed): a batch of the tree's root paths (`TreeLayout.paths`), each from the cached state, each
node's output read at its depth in its own path. A shared prefix is run once per path through it:
the kernel runs n x D positions for n rows (every row's path, since which rows are leaves is not
read before the forward: the tree is grown on the device; D the deepest path the tree can hold),
where a depth at a time would run n in D calls; on a GPU a path is more programs of the kernel's
grid, a depth one more step of each. No node's recurrent state is materialised (at the 27B shape
3 MiB per node per GDN layer in fp32): only n copies of the cached state, the kernel's inputs.

Its commit sets every GDN layer's conv window and recurrent state to those after the last accepted
node, in one recurrent call for all the layers at once: the accepted rows' inputs, which the verify
forward kept, as a batch of one sequence per layer, each from its layer's cached state (the layers
depended on each other in the forward, not here: each one's inputs are known). The verify forward
cannot hand over the states themselves: the kernel gives a sequence's state at its end only, and the
accepted path ends mid-path in general; keeping every node's instead is the memory above.

Packed extraction rows: each sample is followed by conv kernel - 1 masked tokens, and the GDN
layers get the boundaries as `cu_seq_lens_q` (capture/batching.py, capture/packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache

from dflash_jobs.architectures import TargetArchitecture
from dflash_jobs.architectures.tree import TreeStep, attend_tree, kernels


def packing_gap(config) -> int:
    """The causal conv's kernel - 1: a masked token fewer and the next sample's conv would read this one's last input."""
    return int(config.linear_conv_kernel_dim) - 1


def packed_inputs(token_mask: torch.Tensor, cu_seqlens: torch.Tensor, segments: tuple[tuple[int, int], ...]) -> dict:
    """The GDN layers' mask (zero on the gap tokens, before their bias-free projections) and boundaries;
    the text model takes the mask mapping as precomputed masks."""
    return {
        "attention_mask": {"full_attention": None, "linear_attention": token_mask},
        "cu_seq_lens_q": cu_seqlens,
        # The same boundaries on the host: FLA would otherwise read them back, a GPU sync per forward.
        "cu_seqlens_cpu": torch.tensor([start for start, _ in segments] + [segments[-1][1]]),
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


def recurrence(module: nn.Module, query, key, value, g, beta, state, *, final_state: bool):
    """The gated delta rule token by token over a batch of sequences [B, T, ...], each from its own
    state [B, Hv, dk, dv] (q, k, v positional: fla names them q, k, v, the fallback query, key, value)."""
    recurrent = kernels(module).torch_recurrent_gated_delta_rule
    return recurrent(query, key, value, g=g, beta=beta, initial_state=state, output_final_state=final_state, use_qk_l2norm_in_kernel=True)


def heads(gdn: nn.Module, convolved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's output [..., C] as the recurrence's q, k [..., Hk, dk] and v [..., Hv, dv] (views)."""
    query, key, value = torch.split(convolved, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    return query.unflatten(-1, (-1, gdn.head_k_dim)), key.unflatten(-1, (-1, gdn.head_k_dim)), value.unflatten(-1, (-1, gdn.head_v_dim))


@dataclass
class RecurrentRows:
    """A GDN layer's per-row inputs: its convolution's input and output [n, C] (the output q, k and v
    side by side), and the recurrence's gates g, beta [n, Hv]."""

    module: nn.Module
    mixed: torch.Tensor
    convolved: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def commit(cls, cache: Cache, kept: Mapping[int, RecurrentRows], rows: torch.Tensor) -> None:
        """Every GDN layer's conv window and recurrent state after the last of `rows`, all layers at once."""
        layers = [cache.layers[index] for index in kept]
        gdn = next(iter(kept.values())).module  # every GDN layer of a model has the same shape
        windows = [layer.conv_states[0] for layer in layers]  # [1, C, width] each
        states = [layer.recurrent_states[0] for layer in layers]  # [1, Hv, dk, dv] each

        def accepted(name: str) -> torch.Tensor:  # [L, r, ...]: the rows of every layer
            return torch.stack([getattr(layer_rows, name) for layer_rows in kept.values()])[:, rows]

        appended = torch.cat([torch.cat(windows), accepted("mixed").transpose(1, 2)], dim=-1)  # [L, C, width + r], newest last
        _, after = recurrence(gdn, *heads(gdn, accepted("convolved")), accepted("g"), accepted("beta"), torch.cat(states), final_state=True)
        torch._foreach_copy_(windows, list(appended[..., -windows[0].shape[-1]:].unsqueeze(1).unbind()))
        torch._foreach_copy_(states, list(after.unsqueeze(1).unbind()))
        lengths = [layer.cumulative_length_linear for layer in layers if getattr(layer, "cumulative_length_linear", None) is not None]
        if lengths:
            torch._foreach_add_(lengths, len(rows))


def tree_gated_delta(layer: nn.Module, x: torch.Tensor, cached, step: TreeStep):
    """Qwen3.5's Gated DeltaNet over the tree (x [1, n, d]): each row's convolution over its ancestors,
    the recurrence over the tree's root paths from the cached state."""
    gdn, x, layout = layer.linear_attn, x[0], step.layout
    n = len(x)
    mixed = gdn.in_proj_qkv(x)  # [n, C]
    z = gdn.in_proj_z(x).reshape(n, -1, gdn.head_v_dim)
    beta = gdn.in_proj_b(x).sigmoid()
    g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
    window = cached.conv_states[0][0].T  # [width, C]: the cached inputs, newest last
    inputs = torch.cat([window, mixed])[layout.windows(len(window))]  # [n, width, C]
    weight = gdn.conv1d.weight[:, 0, -len(window):]  # [C, width]
    convolved = (inputs * weight.T.float()).sum(1)  # in fp32, as the conv kernels accumulate (the product promotes the inputs)
    if gdn.conv1d.bias is not None:
        convolved = convolved + gdn.conv1d.bias.float()
    convolved = ACT2FN[gdn.activation](convolved).to(x.dtype)
    paths = layout.paths  # [P, D]
    # Each part indexed on its own: contiguous, as the kernel reads them (a view of the whole would be copied thrice).
    query, key, value = (part[paths] for part in heads(gdn, convolved))  # [P, D, heads, dim]
    # The cached state once per path, materialised here: fla's kernel reads a state by offset (input_guard copies a broadcast
    # view in 0.6.0, but a view read as P states would be silently wrong wherever it does not).
    start = cached.recurrent_states[0].expand(len(paths), -1, -1, -1).contiguous()  # [P, Hv, dk, dv]
    out, _ = recurrence(gdn, query, key, value, g[paths], beta[paths], start, final_state=False)  # [P, D, Hv, dv]
    core = out.flatten(0, 1)[layout.path_slots]  # [n, Hv, dv]
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim)).reshape(n, -1)
    return gdn.out_proj(core)[None], RecurrentRows(gdn, mixed, convolved, g, beta)


ARCHITECTURE = TargetArchitecture(
    name="qwen3_5",
    weight_prefixes=("model.language_model.", "model."),  # the multimodal checkpoint's, then a text-only one's
    zero_centred_norms=True,
    gated_deltanet=True,
    packing_gap=packing_gap,
    packed_inputs=packed_inputs,
    tree_mixers={"full_attention": tree_gated_attention, "linear_attention": tree_gated_delta},
    fused_submodules=("input_layernorm", "post_attention_layernorm", "mlp", "self_attn.q_norm", "self_attn.k_norm", "linear_attn.norm"),
)

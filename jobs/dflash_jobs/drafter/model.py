"""The DFlash drafter (reference/dflash.md section 2): a small Qwen3-style decoder that drafts a
block of B tokens in one pass, conditioned on hidden states captured from the target.

Context: c = hidden_norm(fc(concat of the L captured target layers)), shared by every layer and
injected as extra keys/values through each layer's own k/v projections (k_norm and RoPE at the
context's absolute positions). Queries come from the block only: the anchor token, then B-1 mask
tokens, predicted in place (slot j predicts the token at anchor + j).
The embedding, the final norm and the LM head are the target's, frozen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dflash_jobs.train.loss import DraftLoss, draft_loss
from dflash_jobs.train.masks import AttentionFn, BlockLayout, build_attention

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    hidden_size: int  # the target's hidden size: embedding and LM head are shared with it
    num_layers: int = 5  # draft decoder layers
    num_attention_heads: int  # query heads (z-lab copies the target's attention shape)
    num_key_value_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # per-head width of q, k and v
    intermediate_size: int  # SwiGLU width (the target's dense FFN width)
    vocab_size: int  # rows of the target's embedding and LM head
    target_layer_ids: list[int]  # captured target layers, z-lab convention: output of decoder layer i
    num_target_layers: int  # depth of the target (exported as num_target_layers)
    block_size: int = 16  # tokens per drafted block: the anchor plus block_size - 1 predictions
    mask_token_id: int  # embedding row filling the slots to predict (an unused target row)
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention (bidirectional in the block) or sliding_attention (causal in the block)
    sliding_window: int = 2048  # keys per query on sliding_attention layers, the query included
    rope_theta: float = 1e7  # RoPE base, the target's (the drafter uses full-head 1-D RoPE)
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    max_position_embeddings: int = 262144  # longest position served (exported for vLLM)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types {self.layer_types}: expected {self.num_layers} entries out of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window {self.sliding_window} < block_size {self.block_size}: a block must fit its window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} query heads do not group over {self.num_key_value_heads} key/value heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    @property
    def context_features(self) -> int:
        """Width of the concatenated captured layers, the input of fc."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm, x * w (the target's zero-centred norms are converted when loaded)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for absolute positions [T] (fp32)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the tables of its T positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    """Block queries over [context ; block] keys, both through this layer's k/v projections."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn
    ) -> torch.Tensor:
        Q, _ = x.shape
        C, _ = context.shape
        q = self.q_norm(self.q_proj(x).view(Q, self.num_heads, self.head_dim))
        keys_in = torch.cat([context, x])  # [C + Q, d]: the context enters as keys/values only
        k = self.k_norm(self.k_proj(keys_in).view(C + Q, self.num_kv_heads, self.head_dim))
        v = self.v_proj(keys_in).view(C + Q, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos[C:], sin[C:])
        k = apply_rope(k, cos, sin)
        # [T, heads, hd] -> [1, heads, T, hd], the kernels' layout
        out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return self.o_proj(out[0].transpose(0, 1).reshape(Q, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[index]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, context, cos, sin, attend: AttentionFn) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), context, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    """Trainable: fc, hidden_norm, the layers. Frozen, from the target: `norm` (a parameter, exported
    like z-lab's), `embed_tokens` and `lm_head` (non-persistent buffers: never checkpointed nor exported)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(config.context_features, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.norm.weight.requires_grad_(False)
        # Empty until load_target_tensors: at vocab 248K a placeholder table would cost 5 GB.
        self.register_buffer("embed_tokens", torch.empty(0, d), persistent=False)
        self.register_buffer("lm_head", torch.empty(0, d), persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def load_target_tensors(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """The target's frozen tensors; `final_norm` already in x * w form (see checkpoint.py)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        for name, tensor in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"target {name} is {tuple(tensor.shape)}, the drafter expects {expected}")
        device = self.fc.weight.device
        self.embed_tokens = embed_tokens.to(device)
        self.lm_head = lm_head.to(device)
        with torch.no_grad():
            self.norm.weight.copy_(final_norm)

    def hidden_states(
        self,
        context_hidden: torch.Tensor,
        context_positions: torch.Tensor,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        attention: Mapping[str, AttentionFn],
    ) -> torch.Tensor:
        """Final-normed hidden states [N, B, d] of every block slot."""
        N, B = block_ids.shape
        if not torch.is_autocast_enabled(context_hidden.device.type):
            # Under autocast the bf16 states go in as they are: an fp32 copy of [C, L*d] costs GBs.
            context_hidden = context_hidden.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(context_hidden))  # [C, L*d] -> [C, d]
        h = F.embedding(block_ids.reshape(N * B), self.embed_tokens)  # [N*B, d]
        positions = torch.cat([context_positions, block_positions.reshape(N * B)])  # [C + N*B]
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            h = layer(h, context, cos, sin, attention[layer.layer_type])
        return self.norm(h).view(N, B, -1)

    def forward(
        self,
        context_hidden: torch.Tensor,
        context_positions: torch.Tensor,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        attention: Mapping[str, AttentionFn],
        labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        loss_normalizer: torch.Tensor | None = None,
    ) -> torch.Tensor | DraftLoss:
        """context_hidden [C, L*d] (raw captured layers), context_positions [C], block_ids and
        block_positions [N, B]; `attention` maps each layer type to its masked kernel (train/masks.py).

        With labels and loss_weights [N, B]: the weighted loss (train/loss.py), divided by
        loss_normalizer when given. Without: logits [N, B, V] (for small inputs only: at vocab 248K
        they are large)."""
        hidden = self.hidden_states(context_hidden, context_positions, block_ids, block_positions, attention)
        if labels is None:
            return hidden @ self.lm_head.T.to(hidden.dtype)
        return draft_loss(hidden, self.lm_head, labels, loss_weights, normalizer=loss_normalizer)

    @torch.no_grad()
    def draft_block(
        self, context_hidden: torch.Tensor, context_positions: torch.Tensor, anchor_token: int, anchor_position: int
    ) -> torch.Tensor:
        """Greedy draft of one block: the B-1 tokens after `anchor_token`, as int64 [B-1].

        context_hidden [1, C, L*d]: the target's captured layers (config.target_layer_ids, in that
        order, concatenated on the feature axis, raw: before any norm) at the committed positions
        before the anchor; context_positions [C] their absolute positions. anchor_token: the last
        committed token (the target's bonus token), which has no hidden state yet, at
        anchor_position (> every context position). Token k of the result is the guess for position
        anchor_position + 1 + k. The context K/V are recomputed on every call (no drafter cache).
        """
        device = self.fc.weight.device
        B, C = self.config.block_size, context_hidden.shape[1]
        block_ids = torch.full((1, B), self.config.mask_token_id, dtype=torch.long, device=device)
        block_ids[0, 0] = anchor_token
        block_positions = anchor_position + torch.arange(B, device=device)[None]  # [1, B]
        context_positions = context_positions.to(device)
        layout = BlockLayout(
            num_context=C, block_size=B,
            context_start=torch.zeros(1, dtype=torch.long, device=device),
            anchor=torch.full((1,), C, dtype=torch.long, device=device),
            key_positions=torch.cat([context_positions, block_positions[0]]),
        )
        attention = build_attention(layout, self.config.layer_types, self.config.sliding_window, backend="dense")
        hidden = self.hidden_states(context_hidden[0].to(device), context_positions, block_ids, block_positions, attention)
        logits = hidden[0, 1:] @ self.lm_head.T.to(hidden.dtype)  # [B-1, V]
        return logits.argmax(-1)

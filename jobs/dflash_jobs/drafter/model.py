"""The DFlash drafter (reference/dflash.md section 2): a small Qwen3-style decoder that drafts a
block of B tokens in one pass, conditioned on hidden states captured from the target.

Context: c = hidden_norm(fc(concat of the L captured target layers)), shared by every layer and
injected as extra keys/values through each layer's own k/v projections (k_norm and RoPE at the
context's absolute positions). Queries come from the block only: the anchor token, then B-1 mask
tokens, predicted in place (slot j predicts the token at anchor + j).
The embedding and the LM head are the target's, frozen. The final norm is the drafter's own,
initialised to 1 and trained, as SpecForge's DFlashDraftModel trains it (reference/dflash.md 2.2),
not the target's copied and frozen, which measured no better on the same states and seeds (own
against the target's): the demo, seeds 42 and 7, acceptance 4.55 and 4.46 against 4.46 and 4.76,
final loss 0.33 and 0.24 against 0.31 and 0.23 (gaps no wider than between the seeds); the demo's
pipeline on 240 chats, 1.94 and 3.54 against 1.94 and 3.44; the consistency tests' taught tiny
drafters, DFlash 5.77 both ways, DFlash2 7.29 against 6.36, DSpark 5.17 against 4.86. Every other
part matches SpecForge's drafter: fc without bias, hidden_norm, the context through each layer's own
k/v projections, k_norm and RoPE, q_norm, pre-norm layers, weights N(0, 0.02) and norms at 1.

This module imports torch and, relatively, masks.py, nothing else: the export copies both beside
dflash.py (the Hugging Face entry point, `DFlashDraftModel`), so the served drafter runs this very
code. `DraftTrunk` holds what the two share: the modules under z-lab's weight names and the pass
through them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .masks import AttentionFn, one_block_attention

LAYER_TYPES = ("full_attention", "sliding_attention")
GREEDY_LOGITS = 2**26
"""Logits materialised at once by greedy_tokens (rows x vocabulary)."""


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    hidden_size: int  # the target's hidden size: embedding and LM head are shared with it
    num_layers: int = 5  # draft decoder layers
    num_attention_heads: int  # query heads (z-lab copies the target's attention shape)
    num_key_value_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # per-head width of q, k and v
    intermediate_size: int  # SwiGLU width (the target's dense FFN width)
    vocab_size: int  # rows of the target's embedding and LM head
    target_layer_ids: list[int]  # captured target layers, ascending, z-lab convention: output of decoder layer i
    num_target_layers: int  # depth of the target (exported as num_target_layers)
    block_size: int = 16  # tokens per drafted block: the anchor plus block_size - 1 predictions
    mask_token_id: int  # embedding row filling the slots to predict (an unused target row)
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention (bidirectional in the block) or sliding_attention (causal in the block)
    sliding_window: int = 2048  # keys per query on sliding_attention layers, the query included
    is_causal: bool | None = None  # every layer causal inside the block (True) or bidirectional (False); None: as layer_types says (DFlash: no key exported)
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
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            # vLLM concatenates the captured layers in ascending order: fc would read them shuffled.
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must be distinct and ascending, as vLLM concatenates them")

    @property
    def context_features(self) -> int:
        """Width of the concatenated captured layers, the input of fc."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def sliding_layers(self) -> bool:
        return "sliding_attention" in self.layer_types

    def window(self, layer_type: str) -> int | None:
        """The attention window of a layer type: None for full attention."""
        return self.sliding_window if layer_type == "sliding_attention" else None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_zlab(self) -> dict[str, Any]:
        """The config.json of the z-lab layout (reference/dflash.md section 5.1): a Qwen3 config plus
        architectures, auto_map, block_size, dflash_config and num_target_layers."""
        return {
            "architectures": ["DFlashDraftModel"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "dtype": "bfloat16",
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            # The RoPE base in both forms: rope_theta/rope_scaling (vLLM, Transformers 4) and
            # rope_parameters (Transformers 5): a reader that finds only the other falls back to its default base.
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window if self.sliding_layers else None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": self.sliding_layers,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_zlab(cls, raw: Mapping[str, Any]) -> DrafterConfig:
        """From a z-lab config.json, or the to_dict() of the Qwen3Config transformers made of it
        (which moves rope_theta into rope_parameters and may keep block_size in dflash_config)."""
        dflash = raw["dflash_config"]
        rope_theta = raw.get("rope_theta") or (raw.get("rope_parameters") or {})["rope_theta"]
        return cls(
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"],
            head_dim=raw["head_dim"],
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            num_target_layers=raw["num_target_layers"],
            block_size=raw.get("block_size") or dflash["block_size"],
            mask_token_id=dflash["mask_token_id"],
            layer_types=list(raw["layer_types"]),
            sliding_window=raw["sliding_window"] or cls.__dataclass_fields__["sliding_window"].default,
            rope_theta=float(rope_theta),
            rms_norm_eps=raw["rms_norm_eps"],
            max_position_embeddings=raw["max_position_embeddings"],
            is_causal=raw.get("is_causal"),
        )


def rank_top_k(scores: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The positions [..., k] of the k best of scores [..., n], best first, equal scores by the lower
    token id (ids [..., n], below 2^32; None: a position is its token id).

    argmax's own rule (the first maximal index: the lowest token id) extended to a ranking, so a
    ranking's first is the greedy choice and a ranking of k the first k of a ranking of more. topk
    promises no order among equal values, and bf16 logits are often equal: each score and its id
    become one int64 key, the score's float32 bits made order-preserving in the high half and the
    id reversed in the low half, whose topk has no ties."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0, an equal score
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # negative floats' bits count down: flip them
    if ids is None:
        ids = torch.arange(scores.shape[-1], device=scores.device)
    key = ordered * 2**32 + (2**32 - 1 - ids.long())  # [..., n]: by score, then by the lower id
    return key.topk(min(k, scores.shape[-1]), dim=-1).indices


def anchor_ids(anchor: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The anchor token as int64 [1] on `device`: a host int filled in there, a device tensor kept
    there (reading it back, or copying an int from pageable memory, waits for the device)."""
    if isinstance(anchor, torch.Tensor):
        return anchor.reshape(1).to(device, torch.long)
    return torch.full((1,), anchor, dtype=torch.long, device=device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm, x / rms(x) * w, in fp32, back in x's dtype."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm, x * w with w from 1 (the target's zero-centred norms are converted when loaded)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """cos, sin [T, head_dim] (fp32) of absolute positions [T]; no state (nothing exported)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.head_dim
        inv_freq = 1.0 / self.theta ** (torch.arange(0, hd, 2, device=positions.device, dtype=torch.float32) / hd)
        angles = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, T, heads, head_dim] rotated by the tables of its T positions."""
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
        b, Q, _ = x.shape
        C = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, Q, self.num_heads, self.head_dim))
        keys_in = torch.cat([context, x], dim=1)  # [b, C + Q, d]: the context enters as keys/values only
        k = self.k_norm(self.k_proj(keys_in).view(b, C + Q, self.num_kv_heads, self.head_dim))
        v = self.v_proj(keys_in).view(b, C + Q, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos[C:], sin[C:])
        k = apply_rope(k, cos, sin)
        # [b, T, heads, hd] -> [b, heads, T, hd], the kernels' layout
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(b, Q, self.num_heads * self.head_dim))


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


LayerAttention = Callable[[int, str], AttentionFn]
"""(layer index, layer type) -> that layer's masked attention kernel."""


class DraftTrunk:
    """fc, hidden_norm, the decoder layers and the final norm, under z-lab's names (the exported
    weight keys), and the pass through them. A mixin of nn.Module subclasses: the training `Drafter`
    and the exported `DFlashDraftModel` (dflash.py) run this one pass; a variant whose layers wrap
    the sublayers (DFlash2) names its own `decoder_layer`."""

    decoder_layer: Callable[[DrafterConfig, int], nn.Module] = DecoderLayer

    def build_trunk(self, config: DrafterConfig) -> None:
        d = config.hidden_size
        self.fc = nn.Linear(config.context_features, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.rope = Rope(config.head_dim, config.rope_theta)

    def run_trunk(
        self, context_hidden: torch.Tensor, block_embeddings: torch.Tensor, positions: torch.Tensor, attention: LayerAttention
    ) -> torch.Tensor:
        """Final-normed hidden states [b, Q, d] of the block slots.

        context_hidden [b, C, L*d]: the captured target layers, raw (before any norm), concatenated in
        target_layer_ids order; block_embeddings [b, Q, d]; positions [C + Q]: RoPE positions of the
        context, then of the block."""
        if not torch.is_autocast_enabled(context_hidden.device.type):
            # Under autocast the bf16 states go in as they are: an fp32 copy of [C, L*d] costs GBs.
            context_hidden = context_hidden.to(self.fc.weight.dtype)
            block_embeddings = block_embeddings.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(context_hidden))  # [b, C, L*d] -> [b, C, d]
        cos, sin = self.rope(positions)
        h = block_embeddings
        for index, layer in enumerate(self.layers):
            h = layer(h, context, cos, sin, attention(index, layer.layer_type))
        return self.norm(h)


class Drafter(DraftTrunk, nn.Module):
    """Trainable: fc, hidden_norm, the layers and the final `norm` (from 1, exported like z-lab's, a
    Qwen3 x * w norm: what vLLM loads as `norm.weight`). Frozen, from the target: `embed_tokens`,
    `lm_head` and `target_norm`, the target's own final norm (non-persistent buffers: never
    checkpointed nor exported)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.build_trunk(config)
        # Empty until load_target_tensors: at vocab 248K a placeholder table would cost 5 GB.
        self.register_buffer("embed_tokens", torch.empty(0, config.hidden_size), persistent=False)
        self.register_buffer("lm_head", torch.empty(0, config.hidden_size), persistent=False)
        self.register_buffer("target_norm", torch.ones(config.hidden_size), persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def load_target_tensors(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor) -> None:
        """The target's frozen tensors; `final_norm` already in x * w form (see checkpoint.py), kept as
        `target_norm`: the drafter's own `norm` is not the target's."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        for name, tensor in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"target {name} is {tuple(tensor.shape)}, the drafter expects {expected}")
        device = self.fc.weight.device
        self.embed_tokens = embed_tokens.to(device)
        self.lm_head = lm_head.to(device)
        self.target_norm = final_norm.to(device=device, dtype=self.target_norm.dtype)

    def target_final_norm(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's last decoder layer output [..., d] (before its final norm, as stored) through
        the target's final norm: what the target's LM head reads for its next-token distribution."""
        return rms_norm(final_hidden, self.target_norm, self.config.rms_norm_eps)

    def forward(
        self,
        context_hidden: torch.Tensor,
        context_positions: torch.Tensor,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        attention: Mapping[str, AttentionFn],
    ) -> torch.Tensor:
        """Final-normed hidden states [N, B, d] of every block slot; the training loss (train/loss.py)
        and `logits` read them through the frozen LM head.

        context_hidden [C, L*d] (raw captured layers), context_positions [C], block_ids and
        block_positions [N, B]; `attention` maps each layer type to its masked kernel (masks.py)."""
        N, B = block_ids.shape
        h = F.embedding(block_ids.reshape(1, N * B), self.embed_tokens)  # [1, N*B, d]
        positions = torch.cat([context_positions, block_positions.reshape(N * B)])  # [C + N*B]
        hidden = self.run_trunk(context_hidden[None], h, positions, lambda index, kind: attention[kind])
        return hidden.view(N, B, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., V]: for small inputs only (at vocab 248K they are large)."""
        return hidden @ self.lm_head.T.to(hidden.dtype)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> the argmax token [...] through the frozen LM head, a bounded slice of
        logits at a time (at vocab 248K a few hundred rows of logits are a GB)."""
        rows = max(1, GREEDY_LOGITS // self.config.vocab_size)
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.cat([self.logits(part).argmax(-1) for part in flat.split(rows)]).view(hidden.shape[:-1])

    @torch.no_grad()
    def draft_block(
        self, context_hidden: torch.Tensor, context_positions: torch.Tensor, anchor_token: int | torch.Tensor,
        anchor_position: int | torch.Tensor, *, context_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy draft of one block: the B-1 tokens after `anchor_token`, as int64 [B-1].

        context_hidden [1, C, L*d]: the target's captured layers (config.target_layer_ids, in that
        order, concatenated on the feature axis, raw: before any norm) at the committed positions
        before the anchor; context_positions [C] their absolute positions. anchor_token: the last
        committed token (the target's bonus token), which has no hidden state yet, at
        anchor_position (> every context position). Token k of the result is the guess for position
        anchor_position + 1 + k. The context K/V are recomputed on every call (no drafter cache).
        context_length: a device scalar where the context is padded past its real rows (then
        anchor_position may be a device scalar too): the block sees the first context_length rows.
        """
        return self.block_drafts(self.block_hidden(context_hidden, context_positions, anchor_token, anchor_position,
                                                   context_length=context_length), anchor_token)

    @torch.no_grad()
    def block_hidden(
        self, context_hidden: torch.Tensor, context_positions: torch.Tensor, anchor_token: int | torch.Tensor,
        anchor_position: int | torch.Tensor, *, context_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states [B, d] of the block [anchor, mask x (B-1)] drafted after the
        context (draft_block's arguments), slot k at position anchor_position + k."""
        device = self.fc.weight.device
        B = self.config.block_size
        block_ids = torch.full((1, B), self.config.mask_token_id, dtype=torch.long, device=device)
        block_ids[0, 0] = anchor_token
        block_positions = anchor_position + torch.arange(B, device=device)  # [B]
        positions = torch.cat([context_positions.to(device), block_positions])
        h = F.embedding(block_ids, self.embed_tokens)  # [1, B, d]

        masks: dict[str, AttentionFn] = {}  # a mask per layer type, not per layer

        def attention(index: int, kind: str) -> AttentionFn:
            if kind not in masks:
                masks[kind] = one_block_attention(positions, B, self.config.window(kind), self.config.is_causal, context_length=context_length)
            return masks[kind]

        return self.run_trunk(context_hidden.to(device), h, positions, attention)[0]

    def block_drafts(self, hidden: torch.Tensor, anchor_token: int | torch.Tensor) -> torch.Tensor:
        """The drafts of one block from its final-normed hidden states [B, d]: DFlash's are the
        greedy tokens of slots 1..B-1 ([B-1, d] -> [B-1]); a variant with a head of its own reads them its way."""
        return self.greedy_tokens(hidden[1:])

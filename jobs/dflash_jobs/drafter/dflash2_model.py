"""The DFlash2 drafter (reference/dflash2-dspark.md section 3): the DFlash backbone (model.py) with

- a grouped dynamic causal convolution around every attention and MLP sublayer, inside the block:
  the sublayer reads its normed input mixed with the slots just before it, and its output is mixed
  the same way; the kernel is a learnt base plus an offset projected from the sublayer's input,
  one per group of channels. The context is not convolved;
- a candidate selector: each drafted slot's candidates are the strict top-K of the target LM
  head's logits (the unary scores U), re-ranked by a low-rank score of the edge from the token
  before: S(p -> c) = U[c] + <A[p] * P h, B[c]>, walked left to right from the anchor.

Both start as exact no-ops (identity kernel, zero offsets, zero successor codebook), so a DFlash2
holding a DFlash drafter's weights computes that drafter's hidden states and greedy drafts: a
trained DFlash at the same block size is a legal warm start.

Every layer is bidirectional inside the block, sliding or not (`is_causal: false`, as z-lab's
checkpoint states it): one causality for all layers is what the single exported key can say.

Like model.py, this module imports torch and, relatively, model.py and masks.py only: the export
copies it beside dflash2.py (the Hugging Face entry point, `DFlash2DraftModel`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .model import GREEDY_LOGITS, DecoderLayer, Drafter, DrafterConfig, DraftTrunk, anchor_ids, rank_top_k


UNSUPPORTED_SCALES = {"output_multiplier": 1.0, "final_logit_softcapping": 0.0, "input_embedding_scale": 1.0}
"""dflash_config keys of z-lab's DFlash2 that this drafter does not implement, with the value that means "none"."""


@dataclass(kw_only=True, slots=True)
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2  # taps of each in-block convolution: the slot itself and the kernel_size - 1 before it
    conv_group_size: int = 16  # channels sharing one input-dependent kernel offset (divides hidden_size)
    selector_rank: int = 256  # rank of the selector's predecessor and successor codebooks
    selector_top_k: int = 16  # candidates per drafted slot: the strict top-K of the unary logits
    is_causal: bool | None = False  # every layer bidirectional inside the block (z-lab's DFlash2)
    selector_alpha: float = 1.0  # training only (not exported): weight of the selector's cross-entropy
    selector_stop_gradient: bool = False  # training only: the selector's loss trains the selector alone, not the backbone

    def __post_init__(self) -> None:
        DrafterConfig.__post_init__(self)  # explicitly: zero-argument super() fails in a slots dataclass
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size}: expected 1..block_size ({self.block_size})")
        if not 1 <= self.selector_top_k <= self.vocab_size or self.selector_rank < 1:
            raise ValueError(f"selector_top_k {self.selector_top_k} / selector_rank {self.selector_rank}: expected 1..vocab_size and >= 1")

    def to_zlab(self) -> dict[str, Any]:
        """The config.json of z-lab's DFlash2 layout (reference/dflash2-dspark.md 3.7): DFlash's
        Qwen3 config, architectures [DFlash2DraftModel], an explicit is_causal, and every DFlash2
        setting in dflash_config (block_size included, where vLLM and z-lab read it)."""
        config = DrafterConfig.to_zlab(self)
        del config["block_size"]
        config.update(
            architectures=["DFlash2DraftModel"],
            auto_map={"AutoModel": "dflash2.DFlash2DraftModel"},
            is_causal=self.is_causal,
            dflash_config={
                "block_size": self.block_size, "mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                "conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k,
            },
        )
        return dict(sorted(config.items()))

    @classmethod
    def from_zlab(cls, raw: Mapping[str, Any]) -> DFlash2Config:
        """From a DFlash2 config.json (or the Qwen3Config transformers made of it). One that scales its
        logits or embeddings (z-lab's published checkpoints may: output_multiplier,
        final_logit_softcapping, input_embedding_scale) is refused: this drafter's logits are the
        target LM head's as they are, and would draft otherwise without a word."""
        dflash = raw["dflash_config"]
        scaled = {key: dflash[key] for key in sorted(UNSUPPORTED_SCALES) if dflash.get(key) not in (None, UNSUPPORTED_SCALES[key])}
        if scaled:
            raise ValueError(f"dflash_config sets {scaled}: this DFlash2 drafter scales neither its logits nor its embeddings")
        return cls(
            **dataclasses.asdict(DrafterConfig.from_zlab(raw)),
            conv_kernel_size=dflash["conv_kernel_size"], conv_group_size=dflash["conv_group_size"],
            selector_rank=dflash["selector_rank"], selector_top_k=dflash["selector_top_k"],
        )


class GroupedDynamicCausalConv(nn.Module):
    """conv(x, delta, base)[i, c] = sum over taps t of (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c],
    where x[i - t] is taken as zero when it lies before the start of i's block: the convolution
    resets at every block boundary (slot index % block_size), in training's packed blocks as in
    one served block.

    `prepare(x)` projects the offsets of both sides from the sublayer's normed input x, convolves x
    with the input side's and hands back the output side's, which `finish(y, delta)` applies to the
    sublayer's output y."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [side (0: input, 1: output), tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The exact no-op: kernel 1 on the slot itself, 0 on the slots before it, no offsets."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, Q, _ = x.shape
        delta = self.kernel_projection(x).view(b, Q, 2, self.kernel_size, -1)  # [b, Q, 2*T*G] -> [b, Q, side, T, G]
        return self._convolve(x, delta[:, :, 0], side=0), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, delta, side=1)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, *, side: int) -> torch.Tensor:
        """x [b, Q, d], delta [b, Q, T, G] -> [b, Q, d], in x's dtype."""
        b, Q, d = x.shape
        T, G = self.kernel_size, d // self.group_size
        grouped = x.view(b, Q, G, self.group_size)  # [b, Q, d] -> [b, Q, G, group_size]
        base = self.base_kernel[side].to(x.dtype).view(T, G, self.group_size)
        delta = delta.to(x.dtype)[..., None]  # [b, Q, T, G, 1]: one offset per group
        slot = torch.arange(Q, device=x.device) % self.block_size
        out = (base[0] + delta[:, :, 0]) * grouped
        for t in range(1, T):
            # x[i - t], zero where i - t lies in an earlier block (or before the first)
            earlier = F.pad(grouped[:, : Q - t], (0, 0, 0, 0, t, 0)) * (slot >= t).to(x.dtype)[:, None, None]
            out = out + (base[t] + delta[:, :, t]) * earlier
        return out.view(b, Q, d)


class DFlash2DecoderLayer(DecoderLayer):
    """A DFlash decoder layer with each sublayer wrapped in its convolution (z-lab's order):
    h += finish(attn(prepare(norm(h)))), then h += finish(mlp(prepare(norm(h))))."""

    def __init__(self, config: DFlash2Config, index: int) -> None:
        super().__init__(config, index)
        shape = (config.hidden_size, config.conv_kernel_size, config.conv_group_size, config.block_size)
        self.attention_conv = GroupedDynamicCausalConv(*shape)
        self.mlp_conv = GroupedDynamicCausalConv(*shape)

    def forward(self, h, context, cos, sin, attend) -> torch.Tensor:
        u, delta = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(u, context, cos, sin, attend), delta)
        u, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(u), delta)


class CandidateSelector(nn.Module):
    """Re-ranks each drafted slot's strict top-K unary candidates by the edge from its predecessor:
    S(p -> c) = U[c] + <A[p] * P h, B[c]> (A: predecessor_codebook [V, r], B: successor_codebook
    [V, r], bare parameters as z-lab's checkpoint names them; P: hidden_projection). B starts at
    zero: a fresh selector ranks as the unary logits do."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """SpecForge's start: A and P ~ N(0, 0.02), B = 0 (the successor factor learns first)."""
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.zeros_(self.successor_codebook)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V] -> (unary scores [..., K] in fp32, token ids [..., K]), best first: the strict
        top-K, as served, equal logits by the lower token id (rank_top_k), so which of them make the
        K and in what order does not depend on topk's unspecified order of ties."""
        ids = rank_top_k(logits, self.top_k)
        return logits.gather(-1, ids).float(), ids

    @staticmethod
    def best(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The position [...] of the best of scores [..., K], equal scores to the lower token id of
        candidates [..., K]: the choice a draft tree's first child is (drafter/tree.py)."""
        return rank_top_k(scores, 1, candidates)[..., 0]

    def scores(self, projected: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """S [..., K] (fp32) of the edges predecessors [...] -> candidates [..., K], from P h [..., r] and the unary scores [..., K]."""
        context = self.predecessor_codebook[predecessors.reshape(-1)].view(*projected.shape) * projected  # [..., r]
        return unary + torch.einsum("...r,...kr->...k", context, self.successor_codebook[candidates]).float()

    def choose(self, hidden: torch.Tensor, logits: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """Teacher forced: each row's best candidate [R] after its given predecessor [R] (hidden [R, d], logits [R, V])."""
        unary, ids = self.candidates(logits)
        best = self.best(self.scores(self.hidden_projection(hidden), unary, ids, predecessors), ids)
        return ids.gather(-1, best[:, None])[:, 0]

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_token: int | torch.Tensor) -> torch.Tensor:
        """The greedy path [L] through one block's drafted slots (hidden [L, d], logits [L, V]): each
        slot's best candidate after the token chosen before it, the first after the anchor; the
        lower token id wins a tie (vLLM's walk takes the lower candidate index, the same token
        wherever the tied candidates' unary logits tie too: the candidates are ranked so)."""
        unary, ids = self.candidates(logits)
        projected = self.hidden_projection(hidden)
        predecessor = anchor_ids(anchor_token, ids.device)  # [1]
        path = []
        for slot in range(ids.shape[0]):
            # Tensors index tensors here (gather, [1]-shaped ids): a 0-d index tensor is read back to
            # the host, a sync a slot; the walk stays on the device.
            best = self.best(self.scores(projected[slot], unary[slot], ids[slot], predecessor), ids[slot])
            predecessor = ids[slot].gather(0, best.reshape(1))
            path.append(predecessor)
        return torch.cat(path)


class DFlash2Trunk(DraftTrunk):
    """DraftTrunk with DFlash2's layers and the candidate selector, under z-lab's DFlash2 weight
    names: shared by the training `DFlash2Drafter` and the exported `DFlash2DraftModel` (dflash2.py)."""

    decoder_layer = DFlash2DecoderLayer

    def build_trunk(self, config: DFlash2Config) -> None:
        super().build_trunk(config)
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k)


class DFlash2Drafter(DFlash2Trunk, Drafter):
    """The training module: Drafter's interface; the convolutions and the selector start as no-ops."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        for module in self.modules():  # after Drafter's initialisation of every Linear
            if isinstance(module, (GroupedDynamicCausalConv, CandidateSelector)):
                module.reset_parameters()

    def block_drafts(self, hidden: torch.Tensor, anchor_token: int | torch.Tensor) -> torch.Tensor:
        """The selector's greedy walk over slots 1..B-1 of one block's hidden states [B, d] -> [B-1]."""
        return self.candidate_selector.walk(hidden[1:], self.logits(hidden[1:]), anchor_token)

    def teacher_forced_tokens(self, hidden: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
        """hidden [..., d], predecessors [...] -> each slot's selector choice [...] after its given
        predecessor, through the frozen LM head a bounded slice of logits at a time (as greedy_tokens)."""
        rows = max(1, GREEDY_LOGITS // self.config.vocab_size)
        flat, before = hidden.reshape(-1, hidden.shape[-1]), predecessors.reshape(-1)
        chosen = [self.candidate_selector.choose(part, self.logits(part), p) for part, p in zip(flat.split(rows), before.split(rows))]
        return torch.cat(chosen).view(hidden.shape[:-1])

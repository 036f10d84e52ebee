"""The DSpark drafter (reference/dflash2-dspark.md section 4; DeepSpec's Qwen3 drafter): the DFlash
backbone of model.py with the anchor as the first prediction slot, a Markov head and a confidence head.

- Slot k of the block [anchor, mask x (B-1)], at position anchor + k, drafts the token at
  anchor + k + 1: every one of the B slots is a draft (`sample_from_anchor`).
- Markov head, DeepSpec's "vanilla" one: a low-rank bigram bias on the backbone's logits,
  logits_k = lm_head(h_k) + W2 W1[prev_k], prev_k the token before slot k's (the anchor for slot 0,
  then what slot k - 1 drafted; in training, its label). So the block is drafted left to right,
  one r -> V matmul a slot after the backbone's single pass.
- Confidence head: c_k = sigmoid(w . [h_k ; W1[prev_k]] + b), the probability that slot k's draft
  survives verification given that every earlier one did; prod_{i <= k} c_i is the predicted
  survival of the first k + 1 drafts.

Initialised as DeepSpec initialises its drafter (transformers' _init_weights at initializer_range
0.02): both Markov tables and the confidence projection N(0, 0.02), the confidence bias 0.

Like model.py, this module imports torch and, relatively, model.py only: the export copies it beside
dspark.py, the Hugging Face entry point (`Qwen3DSparkModel`), so the served drafter runs this code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from .model import GREEDY_LOGITS, Drafter, DrafterConfig, anchor_ids

ARCHITECTURE = "Qwen3DSparkModel"
"""DeepSpec's class name, which vLLM maps to its Qwen3 DSpark drafter (never `DSparkDraftModel`:
vLLM maps that name to its DeepSeek-V4 drafter, reference/dflash2-dspark.md section 6, pitfall 5)."""
INITIALIZER_RANGE = 0.02


@dataclass(kw_only=True, slots=True)
class DSparkConfig(DrafterConfig):
    block_size: int = 7  # slots per block, the anchor's included; all of them are drafts (vLLM's num_speculative_tokens)
    markov_rank: int = 256  # rank r of the Markov head's two vocabulary x r tables
    enable_confidence_head: bool = True  # DeepSpec trains and exports one only with a positive confidence weight
    num_anchors: int = 512  # blocks sampled per document in training (DeepSpec's config records it)
    ce_weight: float = 0.1  # the objective's weights (train.dspark), not exported: cross-entropy to the data token,
    l1_weight: float = 0.9  # L1 distance to the target's distribution,
    confidence_weight: float = 1.0  # and the confidence head's BCE

    def __post_init__(self) -> None:
        DrafterConfig.__post_init__(self)  # explicit: zero-argument super() fails in a slots dataclass
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank {self.markov_rank}: DSpark's Markov head needs a rank >= 1")

    @property
    def reads_target(self) -> bool:
        """Whether the objective reads the target's distribution: the L1 term, or the confidence head's labels."""
        return self.l1_weight > 0 or self.enable_confidence_head

    def to_deepspec(self) -> dict[str, Any]:
        """The config.json of DeepSpec's flat layout (reference/dflash2-dspark.md 4.7a): a Qwen3 config
        plus target_layer_ids (z-lab ids), num_target_layers, mask_token_id, block_size, num_anchors,
        the heads' keys and sample_from_anchor, stated explicitly (vLLM defaults it to true, but a
        checkpoint without it has been served in the wrong layout: pitfall 1)."""
        config = self.to_zlab()
        del config["dflash_config"]
        config.update(
            architectures=[ARCHITECTURE],
            auto_map={"AutoModel": f"dspark.{ARCHITECTURE}"},
            target_layer_ids=list(self.target_layer_ids),
            mask_token_id=self.mask_token_id,
            num_anchors=self.num_anchors,
            markov_rank=self.markov_rank,
            markov_head_type="vanilla",
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=True,
            sample_from_anchor=True,
        )
        return config

    @classmethod
    def from_deepspec(cls, raw: Mapping[str, Any]) -> DSparkConfig:
        """From DeepSpec's flat config.json, or the to_dict() of the Qwen3Config transformers made of it."""
        if raw.get("sample_from_anchor", True) is not True:
            raise ValueError("sample_from_anchor is false: this DSpark drafter drafts from its anchor (B drafts a block); "
                             "a fill-in DSpark checkpoint is not supported here")
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"markov_head_type {raw['markov_head_type']!r}: only the vanilla Markov head is supported (as by vLLM)")
        if raw.get("enable_confidence_head") and not raw.get("confidence_head_with_markov", False):
            raise ValueError("confidence_head_with_markov is false: this drafter's confidence head reads the Markov embedding")
        backbone = DrafterConfig.from_zlab({**raw, "dflash_config": {"target_layer_ids": raw["target_layer_ids"], "mask_token_id": raw["mask_token_id"]}})
        return cls(
            **{f.name: getattr(backbone, f.name) for f in dataclasses.fields(DrafterConfig)},
            markov_rank=raw["markov_rank"], enable_confidence_head=bool(raw["enable_confidence_head"]),
            num_anchors=raw.get("num_anchors", cls.__dataclass_fields__["num_anchors"].default),
        )


class MarkovHead(nn.Module):
    """The bigram bias W2 W1[prev]: markov_w1 embeds the previous token in r dimensions, markov_w2 maps that onto the vocabulary."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, embedded: torch.Tensor) -> torch.Tensor:
        """W1[prev] [..., r] -> the bias on the logits [..., V]."""
        return self.markov_w2(embedded.to(self.markov_w2.weight.dtype))

    def bias_each(self, previous: torch.Tensor) -> torch.Tensor:
        """previous tokens [P] -> the bias [P, V] of each, bit for bit what `forward` gives for it alone:
        a [1, r] x [r, V] product a row against one weight (stride 0), where a [P, r] x [r, V] product
        rounds otherwise (up to 2e-6 on a CPU). For the rows of a draft tree (drafter/tree.py), which
        must rank as the drafter alone ranks them."""
        weight = self.markov_w2.weight  # [V, r]
        embedded = self.markov_w1(previous).to(weight.dtype)[:, None]  # [P, 1, r]
        return torch.bmm(embedded, weight.T.expand(len(previous), -1, -1))[:, 0]


class ConfidenceHead(nn.Module):
    """One logit per slot from its hidden state and its Markov embedding."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] and W1[prev] [..., r] -> float32 logits [...] (sigmoid: the slot's survival probability)."""
        features = torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()


class DSparkHeads:
    """The Markov and confidence heads under DeepSpec's names, and the left-to-right drafting through
    them: a mixin of the training `DSparkDrafter` and the exported `Qwen3DSparkModel` (dspark.py)."""

    def build_heads(self, config: DSparkConfig) -> None:
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        self.confidence_head = ConfidenceHead(config.hidden_size, config.markov_rank) if config.enable_confidence_head else None

    def markov_draft(self, base_logits: torch.Tensor, anchor_token: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafting of one block from the backbone's logits [B, V]: slot k takes the argmax of
        its logits plus the Markov bias of the token before it (the anchor, then slot k - 1's draft).
        Returns the drafts, int64 [B], and each slot's W1[prev] [B, r] (the confidence head's input)."""
        previous = anchor_ids(anchor_token, base_logits.device)
        drafts, embedded = [], []
        for logits in base_logits:
            embedding = self.markov_head.markov_w1(previous)  # [1, r]
            previous = (logits + self.markov_head(embedding)[0].to(logits.dtype)).argmax(-1, keepdim=True)
            drafts.append(previous)
            embedded.append(embedding)
        return torch.cat(drafts), torch.cat(embedded)

    def survival(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor | None:
        """Per slot, the confidence head's probability that its draft is accepted given the earlier
        ones were, float32 [...]; None without a confidence head."""
        return None if self.confidence_head is None else self.confidence_head(hidden, embedded).sigmoid()


class DSparkDrafter(DSparkHeads, Drafter):
    """Trainable: the backbone's layers, fc, hidden_norm and final norm, and both heads; frozen, from
    the target: the embedding, LM head and the target's final norm, as in Drafter."""

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        self.build_heads(config)
        for parameter in (self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight):
            nn.init.normal_(parameter, std=INITIALIZER_RANGE)
        if self.confidence_head is not None:
            nn.init.normal_(self.confidence_head.proj.weight, std=INITIALIZER_RANGE)
            nn.init.zeros_(self.confidence_head.proj.bias)

    @torch.no_grad()
    def draft_block(
        self, context_hidden: torch.Tensor, context_positions: torch.Tensor, anchor_token: int | torch.Tensor,
        anchor_position: int | torch.Tensor, *, context_length: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy draft of one block: the B tokens after `anchor_token`, int64 [B] (Drafter.draft_block's arguments)."""
        return self.draft_scored(context_hidden, context_positions, anchor_token, anchor_position, context_length=context_length)[0]

    @torch.no_grad()
    def draft_scored(
        self, context_hidden: torch.Tensor, context_positions: torch.Tensor, anchor_token: int | torch.Tensor,
        anchor_position: int | torch.Tensor, *, context_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's B greedy drafts, and the confidence head's survival probability of each
        (float32 [B]; None without a confidence head)."""
        hidden = self.block_hidden(context_hidden, context_positions, anchor_token, anchor_position, context_length=context_length)  # [B, d]
        drafts, embedded = self.markov_draft(self.logits(hidden), anchor_token)
        return drafts, self.survival(hidden, embedded)

    def teacher_forced_tokens(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] and each slot's previous token [...] -> argmax(lm_head(h) + W2 W1[previous]) [...],
        a bounded slice of logits at a time (at vocab 248K a few hundred rows of logits are a GB)."""
        rows = max(1, GREEDY_LOGITS // self.config.vocab_size)
        flat, flat_previous = hidden.reshape(-1, hidden.shape[-1]), previous.reshape(-1)
        tokens = [
            (self.logits(part) + self.markov_head(self.markov_head.markov_w1(before)).to(part.dtype)).argmax(-1)
            for part, before in zip(flat.split(rows), flat_previous.split(rows))
        ]
        return torch.cat(tokens).view(hidden.shape[:-1])


"""DSpark (DeepSeek, arXiv 2607.05147; reference/dflash2-dspark.md section 4): the DFlash backbone
with the anchor as the first prediction slot (B drafts a block), a Markov head drafting the block
left to right and a confidence head, trained toward the target's distribution (train/dspark_loss.py)
from the target's final hidden state, and exported in DeepSpec's layout (vLLM `method: dspark`)
and in speculators'."""

from __future__ import annotations

import dataclasses

import torch

from dflash_jobs.drafter.dspark_export import export_dspark
from dflash_jobs.drafter.dspark_model import DSparkConfig, DSparkDrafter
from dflash_jobs.drafter.model import DrafterConfig
from dflash_jobs.drafter.tree import ConditionalBranches
from dflash_jobs.spec import TrainSpec
from dflash_jobs.train.dspark_loss import RATIOS, dspark_objective, previous_tokens
from dflash_jobs.variants import DrafterVariant


def build_config(config: DrafterConfig, train: TrainSpec) -> DSparkConfig:
    """The backbone's config with train.dspark's heads and objective weights."""
    settings = train.dspark
    return DSparkConfig(
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(DrafterConfig)},
        markov_rank=settings.markov_rank, enable_confidence_head=settings.confidence_head, num_anchors=train.anchors,
        ce_weight=settings.ce_weight, l1_weight=settings.l1_weight, confidence_weight=settings.confidence_weight,
    )


def branches(drafter: DSparkDrafter, hidden: torch.Tensor, anchor: int) -> ConditionalBranches:
    """Slot d - 1 drafts depth d (the anchor's slot drafts the first token): its logits plus the
    Markov bias W2 W1[parent], computed as `markov_draft` computes them, so the first child at every
    depth is its greedy draft and a branch's children follow the branch's own last token."""
    base = drafter.logits(hidden)  # [B, V]
    head = drafter.markov_head

    def biased(depth: int, parents: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits = base[depth - 1]
        return logits + head.bias_each(parents).to(logits.dtype), None

    return ConditionalBranches(biased, anchor, depths=len(base), device=base.device)


def extra_flops(config: DSparkConfig, slots: int, supervised: int) -> float:
    """Per supervised slot: the Markov bias W2 W1[prev] (r x V) forward and backward, the confidence
    head ((d + r) x 1) forward and backward, and the target's logits (d x V) once, which the L1 term
    and the confidence labels read."""
    d, r, V = config.hidden_size, config.markov_rank, config.vocab_size
    confidence = 3 * 2 * (d + r) if config.enable_confidence_head else 0
    return supervised * (3 * 2 * r * V + confidence + (2 * d * V if config.reads_target else 0))


VARIANT = DrafterVariant(
    name="dspark",
    build_config=build_config,
    build_model=DSparkDrafter,
    config_from_export=DSparkConfig.from_deepspec,
    objective=dspark_objective,
    predict=lambda drafter, hidden, batch: drafter.teacher_forced_tokens(hidden, previous_tokens(batch.block_ids, batch.labels)),
    export=export_dspark,
    branches=branches,
    metrics=RATIOS,
    extra_flops=extra_flops,
)

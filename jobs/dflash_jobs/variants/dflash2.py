"""DFlash2 (Inco AI / z-lab, reference/dflash2-dspark.md section 3): the DFlash backbone with in-block
convolutions and a candidate selector (drafter/dflash2_model.py), trained from the same stored
states as DFlash with SpecForge's objective (train/dflash2_loss.py), exported in z-lab's DFlash2
layout that vLLM (>= 0.28.0, `method: dflash`, V2 model runner) serves as `DFlash2DraftModel`."""

from __future__ import annotations

import dataclasses

import torch

from dflash_jobs.drafter.dflash2_model import DFlash2Config, DFlash2Drafter
from dflash_jobs.drafter.export import MODELING_FILES, write_export
from dflash_jobs.drafter.model import DrafterConfig
from dflash_jobs.drafter.tree import ConditionalBranches
from dflash_jobs.errors import SpecError
from dflash_jobs.spec import TrainSpec
from dflash_jobs.storage import Storage
from dflash_jobs.train.dflash2_loss import dflash2_objective, teacher_forced_predecessors
from dflash_jobs.variants import DrafterVariant

DFLASH2_MODELING_FILES = ("dflash2.py", "dflash2_model.py", *MODELING_FILES)
"""The inference code the export carries: dflash2.py (named in auto_map) builds on dflash.py's."""


def build_config(config: DrafterConfig, train: TrainSpec) -> DFlash2Config:
    """The backbone's config with train.dflash2's settings; what the target must allow is checked
    here, at training start (the spec alone cannot know the target's shape). Every layer is
    bidirectional inside the block (is_causal false), sliding or not."""
    settings = train.dflash2
    if config.hidden_size % settings.conv_group_size:
        divisors = [g for g in (16, 8, 4, 2, 1) if config.hidden_size % g == 0]
        raise SpecError("train.dflash2.conv_group_size", settings.conv_group_size,
                        f"a divisor of the target's hidden size {config.hidden_size}, e.g. {divisors[0]}: each group of channels shares one kernel offset")
    if settings.selector_top_k > config.vocab_size:
        raise SpecError("train.dflash2.selector_top_k", settings.selector_top_k, f"at most the target's vocabulary size ({config.vocab_size})")
    return DFlash2Config(
        **{**dataclasses.asdict(config), "is_causal": False},
        conv_kernel_size=settings.conv_kernel_size, conv_group_size=settings.conv_group_size,
        selector_rank=settings.selector_rank, selector_top_k=settings.selector_top_k,
        selector_alpha=settings.selector_alpha, selector_stop_gradient=settings.selector_stop_gradient,
    )


def predict(drafter: DFlash2Drafter, hidden, batch):
    """The selector's teacher-forced choice at every slot (each after the data token before it)."""
    return drafter.teacher_forced_tokens(hidden, teacher_forced_predecessors(batch.block_ids, batch.labels))


def branches(drafter: DFlash2Drafter, hidden: torch.Tensor, anchor: int) -> ConditionalBranches:
    """Slot d (depth d) offers its strict top-K unary candidates, ranked by the selector's score of
    the edge from the parent (the anchor at depth 1): the distribution vLLM samples from at T > 0,
    whose best child is the greedy walk's choice (ties to the lower token id, as the walk)."""
    slots = hidden[1:]
    selector = drafter.candidate_selector
    unary, candidates = selector.candidates(drafter.logits(slots))
    projected = selector.hidden_projection(slots)

    def edges(depth: int, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # parents [P] -> the scores [P, K] of their edges to the slot's candidates, every parent's in one call
        slot, shape = depth - 1, (len(parents), candidates.shape[-1])
        ids = candidates[slot].expand(shape)
        return selector.scores(projected[slot].expand(len(parents), -1), unary[slot].expand(shape), ids, parents), ids

    return ConditionalBranches(edges, anchor, depths=len(candidates), device=candidates.device)


def export_dflash2(drafter: DFlash2Drafter, storage: Storage, prefix: str) -> None:
    """z-lab's DFlash2 layout: the weights under its names (bare codebooks), the inference code, config.json."""
    write_export(storage, prefix, drafter.state_dict(), DFLASH2_MODELING_FILES, drafter.config.to_zlab())


def extra_flops(config: DFlash2Config, slots: int, supervised: int) -> float:
    """Forward plus backward FLOPs of the convolutions (their kernel projections and taps, two per
    sublayer) over every block slot, and of the selector (P h, the unary logits at the K candidates,
    the bilinear scores) over the supervised slots."""
    d, T, K, r = config.hidden_size, config.conv_kernel_size, config.selector_top_k, config.selector_rank
    groups = d // config.conv_group_size
    convolution = 2 * slots * d * (2 * T * groups) + 2 * (2 * T * slots * d)  # kernel projection; T multiply-adds per channel, both sides
    selector = 2 * supervised * d * r + 2 * supervised * K * (d + r)
    return 3 * (2 * config.num_layers * convolution + selector)


VARIANT = DrafterVariant(
    name="dflash2",
    build_config=build_config,
    build_model=DFlash2Drafter,
    config_from_export=DFlash2Config.from_zlab,
    objective=dflash2_objective,
    predict=predict,
    export=export_dflash2,
    branches=branches,
    metrics=("selector_loss", "selector_accuracy", "unary_accuracy", "top_k_recall"),
    extra_flops=extra_flops,
)

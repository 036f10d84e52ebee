"""DFlash (z-lab, reference/dflash.md): the backbone alone, trained with cross-entropy on slots
1..B-1 (train/loss.py) and exported in the z-lab layout vLLM's `method: dflash` loads."""

from __future__ import annotations

from dflash_jobs.drafter.export import export_dflash
from dflash_jobs.drafter.model import Drafter, DrafterConfig
from dflash_jobs.drafter.tree import MarginalBranches
from dflash_jobs.train.loss import dflash_objective
from dflash_jobs.variants import DrafterVariant

VARIANT = DrafterVariant(
    name="dflash",
    build_config=lambda config, train: config,
    build_model=Drafter,
    config_from_export=DrafterConfig.from_zlab,
    objective=dflash_objective,
    predict=lambda drafter, hidden, batch: drafter.greedy_tokens(hidden),
    export=export_dflash,
    # Slots 1..B-1 draft depths 1..B-1, each its own marginal whatever the token before it.
    branches=lambda drafter, hidden, anchor: MarginalBranches(drafter.logits(hidden[1:]), anchor),
)

"""Drafter variants: the one seam where a drafter plugs in, as a model registers a TrainSpec in torchtitan.

A variant is what differs between DFlash, DFlash2 and DSpark: the drafter's config and modules, its
objective, its teacher-forced greedy prediction and its export. Everything else is shared and reads
the variant through this record: the stored states and the data path (whose block layout
spec/anchors.py's `AnchorLayout` gives), the training loop, checkpoints, speculative decoding
(every drafter module drafts a block with `draft_block`) and the evaluation. `train.drafter` names
one; `drafter_variant` imports only that one.

A drafter module keeps the backbone's interface (drafter/model.py `Drafter`): `config`, `fc` (its
device), `forward(context_hidden, context_positions, block_ids, block_positions, attention)` ->
final-normed hidden states [N, B, d], `load_target_tensors(embed_tokens, lm_head, final_norm)`,
`logits(hidden)`, `block_hidden(context_hidden, context_positions, anchor_token, anchor_position)`
-> the block's hidden states [B, d], and `draft_block(...)` (the same arguments) -> the drafted ids of
one block (greedy).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dflash_jobs.drafter.model import DrafterConfig
    from dflash_jobs.drafter.tree import Branches
    from dflash_jobs.spec import TrainSpec
    from dflash_jobs.storage import Storage
    from dflash_jobs.train.data import Batch
    from dflash_jobs.train.loss import DraftLoss


class Objective(Protocol):
    def __call__(self, drafter: nn.Module, hidden: torch.Tensor, batch: Batch, *, normalizer: torch.Tensor | None, fused: bool) -> DraftLoss:
        """The training loss of a micro-batch from the drafter's block hidden states [N, B, d], with
        the counts behind its metrics. normalizer: what the weighted sum is divided by (the global
        mean of the loss weights under DDP; None: this batch's own); fused: the elementwise work
        compiled (train.compile)."""
        ...


class Predict(Protocol):
    def __call__(self, drafter: nn.Module, hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
        """int64 [N, B]: the drafter's greedy token at every slot, teacher forced (each slot's
        predecessor is the label before it, as in decoding while every earlier draft was right):
        what the train/serve check compares with decoding at the same anchors."""
        ...


@dataclass(frozen=True, slots=True)
class DrafterVariant:
    name: str
    """train.drafter's value."""
    build_config: Callable[[DrafterConfig, TrainSpec], DrafterConfig]
    """The variant's drafter config from the backbone's (its own settings, from train.<name>, added)."""
    build_model: Callable[[DrafterConfig], nn.Module]
    """A fresh training module; modules added to the DFlash backbone start as no-ops where the variant's recipe says so."""
    config_from_export: Callable[[Mapping[str, Any]], DrafterConfig]
    """The config of an exported drafter, from its config.json."""
    objective: Objective
    predict: Predict
    export: Callable[[nn.Module, Storage, str], None]
    """Writes the drafter under a storage prefix in the layout its serving engines load (config.json last)."""
    branches: Callable[[nn.Module, torch.Tensor, int], Branches]
    """(drafter, the block's hidden states [B, d], the anchor token) -> each drafted slot's children
    of a parent, likeliest first (drafter/tree.py): what a draft tree is built from (DDTree). Its
    first child at every depth is the block `draft_block` drafts."""
    metrics: tuple[str, ...] = ()
    """The objective's own figures (DraftLoss.ratios keys), logged beside loss and acceptance."""
    extra_flops: Callable[[DrafterConfig, int, int], float] = lambda config, slots, supervised: 0.0
    """Training FLOPs of one step spent by the variant's own modules, beyond the DFlash backbone and
    its loss, from (config, block slots, supervised slots): what bench/train adds to its MFU count."""


VARIANT_MODULES = {
    "dflash": "dflash_jobs.variants.dflash",
    "dflash2": "dflash_jobs.variants.dflash2",
    "dspark": "dflash_jobs.variants.dspark",
}
"""Where each variant is assembled (each module holds a VARIANT): imported on demand, so a run loads only its own."""


def drafter_variant(name: str) -> DrafterVariant:
    """The variant called `name` (spec.train.drafter)."""
    if name not in VARIANT_MODULES:
        raise ValueError(f"train.drafter {name!r} has no implementation here (known: {', '.join(VARIANT_MODULES)})")
    return importlib.import_module(VARIANT_MODULES[name]).VARIANT

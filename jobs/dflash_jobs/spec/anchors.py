"""The anchor layout of each drafter, in one table that the spec reads for the defaults of
train.block_size and train.gamma: part of the contract, so that the spec, the controller, the
training data, the evaluation and serving agree on it without importing the drafters."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AnchorLayout:
    """What the slots of a block drafted after an anchor predict, and which are trained
    (reference/dflash2-dspark.md 4.5); torch-free, so that the spec, the controller, the training
    data and the evaluation agree on it."""

    sample_from_anchor: bool
    """False: slot k predicts the token at anchor + k (slot 0 is the anchor itself, untrained; B - 1
    drafts). True: slot k predicts anchor + k + 1 (the anchor is a prediction slot; B drafts)."""
    contiguous_prefix: bool
    """Only a block's leading run of supervised labels is trained (DSpark); else every supervised slot."""
    block_size: int
    """Slots per block, the anchor's included (the variant's default until the spec sets train.block_size)."""
    gamma: float
    """Loss decay over the drafted slots: the j-th drafted slot (j = 0, 1, ...) weighs exp(-j / gamma)."""

    @property
    def drafts(self) -> int:
        """Drafted tokens per block: what vLLM's num_speculative_tokens must be."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def first_draft(self) -> int:
        """The slot of the first drafted token: 0 when the anchor is a prediction slot, else 1."""
        return 0 if self.sample_from_anchor else 1

    @property
    def label_offset(self) -> int:
        """Slot k's label is the token at anchor + k + label_offset."""
        return 1 if self.sample_from_anchor else 0

    def slot_decay(self) -> list[float]:
        """Per slot, its loss weight before the loss mask: 0 for the anchor slot of a fill-in block,
        exp(-j / gamma) for the j-th drafted slot (z-lab's exp(-(k-1)/gamma), DeepSpec's exp(-k/gamma))."""
        return [0.0 if k < self.first_draft else math.exp(-(k - self.first_draft) / self.gamma) for k in range(self.block_size)]


ANCHOR_LAYOUTS = {
    "dflash": AnchorLayout(sample_from_anchor=False, contiguous_prefix=False, block_size=16, gamma=7.0),
    "dflash2": AnchorLayout(sample_from_anchor=False, contiguous_prefix=False, block_size=8, gamma=7.0),
    "dspark": AnchorLayout(sample_from_anchor=True, contiguous_prefix=True, block_size=7, gamma=4.0),
}


def anchor_layout(drafter: str = "dflash", *, block_size: int | None = None, gamma: float | None = None) -> AnchorLayout:
    """A drafter's anchor layout, at its defaults unless given."""
    layout = ANCHOR_LAYOUTS[drafter]
    return dataclasses.replace(layout, block_size=block_size or layout.block_size, gamma=gamma or layout.gamma)

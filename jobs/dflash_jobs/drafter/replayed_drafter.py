"""The trained drafter's block as one replayed CUDA graph on a GPU, beside the static-cache target
(static_target.py): with the target's forwards replayed, the drafter's eager forward (some 600
dispatched ops a block for SmolLM2's 3-layer drafter, a third of a target forward's) would be most of
a verify step's host time.

A graph replays fixed shapes; the drafter reads every committed position's captured layers, which
grow by a block a step. So the context is copied into a buffer padded to a window of CACHE_ALIGN
rows, and the block sees only its real rows (Drafter.draft_block's `context_length`): a graph per
window. The anchor's token and position are device scalars the graph reads.
"""

from __future__ import annotations

import torch

from dflash_jobs.drafter.speculative import ModelDrafter
from dflash_jobs.static_cache import CapturedSteps, aligned


class ReplayedDrafter(ModelDrafter):
    """ModelDrafter (a BlockDrafter) whose draft_block runs over the context padded to its window,
    captured as a CUDA graph per window on a GPU (eager elsewhere): the same drafts."""

    def __init__(self, drafter, *, drafts: int) -> None:
        super().__init__(drafter, drafts=drafts)
        self.capacity = 0
        self.steps: CapturedSteps | None = None

    def _reserve(self, rows: int, like: torch.Tensor) -> None:
        """Buffers for a context of `rows` rows; made anew (and the graphs with them) only where the last are too short."""
        if rows <= self.capacity:
            return
        self.capacity = 2 * aligned(rows)  # room to grow: a prompt's decoding adds at most a few windows
        self.steps = None  # the last buffers' graphs freed before the new ones are made
        self.steps = CapturedSteps(like.device)
        self._context = like.new_zeros(self.capacity, like.shape[-1])
        self._positions = torch.arange(self.capacity, device=like.device)
        self._anchor_position = torch.zeros((), dtype=torch.long, device=like.device)  # the context's real rows, too
        self._anchor_token = torch.zeros((), dtype=torch.long, device=like.device)

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        rows = len(context)  # the committed positions before the anchor: the anchor's own position
        window = aligned(max(rows, 1))
        self._reserve(window, context)
        self._context[:rows].copy_(context)
        self._anchor_position.fill_(rows)
        self._anchor_token.copy_(tokens[-1])  # on the device: no read
        drafts = self.steps(window, lambda: self.drafter.draft_block(
            self._context[None, :window], self._positions[:window], self._anchor_token, self._anchor_position,
            context_length=self._anchor_position))
        return drafts.clone()  # a replay refills the graph's output

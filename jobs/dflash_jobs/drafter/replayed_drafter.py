"""The trained drafter's step as one replayed CUDA graph on a GPU, beside the static-cache target
(static_target.py): with the target's forwards replayed, the drafter's eager work would be most of a
step's host time (counted on a CPU with drafter/host_reads.py for bench/evaluation/eval_loops.py's
SmolLM2-shaped target and 5-layer drafter: 618 dispatched ops a block, 615 for a tree's branches and
481 to grow it, against 1,878 for the target's verify forward of 16 tokens).

A graph replays fixed shapes; the drafter reads every committed position's captured layers, which
grow by a block a step. So the context is copied into a buffer padded to a window of CACHE_ALIGN
rows, and the block sees only its real rows (Drafter.block_hidden's `context_length`): a graph per
window. The anchor's token and position are device scalars the graph reads. Two steps replay so:
the chain's block (ReplayedDrafter) and a tree's branches grown into the tree (evaluate/trees.py
ReplayedBranches).
"""

from __future__ import annotations

import torch

from dflash_jobs.drafter.speculative import ModelDrafter
from dflash_jobs.static_cache import CapturedSteps, aligned


class PaddedContext:
    """The drafter's inputs in buffers a graph reads: the context padded to its window, the anchor's
    token and position (the context's real rows); and the graphs of the steps that read them."""

    def __init__(self) -> None:
        self.capacity = 0
        self.steps: CapturedSteps | None = None

    def load(self, context: torch.Tensor, anchor_token: int | torch.Tensor) -> int:
        """The context and the anchor into the buffers (on the device, without waiting): the window, a
        multiple of CACHE_ALIGN rows, that the step reads."""
        rows = len(context)  # the committed positions before the anchor: the anchor's own position
        window = aligned(max(rows, 1))
        if window > self.capacity:  # buffers made anew, and the graphs with them, only where the last are too short
            self.capacity = 2 * window  # room to grow: a prompt's decoding adds a few windows at most
            self.steps = None  # the last buffers' graphs freed before the new ones are made
            self.steps = CapturedSteps(context.device)
            self.context = context.new_zeros(self.capacity, context.shape[-1])
            self.positions = torch.arange(self.capacity, device=context.device)
            self.anchor_position = torch.zeros((), dtype=torch.long, device=context.device)
            self.anchor_token = torch.zeros((), dtype=torch.long, device=context.device)
        self.context[:rows].copy_(context)
        self.anchor_position.fill_(rows)
        if isinstance(anchor_token, torch.Tensor):
            self.anchor_token.copy_(anchor_token)
        else:
            self.anchor_token.fill_(anchor_token)
        return window

    def arguments(self, window: int) -> tuple[tuple, dict]:
        """draft_block's and block_hidden's arguments over the window, its real rows seen (for a step to pass)."""
        return (self.context[None, :window], self.positions[:window], self.anchor_token, self.anchor_position), \
            {"context_length": self.anchor_position}


class ReplayedDrafter(ModelDrafter):
    """ModelDrafter (a BlockDrafter) whose block runs over the padded context, a graph per window on a
    GPU (eager elsewhere): the same drafts."""

    def __init__(self, drafter, *, drafts: int) -> None:
        super().__init__(drafter, drafts=drafts)
        self.padded = PaddedContext()

    def propose(self, tokens: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        window = self.padded.load(context, tokens[-1])  # the anchor stays on the device
        args, kwargs = self.padded.arguments(window)
        drafts = self.padded.steps(window, lambda: self.drafter.draft_block(*args, **kwargs))
        return drafts.clone()  # a replay refills the graph's output


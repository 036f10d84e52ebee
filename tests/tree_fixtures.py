"""Scores of a test's own draft trees, written a parent at a time (drafter/tree.py takes every parent of a depth at once)."""

from __future__ import annotations

from typing import Callable

import torch

from dflash_jobs.drafter.tree import Scores


def each_parent(scores: Callable[[int, int], torch.Tensor]) -> Scores:
    """scores(depth, parent token) -> the children's scores over the vocabulary [V], as drafter/tree.py
    Scores: a row per parent of parents [P] (each read to the host: a test's trees are not timed)."""
    return lambda depth, parents: (torch.stack([scores(depth, int(parent)) for parent in parents]), None)

"""Anchor sampling (reference/dflash.md 3.2): each epoch, up to `count` anchors per document,
uniformly without replacement over the positions p where loss_mask[p] and loss_mask[p + 1] are
both set, so every block has at least one supervised label (slot 1).

Deterministic in (seed, epoch, sample id): the same document gets the same anchors on every rank
count and after a restart, and new ones in the next epoch.
"""

from __future__ import annotations

import numpy as np


def anchor_candidates(loss_mask: np.ndarray) -> np.ndarray:
    """int64 positions p with loss_mask[p] == loss_mask[p + 1] == 1."""
    supervised = loss_mask.astype(bool)
    return np.flatnonzero(supervised[:-1] & supervised[1:]).astype(np.int64)


def sample_anchors(loss_mask: np.ndarray, count: int, *, seed: int, epoch: int, sample_id: int) -> np.ndarray:
    """Sorted int64 anchor positions of one document (all candidates if there are at most `count`)."""
    candidates = anchor_candidates(loss_mask)
    if len(candidates) <= count:
        return candidates
    rng = np.random.default_rng([seed, epoch, sample_id])
    return np.sort(rng.choice(candidates, size=count, replace=False))

"""train/flops.py's attention count: the visible (query, key) pairs of a block layout, per layer kind."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dflash_jobs.train.flops import attention_flops, visible_pairs


def layout(anchors: list[int], block_size: int = 4) -> SimpleNamespace:
    return SimpleNamespace(block_size=block_size, anchor=torch.tensor(anchors), context_start=torch.zeros(len(anchors), dtype=torch.long))


def test_a_full_attention_block_sees_its_context_and_its_whole_block():
    # anchors 10 and 3: (10 context + 4 block) x 4 slots + (3 + 4) x 4
    assert visible_pairs(layout([10, 3]), None) == 14 * 4 + 7 * 4


def test_a_sliding_window_cuts_the_context_each_slot_sees():
    # window 4, anchor 10: slot s sees min(10, 3 - s) context tokens and the s + 1 block slots before it, itself included
    assert visible_pairs(layout([10]), 4) == sum(min(10, max(0, 3 - s)) + s + 1 for s in range(4))


def test_attention_flops_sum_each_layers_pairs_at_four_head_dims_a_pair_and_head():
    config = SimpleNamespace(head_dim=8, num_attention_heads=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    batch = SimpleNamespace(layout=layout([10, 3]))
    pairs = visible_pairs(batch.layout, 4) + visible_pairs(batch.layout, None)
    assert attention_flops(config, batch) == 4 * 8 * 2 * pairs

"""Which chunks a shard owns: a deterministic, token-balanced assignment.

Chunks are cut by prepare and never depend on the shard count; only this assignment does. It is a
pure function of (chunk sizes, shard count), so every pod computes the same split without talking
to the others, and a relaunch with another shard count re-splits the same chunks (done ones are
skipped by their markers, so nothing is lost or repeated).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from dflash_jobs.formats import ChunkInfo


def assign_chunks(chunks: Sequence[ChunkInfo], shards: int) -> list[list[ChunkInfo]]:
    """Greedy LPT: the largest chunk first goes to the shard with the fewest tokens so far.

    Ties are broken by chunk id and shard index, so the result is deterministic. The most loaded
    shard carries at most the mean load plus one chunk, which keeps stragglers short. Each
    shard's chunks come back sorted by id."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    loads = [(0, shard) for shard in range(shards)]  # (tokens, shard index): a min-heap
    owned: list[list[ChunkInfo]] = [[] for _ in range(shards)]
    for chunk in sorted(chunks, key=lambda c: (-c.tokens, c.id)):
        tokens, shard = heapq.heappop(loads)
        owned[shard].append(chunk)
        heapq.heappush(loads, (tokens + chunk.tokens, shard))
    return [sorted(mine, key=lambda c: c.id) for mine in owned]


def shard_chunks(chunks: Sequence[ChunkInfo], shards: int, index: int) -> list[ChunkInfo]:
    """The chunks shard `index` of `shards` owns."""
    if not 0 <= index < shards:
        raise ValueError(f"shard index {index} is outside 0..{shards - 1}")
    return assign_chunks(chunks, shards)[index]

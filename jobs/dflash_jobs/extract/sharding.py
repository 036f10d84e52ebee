"""Which chunks a shard owns: a deterministic, token-balanced assignment.

Chunks are cut by prepare and never depend on the shard count; only this assignment does. It is a
pure function of (chunk sizes, shard count), so every pod computes the same split without talking
to the others, and a relaunch with another shard count re-splits the same chunks (done ones are
skipped by their markers, so nothing is lost or repeated).
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_jobs.balance import balance_by_tokens
from dflash_jobs.formats import ChunkInfo


def assign_chunks(chunks: Sequence[ChunkInfo], shards: int) -> list[list[ChunkInfo]]:
    """Every shard's chunks, balanced by tokens (dflash_jobs.balance), each list sorted by chunk id."""
    return balance_by_tokens(chunks, shards, tokens=lambda c: c.tokens, ident=lambda c: c.id)


def shard_chunks(chunks: Sequence[ChunkInfo], shards: int, index: int) -> list[ChunkInfo]:
    """The chunks shard `index` of `shards` owns."""
    if not 0 <= index < shards:
        raise ValueError(f"shard index {index} is outside 0..{shards - 1}")
    return assign_chunks(chunks, shards)[index]

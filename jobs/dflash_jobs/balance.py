"""Token-balanced assignment of chunks to workers: extraction shards and training ranks alike."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")


def balance_by_tokens(
    items: Sequence[Item], parts: int, *, tokens: Callable[[Item], int], ident: Callable[[Item], int]
) -> list[list[Item]]:
    """Greedy LPT: the largest item first goes to the part with the fewest tokens so far.

    Ties are broken by `ident` and part index, so the result is a pure function of the items and
    `parts`. The most loaded part carries at most the mean load plus one item, which keeps
    stragglers short. Each part's items come back sorted by `ident`."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    loads = [(0, part) for part in range(parts)]  # (tokens, part index): a min-heap
    owned: list[list[Item]] = [[] for _ in range(parts)]
    for item in sorted(items, key=lambda i: (-tokens(i), ident(i))):
        load, part = heapq.heappop(loads)
        owned[part].append(item)
        heapq.heappush(loads, (load + tokens(item), part))
    return [sorted(mine, key=ident) for mine in owned]

"""Draft trees (DDTree, Ringel & Romano 2026; reference/dflash.md section 7): from the distributions
one drafter pass gives its drafted slots, the `budget` likeliest continuations of the anchor, as a tree.

A node is a token at a depth (depth d: the d-th token after the anchor) under a parent; its score
is the drafter's log-probability of its whole root path, the sum of its nodes' log-probabilities.
`Branches` gives a parent's children at a depth, likeliest first; each variant builds its own from
the block's hidden states (`DrafterVariant.branches`):
- DFlash: each slot's marginal, whatever the parent (`MarginalBranches`);
- DFlash2: the slot's top-K unary candidates ranked by the selector's edge from the parent;
- DSpark: the slot's logits plus the Markov head's bias of the parent.
The last two condition on the parent (`ConditionalBranches`): two siblings' subtrees differ.

The tree is DDTree's: the `budget` highest-scoring nodes, in the order a best-first search pops
them (a heap of candidates, each a node's next sibling or its first child), which form a tree (a
child never scores above its parent, nor a sibling above an earlier one). `grow_tree` builds it on
the device, a depth at a time, every parent of a depth ranked in one call (`Branches.ranked`), so a
decoding step reads nothing of it before the verify forward (drafter/tree_verify.py reads the tree
and the target's tokens together, once); `build_tree` reads it to the host. A parent's children
are ranked by (score descending, token id ascending) everywhere (`rank_top_k`), the order argmax's
tie rule gives, whatever order topk returns equal scores in (bf16 makes them common); equal path
scores go to the smaller path of ranks. So a smaller budget's tree is the first nodes of a larger
one's, and the path of first children (rank 0 at every depth) is the chain the variant drafts
greedily, ties included.

Under greedy verification a tree commits its longest root path whose every token is the target's
greedy choice after the path before it, plus the target's next token (`Tree.follow`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dflash_jobs.drafter.model import anchor_ids, rank_top_k

Scores = Callable[[int, torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]
"""(depth, parent tokens [P] on the device) -> their children's scores [P, n] (log-probabilities up
to a constant) and token ids [P, n] (None: the scores cover the vocabulary, the token is its index).
Each parent's row is the one it gets alone, bit for bit: a tree grown a depth at a time (`grow_tree`)
and a parent's children read on the host (`Branches.children`) rank alike."""


class Branches:
    """A parent's children at a depth: tokens and log-probabilities, likeliest first, on the device
    (`ranked`, many parents at once) or read on the host (`children`, one parent)."""

    def __init__(self, anchor: int, depths: int, device: torch.device) -> None:
        self.anchor = anchor
        """The last committed token: the parent of the depth-1 children."""
        self.depths = depths
        """The drafted slots: no child deeper than this."""
        self.device = device
        self._read: dict[tuple[int, int], tuple[int, tuple[list[int], list[float]]]] = {}

    def ranked(self, depth: int, parents: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest children at `depth` (1-based) of each of parents [P] (token ids on the
        device): token ids [P, c] and their log-probabilities [P, c] (float32), best first, equal
        scores by the lower token id (rank_top_k); c = k, or fewer where a parent has fewer."""
        raise NotImplementedError

    def children(self, depth: int, parent: int, k: int) -> tuple[list[int], list[float]]:
        """The k likeliest children of `parent` at `depth`, as token ids and log-probabilities (a read
        per (depth, parent), kept)."""
        known = self._read.get((depth, parent))
        if known is None or known[0] < k:
            tokens, log_probs = self.ranked(depth, anchor_ids(parent, self.device), k)
            known = (k, read_ranked(tokens[0], log_probs[0]))
            self._read[(depth, parent)] = known
        tokens, log_probs = known[1]
        return tokens[:k], log_probs[:k]

    def chain(self, depths: int) -> list[int]:
        """The first child at every depth down to `depths`: the chain the variant drafts greedily."""
        path, parent = [], self.anchor
        for depth in range(1, depths + 1):
            parent = self.children(depth, parent, 1)[0][0]
            path.append(parent)
        return path


def read_ranked(ids: torch.Tensor, log_probs: torch.Tensor) -> tuple[list, list]:
    """ids and their log-probabilities ([k], or [D, k] as rows) on the host in one read, not two: a
    read waits for the device (ids below 2^53 and float32 values are exact as float64)."""
    ids_read, values = torch.stack([ids.double(), log_probs.double()]).tolist()
    integral = (lambda row: [int(i) for i in row]) if ids.dim() == 2 else int
    return [integral(row) for row in ids_read], values


class MarginalBranches(Branches):
    """Independent slots (DFlash): a child's distribution is its depth's, whoever the parent."""

    def __init__(self, logits: torch.Tensor, anchor: int) -> None:
        """logits [D, V]: row d - 1 is depth d's."""
        super().__init__(anchor, len(logits), logits.device)
        self.logits = logits
        self._ranking: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._ranked: list[tuple[list[int], list[float]]] = []
        self._k = 0

    def _every_depth(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every depth's k likeliest at once, [D, k]: one ranking over the block."""
        if self._ranking is None or self._ranking[0] < k:
            order = rank_top_k(self.logits, k)
            self._ranking = (k, order, self.logits.float().log_softmax(-1).gather(-1, order))
        _, order, log_probs = self._ranking
        return order[:, :k], log_probs[:, :k]

    def ranked(self, depth: int, parents: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, log_probs = self._every_depth(k)
        return tokens[depth - 1].expand(len(parents), -1), log_probs[depth - 1].expand(len(parents), -1)

    def children(self, depth: int, parent: int, k: int) -> tuple[list[int], list[float]]:
        if k > self._k:  # every depth read at once
            self._ranked, self._k = list(zip(*read_ranked(*self._every_depth(k)))), k
        tokens, log_probs = self._ranked[depth - 1]
        return tokens[:k], log_probs[:k]


class ConditionalBranches(Branches):
    """Slots that depend on the parent (DFlash2's selector, DSpark's Markov head): `scores` gives
    parents' children at a depth, every parent of a depth in one call."""

    def __init__(self, scores: Scores, anchor: int, depths: int, device: torch.device) -> None:
        super().__init__(anchor, depths, device)
        self.scores = scores

    def ranked(self, depth: int, parents: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores, ids = self.scores(depth, parents)
        order = rank_top_k(scores, k, ids)
        return (order if ids is None else ids.gather(-1, order)), scores.float().log_softmax(-1).gather(-1, order)


@dataclass(frozen=True, slots=True)
class Tree:
    """A draft tree below the anchor (the root, not a node), its nodes in the order the search took them."""

    tokens: list[int]
    parents: list[int]
    """Each node's parent node (an earlier index), -1 for the root."""
    depths: list[int]
    """1 for the root's children."""
    scores: list[float]
    """The drafter's log-probability of each node's root path."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth_bound(self) -> int:
        """No node deeper (architectures/tree.py DraftTree)."""
        return max(self.depths, default=0)

    @classmethod
    def path(cls, tokens: Sequence[int]) -> Tree:
        """A chain as a tree: each token the child of the one before."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), list(range(1, len(tokens) + 1)), [0.0] * len(tokens))

    def prefix(self, budget: int) -> Tree:
        """The tree of a smaller budget: its first nodes."""
        return Tree(self.tokens[:budget], self.parents[:budget], self.depths[:budget], self.scores[:budget])

    def _children(self) -> list[dict[int, int]]:
        """Per row (0: the root, i + 1: node i), its children by token, as node indices."""
        children: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            children[parent + 1][token] = node
        return children

    def follow(self, next_token: Callable[[int], int | None]) -> list[int]:
        """The nodes of the longest root path whose every token is the target's after the path
        before it: next_token(row) gives the target's token after row 0 (the root) or row i + 1
        (node i), None where it has none. Node indices, by depth."""
        children, path, row = self._children(), [], 0
        while (node := children[row].get(next_token(row))) is not None:
            path.append(node)
            row = node + 1
        return path

    def contains(self, path: Sequence[int]) -> bool:
        """Whether the root path of these tokens is in the tree."""
        children, row = self._children(), 0
        for token in path:
            node = children[row].get(token)
            if node is None:
                return False
            row = node + 1
        return True


@dataclass(frozen=True, slots=True)
class GrownTree:
    """A draft tree on the device, [n] each as `Tree` holds it on the host: what the verify forward
    lays out (architectures/tree.py DraftTree) before anything of it is read."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    """float64."""
    depth_bound: int
    """No node deeper: the depths grown (whether or not the best nodes reach the last)."""

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, beside: torch.Tensor | None = None) -> tuple[Tree, list[int]]:
        """The tree on the host, and the integers of `beside` [m] (below 2^53) with it: one read."""
        parts = [self.tokens.double(), self.parents.double(), self.depths.double(), self.scores]
        values = torch.cat(parts if beside is None else [*parts, beside.double()]).tolist()
        n = len(self)
        tokens, parents, depths = ([int(v) for v in values[i * n : (i + 1) * n]] for i in range(3))
        return Tree(tokens, parents, depths, values[3 * n : 4 * n]), [int(v) for v in values[4 * n :]]


def grow_tree(branches: Branches, *, budget: int, depth_limit: int) -> GrownTree:
    """DDTree's tree on the device: the `budget` highest-scoring nodes no deeper than `depth_limit`
    (and the drafted slots), ordered by (score descending, ranks down the path ascending) as a
    best-first search pops them (a child never comes before its parent, nor a sibling before an
    earlier one), built without reading the drafter's ranking back.

    A depth at a time: of the children of the nodes kept at the depth above, those of the
    `budget - depth + 1` best keys are kept (a node among the best `budget` has its depth - 1
    ancestors before it, so fewer than that many of its depth's nodes; and its parent is among the
    best, so kept). The kept nodes, every depth's, are then put in the order above and the first
    `budget` taken. A path's cost is minus its score, float32 log-probabilities taken off in float64
    root first: exactly minus the host's sum, and never -0.0 (0.0 - x is not), which sorts apart."""
    depth_limit = min(depth_limit, branches.depths, budget)
    device = branches.device
    levels: list[_Level] = []
    parents, parent_costs = anchor_ids(branches.anchor, device), torch.zeros(1, dtype=torch.float64, device=device)
    for depth in range(1, depth_limit + 1):
        tokens, log_probs = branches.ranked(depth, parents, budget)  # [P, c]
        costs = (parent_costs[:, None] - log_probs.double()).flatten()  # in the order of the ranks down their paths
        kept = torch.arange(len(costs), device=device)
        if len(costs) > budget - depth + 1:
            kept = torch.sort(costs, stable=True).indices[: budget - depth + 1].sort().values  # the best, back in that order
        parents, parent_costs = tokens.flatten()[kept], costs[kept]
        levels.append(_Level(parents, parent_costs, kept // tokens.shape[1]))
    if not levels:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return GrownTree(empty, empty, empty, empty.double(), 0)
    paths = _path_order(levels)
    costs = torch.cat([level.costs for level in levels])
    order = paths[torch.sort(costs[paths], stable=True).indices][:budget]  # by score, equal scores by the ranks down the path
    starts = [0]
    for level in levels[:-1]:
        starts.append(starts[-1] + len(level.tokens))
    up = torch.cat([torch.full_like(levels[0].up, -1)] + [level.up + start for level, start in zip(levels[1:], starts)])  # the parent, kept-wide
    depths = torch.cat([torch.full_like(level.up, depth) for depth, level in enumerate(levels, 1)])
    node = torch.full_like(up, -1)
    node[order] = torch.arange(len(order), device=device)  # each kept node's index in the tree
    parents = torch.where(up[order] < 0, -1, node[up[order].clamp(min=0)])
    return GrownTree(torch.cat([level.tokens for level in levels])[order], parents, depths[order], -costs[order], len(levels))


@dataclass(frozen=True, slots=True)
class _Level:
    """The nodes kept at one depth, in the order of the ranks down their paths."""

    tokens: torch.Tensor
    costs: torch.Tensor
    up: torch.Tensor
    """Each one's parent: its index among the depth above's."""


def _path_order(levels: list[_Level]) -> torch.Tensor:
    """The kept nodes, every depth's concatenated, in the order of their ranks down the path (a
    path's prefix first): the tree's preorder, children by rank, from the subtrees' sizes."""
    sizes = [torch.ones_like(level.up) for level in levels]
    for depth in reversed(range(len(levels) - 1)):
        sizes[depth].index_add_(0, levels[depth + 1].up, sizes[depth + 1])
    before = [size.cumsum(0) - size for size in sizes]  # the subtrees ahead at the same depth
    preorder = [before[0]]
    for depth in range(1, len(levels)):
        # Siblings are contiguous: a node follows its parent, then its earlier siblings' subtrees: those ahead at its
        # depth less those under the parents ahead of its own (their subtrees' sizes less themselves).
        parent = preorder[-1] - before[depth - 1] + torch.arange(len(before[depth - 1]), device=before[depth].device)
        preorder.append(parent[levels[depth].up] + 1 + before[depth])
    return torch.cat(preorder).argsort()


def build_tree(branches: Branches, *, budget: int, depth_limit: int) -> Tree:
    """`grow_tree`'s tree, read to the host in one read."""
    return grow_tree(branches, budget=budget, depth_limit=depth_limit).read()[0]

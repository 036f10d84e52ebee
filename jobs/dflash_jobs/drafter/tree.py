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

`build_tree` is DDTree's best-first search: a heap of candidates, each a node's next sibling or its
first child; popping the best `budget` times gives the `budget` highest-scoring nodes that form a
tree (a child never scores above its parent, nor a sibling above an earlier one). A parent's
children are ranked by (score descending, token id ascending) everywhere (`rank_top_k`), the order
argmax's tie rule gives, whatever order topk returns equal scores in (bf16 makes them common); equal
path scores go to the smaller path of ranks. So a smaller budget's tree is the first nodes of a
larger one's, and the path of first children (rank 0 at every depth) is the chain the variant
drafts greedily, ties included.

Under greedy verification a tree commits its longest root path whose every token is the target's
greedy choice after the path before it, plus the target's next token (`Tree.follow`).
"""

from __future__ import annotations

import heapq
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dflash_jobs.drafter.model import rank_top_k

Scores = Callable[[int, int], tuple[torch.Tensor, "torch.Tensor | None"]]
"""(depth, parent token) -> the children's scores [n] (log-probabilities up to a constant) and their
token ids [n] (None: the scores cover the vocabulary, the token is its index)."""


class Branches:
    """A parent's children at a depth: tokens and log-probabilities, likeliest first."""

    def __init__(self, anchor: int, depths: int) -> None:
        self.anchor = anchor
        """The last committed token: the parent of the depth-1 children."""
        self.depths = depths
        """The drafted slots: no child deeper than this."""

    def children(self, depth: int, parent: int, k: int) -> tuple[list[int], list[float]]:
        """The k likeliest children of `parent` at `depth` (1-based), as token ids and log-probabilities."""
        raise NotImplementedError

    def chain(self, depths: int) -> list[int]:
        """The first child at every depth down to `depths`: the chain the variant drafts greedily."""
        path, parent = [], self.anchor
        for depth in range(1, depths + 1):
            parent = self.children(depth, parent, 1)[0][0]
            path.append(parent)
        return path


def _ranked(scores: torch.Tensor, ids: torch.Tensor | None, k: int) -> tuple[list[int], list[float]]:
    """The k best of `scores` [n] as (token ids, log-probabilities), best first, equal scores by the
    lower token id (rank_top_k: as the variant's greedy choice breaks them)."""
    order = rank_top_k(scores, k, ids)
    return read_ranked(order if ids is None else ids[order], scores.float().log_softmax(-1)[order])


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
        super().__init__(anchor, len(logits))
        self.logits = logits
        self._ranked: list[tuple[list[int], list[float]]] = []
        self._k = 0

    def children(self, depth: int, parent: int, k: int) -> tuple[list[int], list[float]]:
        if k > self._k:  # every depth ranked at once: one ranking over the block
            order = rank_top_k(self.logits, k)  # [D, k]
            values = self.logits.float().log_softmax(-1).gather(-1, order)
            self._ranked, self._k = list(zip(*read_ranked(order, values))), k
        tokens, log_probs = self._ranked[depth - 1]
        return tokens[:k], log_probs[:k]


class ConditionalBranches(Branches):
    """Slots that depend on the parent (DFlash2's selector, DSpark's Markov head): `scores` gives a
    parent's children at a depth; each (depth, parent) is scored once."""

    def __init__(self, scores: Scores, anchor: int, depths: int) -> None:
        super().__init__(anchor, depths)
        self.scores = scores
        self._ranked: dict[tuple[int, int], tuple[int, tuple[list[int], list[float]]]] = {}

    def children(self, depth: int, parent: int, k: int) -> tuple[list[int], list[float]]:
        known = self._ranked.get((depth, parent))
        if known is None or known[0] < k:
            known = (k, _ranked(*self.scores(depth, parent), k))
            self._ranked[(depth, parent)] = known
        tokens, log_probs = known[1]
        return tokens[:k], log_probs[:k]


EdgeScores = Callable[[torch.Tensor], torch.Tensor]
"""parents [D, P] (row d - 1: parents at depth d) -> the scores [D, P, K] of their edges to depth d's candidates."""


class CandidateBranches(ConditionalBranches):
    """ConditionalBranches whose children at depth d are among a fixed set, candidates[d - 1] (DFlash2's
    strict top-K): a tree's parent at depth d >= 2 is then one of depth d - 1's candidates, so every
    child a tree can take is ranked up front, every depth's in one batched call (`edges`) and one
    read, not a read per parent expanded (each waits for the device). A parent outside them (the
    coverage's greedy token) is ranked on its own, by `scores`."""

    def __init__(self, scores: Scores, edges: EdgeScores, candidates: torch.Tensor, anchor: int) -> None:
        super().__init__(scores, anchor, depths=len(candidates))
        self.edges, self.candidates = edges, candidates
        self._read = False

    def children(self, depth: int, parent: int, k: int) -> tuple[list[int], list[float]]:
        if not self._read:
            self._rank_every_parent()
        return super().children(depth, parent, k)

    def _rank_every_parent(self) -> None:
        D, K = self.candidates.shape
        # [D, K]: the anchor at depth 1 (one parent, repeated for one batched shape), depth d - 1's candidates below
        parents = torch.cat([self.candidates.new_full((1, K), self.anchor), self.candidates[:-1]])
        scores = self.edges(parents).float()  # [D, K parents, K children]
        ids = self.candidates[:, None].expand(D, K, K)
        order = rank_top_k(scores, K, ids)  # every candidate ranked, as scores(depth, parent) would rank them
        ranked = [parents, ids.gather(-1, order), scores.log_softmax(-1).gather(-1, order)]
        # One read (ids below 2^53 and float32 values are exact as float64): the parents, their children and the log-probabilities.
        read = torch.cat([part.double().flatten() for part in ranked]).tolist()
        n = D * K
        parent_ids, tokens, log_probs = read[:n], read[n : n + n * K], read[n + n * K :]
        for row, parent in enumerate(parent_ids):
            children = slice(row * K, (row + 1) * K)
            # sys.maxsize: the ranking holds every child this parent can have, whatever k is asked later
            self._ranked.setdefault((row // K + 1, int(parent)), (sys.maxsize, ([int(t) for t in tokens[children]], log_probs[children])))
        self._read = True


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


def build_tree(branches: Branches, *, budget: int, depth_limit: int) -> Tree:
    """DDTree's best-first tree: the `budget` highest-scoring nodes no deeper than `depth_limit`
    (and the drafted slots). A heap entry is (-score, ranks, parent, depth, rank): the candidate is
    the `rank`-th child of `parent` at `depth`; `ranks` (the ranks down its path) breaks ties."""
    depth_limit = min(depth_limit, branches.depths)
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    if budget < 1 or depth_limit < 1:
        return Tree(tokens, parents, depths, scores)
    offered = {-1: branches.children(1, branches.anchor, budget)}  # each parent's children, likeliest first
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []

    def offer(parent: int, depth: int, rank: int, ranks: tuple[int, ...]) -> None:
        score = (scores[parent] if parent >= 0 else 0.0) + offered[parent][1][rank]
        heapq.heappush(heap, (-score, ranks, parent, depth, rank))

    offer(-1, 1, 0, (0,))
    while heap and len(tokens) < budget:
        negative, ranks, parent, depth, rank = heapq.heappop(heap)
        children = offered[parent][0]
        node = len(tokens)
        tokens.append(children[rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(-negative)
        if rank + 1 < len(children):
            offer(parent, depth, rank + 1, ranks[:-1] + (rank + 1,))
        if depth < depth_limit:
            offered[node] = branches.children(depth + 1, children[rank], budget)
            offer(node, depth + 1, 0, ranks + (0,))
    return Tree(tokens, parents, depths, scores)
